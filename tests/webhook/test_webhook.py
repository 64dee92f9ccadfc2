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
import base64
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import boto3
import pytest
import pytest_asyncio
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID
from openapi_spec_validator import validate
from temporalio import workflow
from temporalio.api.workflowservice.v1 import ListWorkflowExecutionsRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from spotrain.workers import webhook
from spotrain.workers.embedded.binaries import temporal_cli
from spotrain.workers.webhook.auth import AuthConfig, hmac_headers, sns_string_to_sign
from spotrain.workers.webhook.events import PlainReclaim
from spotrain.workers.webhook.server import (
    NodeNames,
    SqsPoller,
    WebhookConfig,
    WebhookService,
)
from spotrain.workflows.contract import NodeLost, ReclaimNotice
from spotrain.workflows.job import attributes
from tests.kube.kube_double import KubeDouble

TOKEN = "test-token-not-a-secret"
HMAC_SECRET = "test-hmac-secret"
TOPIC = "arn:aws:sns:us-east-1:123456789012:spotrain-reclaims"
CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-0123abcd.pem"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
OPENAPI = Path(webhook.__file__).with_name("openapi.yaml")


@workflow.defn(name="RecordingJob")
class RecordingJob:
    """Stands in for TrainingJob: owns `node_ids` and records the signals it receives."""

    def __init__(self) -> None:
        self.signals: list[dict[str, Any]] = []

    @workflow.run
    async def run(self, node_ids: list[str]) -> None:
        workflow.upsert_search_attributes([attributes.NODE_IDS.value_set(node_ids)])
        await workflow.wait_condition(lambda: False)

    @workflow.signal(name="reclaim")
    def reclaim(self, notice: ReclaimNotice) -> None:
        self.signals.append({"signal": "reclaim", **notice.model_dump(mode="json")})

    @workflow.signal(name="node_lost")
    def node_lost(self, lost: NodeLost) -> None:
        self.signals.append({"signal": "node_lost", **lost.model_dump(mode="json")})

    @workflow.query
    def received(self) -> list[dict[str, Any]]:
        return self.signals


# --- fixtures and helpers shared with test_webhook_fuzz.py ----------------------------------


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@dataclass
class Jobs:
    client: Client
    task_queue: str

    async def start(self, *node_ids: str) -> WorkflowHandle[Any, Any]:
        """A running RecordingJob, once the visibility query the webhook uses finds it."""
        handle = await self.client.start_workflow(
            "RecordingJob", list(node_ids), id=f"rec-{uuid.uuid4()}", task_queue=self.task_queue
        )
        query = f"SpotrainNodeIds = '{node_ids[0]}' AND ExecutionStatus = 'Running'"

        async def visible() -> bool:
            return any([w.id == handle.id async for w in self.client.list_workflows(query)])

        await eventually(visible)
        return handle


async def received(handle: WorkflowHandle[Any, Any]) -> list[dict[str, Any]]:
    return await handle.query("received")


@contextlib.asynccontextmanager
async def recording_worker(client: Client) -> AsyncIterator[Jobs]:
    task_queue = f"webhook-{uuid.uuid4()}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[RecordingJob],
        workflow_runner=UnsandboxedWorkflowRunner(),  # a test double, no sandbox needed
    ):
        yield Jobs(client, task_queue)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def jobs(dev_env: WorkflowEnvironment) -> AsyncIterator[Jobs]:
    async with recording_worker(dev_env.client) as recording:
        yield recording


