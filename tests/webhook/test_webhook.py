"""The reclaim webhook over real HTTP on loopback, against the real Temporal dev server.

A small recording workflow stands in for TrainingJob here: it upserts `SpotrainNodeIds` like
the real one and records every signal exactly as it arrives, so that each event's effect can be
counted (TrainingJob dedupes, which would hide a duplicate). The real workflow is driven
through the webhook by `spotrain reclaim` (tests/cli/test_cli.py) and the demo.
Only SNS's certificate host cannot be reached from here: `http_get` is a stand-in that serves a
test certificate, and the tests check it is never asked for a URL off the SNS host pattern.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from cryptography.hazmat.primitives.asymmetric import rsa
from kubernetes import client as kube_client
from openapi_spec_validator import validate
from temporalio.api.workflowservice.v1 import ListWorkflowExecutionsRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.embedded.binaries import temporal_cli
from spotrain.workers.webhook.auth import hmac_headers
from spotrain.workers.webhook.events import PlainReclaim
from spotrain.workers.webhook.server import NodeNames, SqsPoller
from spotrain.workflows.job import attributes
from tests.kube.kube_double import KubeDouble
from tests.webhook.webhook_support import (
    CERT_URL,
    EVENTBRIDGE,
    HMAC_SECRET,
    INTERRUPTION,
    OPENAPI,
    REBALANCE,
    STATE_CHANGE,
    TOKEN,
    TOPIC,
    Jobs,
    TcpProxy,
    Webhook,
    aws_event,
    eventually,
    put_ec2_event,
    queued,
    received,
    running_webhook,
    webhook_process,
)

# --- every accepted kind reaches the right job exactly once ---------------------------------


async def test_each_event_kind_signals_its_job_once(hook: Webhook, jobs: Jobs) -> None:
    a = await jobs.start("i-0aaa1", "i-0aaa2")
    b = await jobs.start("i-0bbb1", "ip-10-0-0-7.ec2.internal")
    spot = aws_event(INTERRUPTION, "i-0aaa1", **{"instance-action": "terminate"})
    rebalance = aws_event(REBALANCE, "i-0bbb1")
    gone = aws_event(STATE_CHANGE, "i-0aaa2", state="terminated")
    sends = [
        ("/v1/events/aws", spot),
        ("/v1/events/aws", rebalance),
        ("/v1/events/aws", gone),
        (
            "/v1/reclaims",
            {"instance_id": "i-0bbb1", "event_id": "cli-1", "deadline": "2026-01-02T03:10:00Z"},
        ),
        ("/v1/reclaims", {"instance_id": "i-0aaa1", "event_id": "cli-2", "lost": True}),
        (
            "/v1/events/kubernetes",
            {"EventID": "nth-1", "Kind": "SPOT_ITN", "ProviderID": "aws:///us-east-1a/i-0aaa2"},
        ),
        (
            "/v1/events/kubernetes",
            {"event_id": "k-2", "kind": "STATE_CHANGE", "node_name": "ip-10-0-0-7.ec2.internal"},
        ),
    ]
    owners = [a, b, a, b, a, a, b]  # whose node each send names
    for (path, body), owner in zip(sends, owners, strict=True):
        assert await hook.post(path, body) == (
            200,
            {"status": "signalled", "workflow_ids": [owner.id]},
        ), body
    # The same EventBridge event again, and through SNS: Temporal drops the repeats.
    assert (await hook.post("/v1/events/aws", spot))[0] == 200
    sns_copy = hook.sns.sign({"Type": "Notification", "Message": json.dumps(spot)})
    assert (await hook.post("/v1/events/aws", sns_copy, headers={}))[0] == 200

    def reclaim(node: str, event: str, deadline: str | None, kind: str = "interruption") -> dict:
        return {"signal": "reclaim", "node_id": node, "event_id": event, "deadline": deadline,
                "kind": kind}  # fmt: skip

    expected_a = [
        reclaim("i-0aaa1", spot["id"], "2026-01-02T03:06:05Z"),
        {"signal": "node_lost", "node_id": "i-0aaa2", "event_id": gone["id"]},
        {"signal": "node_lost", "node_id": "i-0aaa1", "event_id": "cli-2"},
        reclaim("i-0aaa2", "nth-1", None),
    ]
    expected_b = [
        reclaim("i-0bbb1", rebalance["id"], None, "rebalance"),
        reclaim("i-0bbb1", "cli-1", "2026-01-02T03:10:00Z"),
        {"signal": "node_lost", "node_id": "ip-10-0-0-7.ec2.internal", "event_id": "k-2"},
    ]
    await eventually(lambda: _has(a, len(expected_a)))
    await asyncio.sleep(0.3)  # room for a wrongly duplicated signal to show up
    assert await received(a) == expected_a
    assert await received(b) == expected_b


async def _has(handle: WorkflowHandle[Any, Any], count: int) -> bool:
    return len(await received(handle)) >= count


async def test_kubernetes_node_names_resolve_to_instances(
    dev_env: WorkflowEnvironment, jobs: Jobs
) -> None:
    """EKS names nodes by private DNS name: with SPOTRAIN_WEBHOOK_KUBE_NODES the webhook asks
    the Kubernetes API (here the in-process double of tests/kube/kube_double.py: no kube-apiserver
    runs on these machines) for the node's providerID and signals the instance's job."""
    kube = KubeDouble()
    with kube.serve():
        kube.add_node("ip-10-0-9-9.ec2.internal", "i-0ddd1")
        job = await jobs.start("i-0ddd1")
        async with running_webhook(dev_env.client, NodeNames(kube.api_client())) as webhook:
            notice = {
                "event_id": "k-9",
                "kind": "SPOT_ITN",
                "node_name": "ip-10-0-9-9.ec2.internal",
            }
            assert await webhook.post("/v1/events/kubernetes", notice) == (
                200,
                {"status": "signalled", "workflow_ids": [job.id]},
            )
            stranger = notice | {"event_id": "k-10", "node_name": "ip-10-0-0-99.ec2.internal"}
            assert await webhook.post("/v1/events/kubernetes", stranger) == (
                202,
                {"status": "unknown_instance"},
            )
    await eventually(lambda: _has(job, 1))
    (signal,) = await received(job)
    assert (signal["node_id"], signal["event_id"]) == ("i-0ddd1", "k-9")


async def test_a_kubernetes_api_that_does_not_answer_a_node_lookup_is_a_503(
    dev_env: WorkflowEnvironment,
) -> None:
    """SPOTRAIN_WEBHOOK_KUBE_NODES with the Kubernetes API down (a closed port): the node-name
    notice is a 503 with Retry-After, as a Temporal outage is, so the sender retries and the
    notice is not lost (it was a 500). An API that answers with an error is the same (the
    lookup's ApiException other than 404)."""
    down = kube_client.ApiClient(kube_client.Configuration(host="http://127.0.0.1:9"))
    async with running_webhook(dev_env.client, NodeNames(down)) as webhook:
        notice = {"event_id": "k-1", "kind": "SPOT_ITN", "node_name": "ip-10-0-9-9.ec2.internal"}
        assert await webhook.post("/v1/events/kubernetes", notice) == (
            503,
            {"error": "kubernetes unavailable"},
        )


async def test_unknown_instances_and_kinds_are_acknowledged(hook: Webhook) -> None:
    unknown = aws_event(INTERRUPTION, "i-0nobody")
    assert await hook.post("/v1/events/aws", unknown) == (202, {"status": "unknown_instance"})
    status, body = await hook.post("/v1/events/aws", aws_event("EC2 AMI State Change", "i-1"))
    assert (status, body["status"]) == (202, "ignored")
    running = aws_event(STATE_CHANGE, "i-0aaa1", state="running")
    assert (await hook.post("/v1/events/aws", running))[0] == 202
    kube = {"event_id": "k", "kind": "ASG_LIFECYCLE", "instance_id": "i-0aaa1"}
    assert (await hook.post("/v1/events/kubernetes", kube))[0] == 202


async def test_bad_input_gets_the_right_status(hook: Webhook) -> None:
    assert (await hook.post("/v1/reclaims", b'{"instance_id": '))[0] == 400
    status, body = await hook.post("/v1/reclaims", {"instance_id": "i-1"})
    assert (status, body["field"]) == (422, "event_id")
    status, body = await hook.post("/v1/reclaims", {"instance_id": "x' OR 1=1", "event_id": "e"})
    assert (status, body["field"]) == (422, "instance_id")
    status, body = await hook.post(
        "/v1/events/aws", aws_event(INTERRUPTION, "i-1") | {"time": "soon"}
    )
    assert (status, body["field"]) == (422, "time")
    assert (await hook.post("/v1/events/kubernetes", {"event_id": "e", "kind": "SPOT_ITN"}))[
        0
    ] == 422
    assert (await hook.post("/v1/reclaims", b"x" * (64 * 1024 + 1)))[0] == 413


# --- authentication --------------------------------------------------------------------------


async def test_forged_and_unsigned_requests_are_refused(hook: Webhook, jobs: Jobs) -> None:
    job = await jobs.start("i-0auth1")
    body = json.dumps({"instance_id": "i-0auth1", "event_id": "forged"}).encode()
    stale = hmac_headers(HMAC_SECRET, body, "POST", "/v1/reclaims", now=time.time() - 600)
    refused = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        hmac_headers("other-secret", body, "POST", "/v1/reclaims"),
        stale,
        hmac_headers(HMAC_SECRET, body + b" ", "POST", "/v1/reclaims"),  # another body
    ]
    for headers in refused:
        for path in ("/v1/reclaims", "/v1/events/aws", "/v1/events/kubernetes"):
            assert (await hook.post(path, body, headers=headers))[0] == 401, (path, headers)
    event = aws_event(INTERRUPTION, "i-0auth1")
    other_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    notification = {"Type": "Notification", "Message": json.dumps(event)}
    tampered = json.loads(hook.sns.sign(notification))
    tampered["Message"] = json.dumps(event | {"id": "tampered"})
    for forged in [
        hook.sns.sign(notification, key=other_key),
        hook.sns.sign(notification | {"TopicArn": TOPIC + "-other"}),
        hook.sns.sign(notification | {"SigningCertURL": "https://evil.example/x.pem"}),
        hook.sns.sign(
            notification | {"SigningCertURL": CERT_URL.replace(".com/", ".com.evil.io/")}
        ),
        json.dumps(tampered).encode(),
        json.dumps(event).encode(),  # plain event, no SNS envelope, no credentials
        json.dumps(notification | {"TopicArn": [TOPIC]}).encode(),  # (found by the fuzzer)
        json.dumps(notification | {"TopicArn": TOPIC, "Type": ["Notification"]}).encode(),
    ]:
        assert (await hook.post("/v1/events/aws", forged, headers={}))[0] == 401
    assert all(url == CERT_URL for url in hook.sns.urls)
    assert len(hook.sns.urls) <= 1  # the certificate is cached
    await asyncio.sleep(0.3)
    assert await received(job) == []
    # The same requests properly signed go through.
    assert (
        await hook.post(
            "/v1/reclaims", body, headers=hmac_headers(HMAC_SECRET, body, "POST", "/v1/reclaims")
        )
    )[0] == 200
    assert (await hook.post("/v1/events/aws", hook.sns.sign(notification), headers={}))[0] == 200
    await eventually(lambda: _has(job, 2))
    assert [s["event_id"] for s in await received(job)] == ["forged", event["id"]]


async def test_sns_subscription_confirmation(hook: Webhook) -> None:
    subscribe = "https://sns.us-east-1.amazonaws.com/?Action=ConfirmSubscription&Token=t"
    confirmation = {
        "Type": "SubscriptionConfirmation",
        "Message": "You have chosen to subscribe",
        "Token": "t",
        "SubscribeURL": subscribe,
    }
    status, body = await hook.post("/v1/events/aws", hook.sns.sign(confirmation), headers={})
    assert (status, body) == (200, {"status": "subscribed"})
    assert hook.sns.urls[-1] == subscribe
    evil = confirmation | {"SubscribeURL": "https://evil.example/?Action=ConfirmSubscription"}
    assert (await hook.post("/v1/events/aws", hook.sns.sign(evil), headers={}))[0] == 422
    assert hook.sns.urls[-1] == subscribe


async def test_health_readiness_and_metrics(hook: Webhook, jobs: Jobs) -> None:
    await jobs.start("i-0metrics1")  # what the metrics below count, made here
    assert (await hook.post("/v1/events/aws", aws_event(INTERRUPTION, "i-0nobody1")))[0] == 202
    gone = aws_event(STATE_CHANGE, "i-0metrics1", state="terminated")
    assert (await hook.post("/v1/events/aws", gone))[0] == 200
    assert (await hook.post("/v1/reclaims", {"instance_id": "i-0x"}, headers={}))[0] == 401
    async with hook.http.get(hook.url + "/healthz") as resp:
        assert resp.status == 200
    async with hook.http.get(hook.url + "/readyz") as resp:
        assert resp.status == 200
    async with hook.http.get(hook.url + "/metrics") as resp:
        text = await resp.text()
    assert 'spotrain_webhook_events_total{kind="interruption",source="aws"}' in text
    assert 'spotrain_webhook_signals_total{signal="node_lost"}' in text
    assert 'spotrain_webhook_requests_total{code="401",path="/v1/reclaims"}' in text
    assert "spotrain_webhook_signal_latency_seconds_count" in text
    assert TOKEN not in text and HMAC_SECRET not in text