def _cert(
    subject: str, key: rsa.RSAPrivateKey, issuer: tuple[x509.Certificate, rsa.RSAPrivateKey] | None
) -> x509.Certificate:
    """A test CA (issuer None) or a server certificate for `subject`, as a public CA makes
    them (cryptography's verifier checks the same extensions a browser does)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.now(UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(ski, critical=False)
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)  # keyCertSign, cRLSign
        return builder.sign(key, hashes.SHA256())
    issuer_ski = issuer[0].extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), False)
        .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(issuer_ski), False
        )
    )
    return builder.sign(issuer[1], hashes.SHA256())


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@dataclass
class FakeSnsHost:
    """Serves a test certificate for sns.amazonaws.com, issued by a test CA that the webhook
    trusts in place of the public roots (no internet here); records every URL asked."""

    ca_file: str
    key: rsa.RSAPrivateKey = field(default_factory=_new_key)
    urls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        ca_key = _new_key()
        ca = _cert("spotrain test CA", ca_key, None)
        self.cert = _cert("sns.amazonaws.com", self.key, (ca, ca_key))
        Path(self.ca_file).write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    async def get(self, url: str) -> bytes:
        self.urls.append(url)
        return self.cert_pem() if url.endswith(".pem") else b"<ConfirmSubscriptionResponse/>"

    def sign(self, message: dict[str, Any], key: rsa.RSAPrivateKey | None = None) -> bytes:
        message = {
            "MessageId": str(uuid.uuid4()),
            "TopicArn": TOPIC,
            "Timestamp": datetime.now(UTC).isoformat(),
            "SignatureVersion": "2",
            "SigningCertURL": CERT_URL,
            **message,
        }
        signature = (key or self.key).sign(
            sns_string_to_sign(message), padding.PKCS1v15(), hashes.SHA256()
        )
        message["Signature"] = base64.b64encode(signature).decode()
        return json.dumps(message).encode()


@dataclass
class Webhook:
    service: WebhookService
    url: str
    http: aiohttp.ClientSession
    sns: FakeSnsHost

    async def post(
        self, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(
            self.url + path, data=data, headers=BEARER if headers is None else headers
        ) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if text.startswith("{") else {}


@contextlib.asynccontextmanager
async def running_webhook(
    client: Client,
    node_names: NodeNames | None = None,
    *,
    topics: tuple[str, ...] = (),
    http_get: Callable[[str], Awaitable[bytes]] | None = None,
    clock: Callable[[], float] = time.time,
    public_roots: bool = False,
    hmac_legacy: bool = False,
    **config: Any,
) -> AsyncIterator[Webhook]:
    """The service on a free port; SNS certificates are trusted from the test CA, or with
    `public_roots` from the public roots (certifi), as in production."""
    ca_file = os.path.join(tempfile.mkdtemp(prefix="spotrain-ca-"), "ca.pem")
    sns = FakeSnsHost(ca_file)
    auth = AuthConfig(
        bearer_token=TOKEN,
        hmac_secret=HMAC_SECRET,
        sns_topic_arns=frozenset([TOPIC, *topics]),
        hmac_legacy=hmac_legacy,
        **({} if public_roots else {"sns_ca_file": ca_file}),
    )
    service = WebhookService(
        client,
        WebhookConfig(auth=auth, host="127.0.0.1", port=0, **config),
        http_get=http_get or sns.get,
        node_names=node_names,
        clock=clock,
    )
    port = await service.start()
    async with aiohttp.ClientSession() as http:
        yield Webhook(service, f"http://127.0.0.1:{port}", http, sns)
    await service.stop()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def hook(dev_env: WorkflowEnvironment) -> AsyncIterator[Webhook]:
    async with running_webhook(dev_env.client) as webhook:
        yield webhook


def aws_event(kind: str, instance_id: str, **detail: str) -> dict[str, Any]:
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": kind,
        "source": "aws.ec2",
        "account": "123456789012",
        "time": "2026-01-02T03:04:05Z",
        "region": "us-east-1",
        "resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{instance_id}"],
        "detail": {"instance-id": instance_id, **detail},
    }


INTERRUPTION = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
STATE_CHANGE = "EC2 Instance State-change Notification"


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


async def test_health_readiness_and_metrics(hook: Webhook) -> None:
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


EVENTBRIDGE = Path(__file__).parents[2] / "infra" / "aws" / "eventbridge"
PROVIDER_MIRROR = Path(os.environ.get("SPOTRAIN_TF_PLUGIN_DIR", "/opt/tf-plugins"))


@pytest.fixture
def queue(moto_endpoint: str) -> tuple[Any, str]:
    """An SQS queue fed by EventBridge rules with infra/aws/eventbridge's event patterns."""
    sqs = boto3.client("sqs", endpoint_url=moto_endpoint, region_name="us-east-1")
    events = boto3.client("events", endpoint_url=moto_endpoint, region_name="us-east-1")
    name = f"reclaims-{uuid.uuid4().hex[:8]}"
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]
    for pattern in sorted((EVENTBRIDGE / "patterns").glob("*.json")):
        rule = f"{name}-{pattern.stem}"
        events.put_rule(Name=rule, EventPattern=pattern.read_text())
        events.put_targets(Rule=rule, Targets=[{"Id": "q", "Arn": arn["QueueArn"]}])
    return sqs, url


def put_ec2_event(moto_endpoint: str, kind: str, detail: dict[str, str]) -> None:
    events = boto3.client("events", endpoint_url=moto_endpoint, region_name="us-east-1")
    entry = {"Source": "aws.ec2", "DetailType": kind, "Detail": json.dumps(detail)}
    assert events.put_events(Entries=[entry])["FailedEntryCount"] == 0


def queued(sqs: Any, url: str) -> int:
    attrs = sqs.get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return sum(int(v) for v in attrs.values())


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


class TcpProxy:
    """A loopback TCP proxy to the dev server that the test can cut and restore: a real
    outage as the webhook's gRPC client sees it, without restarting Temporal."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        assert self._server
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))


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


@contextlib.asynccontextmanager
async def webhook_process(
    dev_env: WorkflowEnvironment, settings: dict[str, str]
) -> AsyncIterator[tuple[str, list[str]]]:
    """`python -m spotrain.workers.webhook.server` as a real process on a free port, ready (Temporal
    answers); yields its URL and, once it has stopped, its output (in the list)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {
        "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host,
        "SPOTRAIN_WEBHOOK_HOST": "127.0.0.1",
        "SPOTRAIN_WEBHOOK_PORT": str(port),
        **settings,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "spotrain.workers.webhook.server", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    output: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/readyz") as resp:
                        return resp.status == 200
                return False

            await eventually(ready, timeout=30)
        yield url, output
    finally:
        proc.terminate()
        output.append((await proc.communicate())[0].decode())


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