# --- queue mode ------------------------------------------------------------------------------


PROVIDER_MIRROR = Path(os.environ.get("SPOTRAIN_TF_PLUGIN_DIR", "/opt/tf-plugins"))


async def test_sqs_poller_deletes_only_handled_messages(
    hook: Webhook, jobs: Jobs, queue: tuple[Any, str], moto_endpoint: str
) -> None:
    sqs, url = queue
    job = await jobs.start("i-0sqs1")
    put_ec2_event(moto_endpoint, INTERRUPTION, {"instance-id": "i-0sqs1"})
    put_ec2_event(moto_endpoint, STATE_CHANGE, {"instance-id": "i-0sqs1", "state": "terminated"})
    put_ec2_event(moto_endpoint, STATE_CHANGE, {"instance-id": "i-0sqs1", "state": "running"})
    put_ec2_event(moto_endpoint, "EC2 AMI State Change", {"ImageId": "ami-1"})
    assert queued(sqs, url) == 2  # the rules' patterns let only reclaim-relevant events in
    sqs.send_message(QueueUrl=url, MessageBody="not json")
    poller = SqsPoller(sqs, url, hook.service.dispatcher, wait_s=1, visibility_s=30)
    assert await poller.poll_once() == 3
    assert queued(sqs, url) == 0
    await eventually(lambda: _has(job, 2))
    assert [s["signal"] for s in await received(job)] == ["reclaim", "node_lost"]


# --- a Temporal outage: 503, and nothing lost -------------------------------------------------


async def test_a_temporal_that_answers_too_late_is_a_503_that_says_so(
    dev_env: WorkflowEnvironment, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = TcpProxy(int(dev_env.client.service_client.config.target_host.rsplit(":", 1)[1]))
    await proxy.up()
    client = await Client.connect(f"127.0.0.1:{proxy.port}", data_converter=pydantic_data_converter)
    notice = {"instance_id": "i-0slow1", "event_id": "slow-1"}
    try:
        async with running_webhook(client, rpc_timeout_s=1.0) as hook:
            proxy.flowing.clear()
            assert (await hook.post("/v1/reclaims", notice))[0] == 503
            proxy.flowing.set()

            async def sender_retry() -> bool:  # nobody's node: 202 once Temporal answers
                return (await hook.post("/v1/reclaims", notice))[0] == 202

            await eventually(sender_retry)
            retries = hook.service.metrics.counters[("spotrain_webhook_temporal_retries_total", ())]
    finally:
        proxy.flowing.set()
        await proxy.down()
    said = [json.loads(r.getMessage()) for r in caplog.records if r.name == "spotrain.webhook"]
    late = {(s["status"], s["message"]) for s in said if s["event"] == "temporal_unavailable"}
    assert late == {("CANCELLED", "Timeout expired")}, said
    assert retries == 0  # a call that ran out its own time is not tried again within the request


async def test_temporal_outage_returns_503_and_loses_nothing(
    dev_env: WorkflowEnvironment, jobs: Jobs, queue: tuple[Any, str], moto_endpoint: str
) -> None:
    job = await jobs.start("i-0out1")
    proxy = TcpProxy(int(dev_env.client.service_client.config.target_host.rsplit(":", 1)[1]))
    await proxy.up()
    client = await Client.connect(f"127.0.0.1:{proxy.port}", data_converter=pydantic_data_converter)
    sqs, url = queue
    async with running_webhook(client, rpc_timeout_s=1.0) as hook:
        poller = SqsPoller(sqs, url, hook.service.dispatcher, wait_s=1, visibility_s=1)
        event = aws_event(INTERRUPTION, "i-0out1")
        await proxy.down()
        assert (await hook.post("/v1/events/aws", event))[0] == 503
        async with hook.http.get(hook.url + "/readyz") as resp:
            assert resp.status == 503
        put_ec2_event(
            moto_endpoint, STATE_CHANGE, {"instance-id": "i-0out1", "state": "terminated"}
        )
        assert await poller.poll_once() == 0
        assert queued(sqs, url) == 1  # kept for redelivery
        await proxy.up()

        async def sender_retry() -> bool:  # what EventBridge / SNS / NTH do on 503
            return (await hook.post("/v1/events/aws", event))[0] == 200

        await eventually(sender_retry)
        await asyncio.sleep(1.1)  # the message's visibility timeout
        assert await poller.poll_once() == 1
        assert queued(sqs, url) == 0
    await eventually(lambda: _has(job, 2))
    await asyncio.sleep(0.3)
    assert [(s["signal"], s["node_id"]) for s in await received(job)] == [
        ("reclaim", "i-0out1"),
        ("node_lost", "i-0out1"),
    ]
    await proxy.down()


async def test_temporal_rate_limit_is_waited_out_not_passed_to_the_sender() -> None:
    """Temporal answers RESOURCE_EXHAUSTED past a rate limit (here: a dev server of its own
    allowing 4 visibility queries a second; each event is one lookup). The webhook waits it
    out briefly: a burst of events is all accepted, none answered 503."""
    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=temporal_cli(),
        search_attributes=attributes.ALL,
        dev_server_extra_args=["--dynamic-config-value", "frontend.namespaceRPS.visibility=4"],
    )
    try:
        lookup = ListWorkflowExecutionsRequest(namespace=env.client.namespace)
        refused = []
        for _ in range(12):  # the limit is real: raw calls in a burst are refused
            try:
                await env.client.workflow_service.list_workflow_executions(lookup, retry=False)
            except RPCError as e:
                refused.append(e.status)
        assert refused and set(refused) == {RPCStatusCode.RESOURCE_EXHAUSTED}
        await asyncio.sleep(1.0)  # the bucket refills
        async with running_webhook(env.client) as hook:
            answers = [
                await hook.post("/v1/events/aws", aws_event(INTERRUPTION, f"i-0burst{i}"))
                for i in range(12)
            ]
    finally:
        await env.shutdown()
    assert answers == [(202, {"status": "unknown_instance"})] * 12


# --- latency ---------------------------------------------------------------------------------


async def test_latency_request_to_signal_accepted(hook: Webhook, jobs: Jobs) -> None:
    """Sequential requests, each answered only after Temporal accepted its signal. Server
    side: the latency histogram's sum grows by exactly each request's received -> accepted."""
    await jobs.start("i-0lat1")
    metrics = hook.service.metrics
    server_side, client_side = [], []
    for i in range(300):
        started, sum_before = time.perf_counter(), metrics.latency_sum
        body = {"instance_id": "i-0lat1", "event_id": f"lat-{i}", "kind": "rebalance"}
        assert (await hook.post("/v1/reclaims", body))[0] == 200
        client_side.append(time.perf_counter() - started)
        server_side.append(metrics.latency_sum - sum_before)
    for name, samples in (("server", server_side), ("client", client_side)):
        median, p99 = statistics.median(samples), statistics.quantiles(samples, n=100)[98]
        print(f"\nrequest -> signal accepted ({name} side, 300 requests): "
              f"median {median * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms", end="")  # fmt: skip
    assert all(0 < s <= c for s, c in zip(server_side, client_side, strict=True))
    assert statistics.quantiles(server_side, n=100)[98] < 1.0


# --- the OpenAPI description matches the service ----------------------------------------------


def test_openapi_describes_the_routes_and_the_plain_form(hook: Webhook) -> None:
    spec = yaml.safe_load(OPENAPI.read_text())
    validate(spec)
    described = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    served = {
        (r.method, r.resource.canonical)
        for r in hook.service.app.router.routes()
        if r.method != "HEAD" and r.resource
    }
    assert described == served
    plain = spec["components"]["schemas"]["PlainReclaim"]["properties"]
    assert set(plain) == set(PlainReclaim.model_fields)


@pytest.mark.skipif(not shutil.which("terraform"), reason="terraform not installed")
def test_terraform_is_formatted_and_valid(tmp_path: Path) -> None:
    """Offline: `terraform fmt`, and `validate` when the AWS provider is in a local mirror."""
    fmt = subprocess.run(["terraform", "fmt", "-check", "-recursive", str(EVENTBRIDGE)])
    assert fmt.returncode == 0
    if not PROVIDER_MIRROR.is_dir():
        pytest.skip(f"no provider mirror at {PROVIDER_MIRROR}: validate needs the AWS provider")
    module = shutil.copytree(EVENTBRIDGE, tmp_path / "eventbridge")
    tf = ["terraform", f"-chdir={module}"]
    init = [*tf, "init", "-backend=false", "-input=false", f"-plugin-dir={PROVIDER_MIRROR}"]
    subprocess.run(init, check=True, capture_output=True)
    validate = subprocess.run([*tf, "validate", "-json"], capture_output=True, text=True)
    assert json.loads(validate.stdout)["valid"], validate.stdout


async def test_service_process_reads_its_config_from_env_and_files(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Temporal's standard env vars, the token from a mounted file, structured logs that never
    show it."""
    token_file = tmp_path / "token"
    token_file.write_text("file-token-123\n")
    settings = {"SPOTRAIN_WEBHOOK_TOKEN_FILE": str(token_file)}
    async with webhook_process(dev_env, settings) as (url, output), aiohttp.ClientSession() as http:
        body = {"instance_id": "i-0proc", "event_id": "p1"}
        headers = {"Authorization": "Bearer file-token-123"}
        async with http.post(url + "/v1/reclaims", json=body, headers=headers) as resp:
            assert resp.status == 202
        async with http.post(url + "/v1/reclaims", json=body) as resp:
            assert resp.status == 401
    assert '"event": "unknown_instance"' in output[0] and '"node_id": "i-0proc"' in output[0]
    assert "file-token-123" not in output[0]


async def test_service_process_refuses_a_queue_it_was_not_told_it_owns(
    dev_env: WorkflowEnvironment,
) -> None:
    env = os.environ | {
        "SPOTRAIN_WEBHOOK_QUEUE_URL": "http://127.0.0.1:1/q",
        "SPOTRAIN_WEBHOOK_PORT": "0",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "spotrain.workers.webhook.server", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output = (await asyncio.wait_for(proc.communicate(), 60))[0].decode()
    assert proc.returncode != 0
    assert "SPOTRAIN_WEBHOOK_QUEUE_DEDICATED=1" in output and "Traceback" not in output
