"""Payloads published by others (tests/webhook/corpus, sources in its SOURCES.md) through the
real webhook on loopback, against the real Temporal dev server: the signal each produces, its
deadline and event id, and the HTTP answer. Also the trust and robustness rules that real
inputs exposed (SNS certificate pinning and freshness, HMAC headers, far-calendar times,
poison messages in queue mode, shared queues, HTTPS_PROXY).

The SNS messages are real deliveries signed by SNS in 2022 with SNS's real certificate; the
webhook checks them against the real Amazon root (certifi) with the clock set to their day.
Only the two certificate downloads are served by a stand-in (no internet here)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.webhook.auth import (
    TIMESTAMP_HEADER,
    AuthConfig,
    SnsRejected,
    SnsVerifier,
    hmac_headers,
)
from spotrain.workers.webhook.server import ConfigError, SqsPoller, WebhookConfig, WebhookService
from spotrain.workflows.contract import ReclaimNotice
from tests.webhook.webhook_support import (
    HMAC_SECRET,
    Jobs,
    Webhook,
    eventually,
    queued,
    received,
    running_webhook,
)

DATA = Path(__file__).with_name("corpus")
SNS_DIR = DATA / "sns"
SNS_TOPIC_2022 = [json.loads(p.read_text())["TopicArn"] for p in sorted(SNS_DIR.glob("*.json"))]
LEAF_URL = "https://sns.us-east-2.amazonaws.com/SimpleNotificationService-7ff5318490ec183fbaddaa2a969abfda.pem"
ISSUER_URL = "http://crt.sca1b.amazontrust.com/sca1b.crt"


def load(name: str) -> dict[str, Any]:
    return json.loads((DATA / name).read_text())


def sentinel(node_id: str) -> dict[str, Any]:
    return {"instance_id": node_id, "event_id": f"sentinel-{node_id}", "kind": "rebalance"}


async def signals_after(hook: Webhook, job: Any, node_id: str) -> list[dict[str, Any]]:
    """Every signal the job got, once a sentinel sent after the payload has arrived: signals
    from one sender arrive in order, so nothing the payload caused can still be on its way."""
    assert (await hook.post("/v1/reclaims", sentinel(node_id)))[0] == 200

    async def arrived() -> bool:
        return any(s["event_id"] == f"sentinel-{node_id}" for s in await received(job))

    await eventually(arrived)
    return [s for s in await received(job) if s["event_id"] != f"sentinel-{node_id}"]


def expect(
    signal: str, node: str, event_id: str, deadline: str | None = None, kind: str = ""
) -> dict[str, Any]:
    out: dict[str, Any] = {"signal": signal, "node_id": node, "event_id": event_id}
    if signal == "reclaim":
        out["deadline"] = deadline
        out["kind"] = kind or "interruption"
    return out


SPOT_ID = "1e5527d7-bb36-4607-3370-4164db56a40e"
HEALTH_ID = "7fb65329-1628-4cf3-a740-95fg457h1402"
NODE = "i-0b662ef9931388ba0"

# file, node the job owns, expected HTTP status, expected signals
CORPUS: list[tuple[str, str, str, int, list[dict[str, Any]]]] = [
    # EventBridge events (direct, as an API destination sends them)
    ("/v1/events/aws", "eventbridge/nth-spot-itn.json", NODE, 200,
     [expect("reclaim", NODE, SPOT_ID, "1970-01-01T00:02:00Z")]),
    ("/v1/events/aws", "eventbridge/nth-rebalance-recommendation.json", NODE, 200,
     [expect("reclaim", NODE, "5d5555d5-dd55-5555-5555-5555dd55d55d", kind="rebalance")]),
    ("/v1/events/aws", "eventbridge/nth-asg-lifecycle-terminate.json", "i-0633ac2b0d9769723",
     202, []),
    ("/v1/events/aws", "eventbridge/nth-state-change-pending.json", "i-abcd1111", 202, []),
    # a scheduled change: its own kind, due at the event's startTime (RFC 1123 in the event)
    ("/v1/events/aws", "eventbridge/nth-health-scheduled-change.json", "i-12345678", 200,
     [expect("reclaim", "i-12345678", f"{HEALTH_ID}/i-12345678", "2016-06-05T15:10:09Z",
             kind="scheduled")]),
    ("/v1/events/aws", "eventbridge/karpenter-health-scheduled-change.json",
     "i-0cafe0000000000b2", 200,
     [expect("reclaim", "i-0cafe0000000000b2",
             "5b0e8a3c-6f1d-4c2a-9e7b-2d4f6a8c0e13/i-0cafe0000000000b2", kind="scheduled")]),
    ("/v1/events/aws", "eventbridge/aws-docs-capacity-reservation-interruption.json",
     "i-1234567890abcdef0", 200,
     [expect("reclaim", "i-1234567890abcdef0", "12345678-1234-1234-1234-123456789012",
             "2026-03-01T10:02:00Z")]),
    ("/v1/events/aws", "eventbridge/karpenter-state-change-stopping.json", "i-0cafe0000000000a1",
     200, [expect("node_lost", "i-0cafe0000000000a1", "d3b1d0a1-5c3e-4c53-9a6b-0e2f7c1d9a10")]),
    # aws-node-termination-handler's webhook, queue mode: StartTime is when EventBridge sent
    # the notice; the event id is EventBridge's again
    ("/v1/events/kubernetes", "nth/queue-spot-itn.json", NODE, 200,
     [expect("reclaim", NODE, SPOT_ID, "1970-01-01T00:02:00Z")]),
    ("/v1/events/kubernetes", "nth/queue-rebalance-recommendation.json", NODE, 200,
     [expect("reclaim", NODE, "5d5555d5-dd55-5555-5555-5555dd55d55d", kind="rebalance")]),
    ("/v1/events/kubernetes", "nth/queue-health-scheduled-change.json", "i-12345678", 200,
     [expect("reclaim", "i-12345678", f"{HEALTH_ID}/i-12345678", kind="scheduled")]),
    ("/v1/events/kubernetes", "nth/queue-state-change-stopping.json", "i-abcd1111", 200,
     [expect("node_lost", "i-abcd1111", "7bf73129-1428-4cd3-a780-95db273d1602")]),
    # IMDS mode: StartTime is the termination time itself
    ("/v1/events/kubernetes", "nth/imds-spot-itn.json", NODE, 200,
     [expect("reclaim", NODE, load("nth/imds-spot-itn.json")["EventID"], "2017-09-18T08:22:00Z")]),
    ("/v1/events/kubernetes", "nth/imds-rebalance-recommendation.json", NODE, 200,
     [expect("reclaim", NODE, load("nth/imds-rebalance-recommendation.json")["EventID"],
             kind="rebalance")]),
    ("/v1/events/kubernetes", "nth/imds-scheduled-event.json", NODE, 200,
     [expect("reclaim", NODE, "instance-event-0d59937288b749b32", "2019-10-29T20:10:00Z",
             kind="scheduled")]),
]  # fmt: skip


def _deadline_text(signal: dict[str, Any]) -> dict[str, Any]:
    out = {k: signal[k] for k in ("signal", "node_id", "event_id") if k in signal}
    if signal["signal"] == "reclaim":
        deadline = signal.get("deadline")
        out["deadline"] = (
            None
            if deadline is None
            else datetime.fromisoformat(deadline).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        )
        out["kind"] = signal["kind"]
    return out


@pytest.mark.parametrize(
    ("path", "name", "node", "status", "signals"), CORPUS, ids=lambda v: str(v)
)
async def test_corpus_payload_end_to_end(
    hook: Webhook, jobs: Jobs, path: str, name: str, node: str, status: int,
    signals: list[dict[str, Any]],
) -> None:  # fmt: skip
    job = await jobs.start(node)
    try:
        answer, body = await hook.post(path, load(name))
        assert answer == status, body
        got = [_deadline_text(s) for s in await signals_after(hook, job, node)]
    finally:  # the next payload's job owns the same node: one node, one job (docs/webhook.md)
        await job.terminate()
    assert got == signals
    if signals and signals[0]["signal"] == "reclaim":  # the workflow takes it as it arrives
        ReclaimNotice.model_validate({k: v for k, v in signals[0].items() if k != "signal"})


async def test_same_interruption_via_eventbridge_and_nth_is_one_event(
    hook: Webhook, jobs: Jobs
) -> None:
    """NTH's queue-mode event id carries EventBridge's: the second sender's signal has the
    same request id and event id, so the job sees the interruption once, whichever came
    first, with the same deadline either way."""
    for first, second in [
        ("eventbridge/nth-spot-itn.json", "nth/queue-spot-itn.json"),
        ("nth/queue-spot-itn.json", "eventbridge/nth-spot-itn.json"),
    ]:
        job = await jobs.start(NODE)
        paths = {"eventbridge": "/v1/events/aws", "nth": "/v1/events/kubernetes"}
        for name in (first, second):
            assert (await hook.post(paths[name.split("/")[0]], load(name)))[0] == 200
        got = [_deadline_text(s) for s in await signals_after(hook, job, NODE)]
        assert got == [expect("reclaim", NODE, SPOT_ID, "1970-01-01T00:02:00Z")]
        await job.terminate()


# --- SNS: real signed deliveries ------------------------------------------------------------


class RealSnsHost:
    """Serves SNS's real 2021 certificate at its real URL and its issuer (Amazon Server CA 1B)
    at the leaf's caIssuers URL; anything else is unreachable. Records what was asked."""

    def __init__(self, fail: bool = False) -> None:
        self.urls: list[str] = []
        self.fail = fail

    async def get(self, url: str) -> bytes:
        self.urls.append(url)
        if self.fail:
            raise aiohttp.ClientConnectionError("unreachable")
        files = {LEAF_URL: "sns-amazonaws-com-2021.pem", ISSUER_URL: "amazon-server-ca-1b.pem"}
        if url not in files:
            raise aiohttp.ClientConnectionError(f"no such host here: {url}")
        return (SNS_DIR / files[url]).read_bytes()


SNS_FIXTURES = sorted(SNS_DIR.glob("php-validator-*.json"))


def a_minute_after(message: dict[str, Any]) -> Callable[[], float]:
    """A clock set to a minute after SNS sent the message (its certificate was valid then)."""
    sent = datetime.fromisoformat(message["Timestamp"]).timestamp()
    return lambda: sent + 60


def sns_webhook(
    dev_env: WorkflowEnvironment, host: RealSnsHost, clock: Callable[[], float] = time.time
) -> contextlib.AbstractAsyncContextManager[Webhook]:
    """The webhook as deployed for the 2022 topics: public roots, certificates from `host`."""
    return running_webhook(
        dev_env.client,
        topics=tuple(SNS_TOPIC_2022),
        public_roots=True,
        http_get=host.get,
        clock=clock,
    )


@pytest.mark.parametrize("fixture", SNS_FIXTURES, ids=lambda p: p.stem)
async def test_real_sns_deliveries_verify_on_their_day_and_not_today(
    dev_env: WorkflowEnvironment, fixture: Path
) -> None:
    """Signature v1 and v2, with and without Subject. On their day they authenticate (the
    message, "Hello world", is then not an event: 422); today they are stale (401), and a
    changed byte never authenticates."""
    message = json.loads(fixture.read_text())
    host = RealSnsHost()
    async with sns_webhook(dev_env, host, a_minute_after(message)) as hook:
        assert await hook.post("/v1/events/aws", message, headers={}) == (
            422,
            {"error": "SNS Message is not JSON", "field": "Message"},
        )
        tampered = {**message, "Message": "Hello world!"}
        assert (await hook.post("/v1/events/aws", tampered, headers={}))[0] == 401
    assert set(host.urls) == {LEAF_URL, ISSUER_URL}
    async with sns_webhook(dev_env, host) as hook:
        assert (await hook.post("/v1/events/aws", message, headers={}))[0] == 401


async def test_sns_certificate_host_is_pinned_to_the_topics_region(
    dev_env: WorkflowEnvironment,
) -> None:
    """A URL that only looks like SNS (an S3 bucket named "sns", another region, a port, a
    user-info trick) is refused before anything is fetched."""
    message = json.loads(SNS_FIXTURES[0].read_text())
    host = RealSnsHost()
    async with sns_webhook(dev_env, host, a_minute_after(message)) as hook:
        pem = "/SimpleNotificationService-7ff5318490ec183fbaddaa2a969abfda.pem"
        for url in [
            f"https://sns.s3.amazonaws.com{pem}",
            f"https://sns.us-east-1.amazonaws.com{pem}",
            f"https://sns.us-east-2.amazonaws.com:8443{pem}",
            f"https://sns.us-east-2.amazonaws.com@evil.example{pem}",
            f"http://sns.us-east-2.amazonaws.com{pem}",
            f"https://sns.us-east-2.amazonaws.com.evil.example{pem}",
        ]:
            forged = {**message, "SigningCertURL": url}
            assert (await hook.post("/v1/events/aws", forged, headers={}))[0] == 401, url
    assert host.urls == []


async def test_sns_fetch_failures_are_503_with_retry_after_and_cached_briefly(
    dev_env: WorkflowEnvironment,
) -> None:
    message = json.loads(SNS_FIXTURES[0].read_text())
    host = RealSnsHost(fail=True)
    async with sns_webhook(dev_env, host, a_minute_after(message)) as hook:
        for _ in range(3):
            async with hook.http.post(hook.url + "/v1/events/aws", json=message) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "1"
        assert host.urls == [LEAF_URL]  # one fetch: the failure is remembered for a while
        host.fail = False
        hook.service._sns._cache.clear()  # as after the failure's 10 s
        for _ in range(3):
            assert (await hook.post("/v1/events/aws", message, headers={}))[0] == 422
        assert host.urls == [LEAF_URL, LEAF_URL, ISSUER_URL]  # then cached


async def test_sns_certificate_fetch_goes_through_https_proxy(
    dev_env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default fetcher honours HTTPS_PROXY: a loopback proxy sees the CONNECT to SNS
    (and refuses it, so the webhook answers 503: no internet here)."""
    connects: list[str] = []

    async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connects.append((await reader.readline()).decode().strip())
        writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(proxy, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    for name in ("NO_PROXY", "no_proxy", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{port}")
    message = json.loads(SNS_FIXTURES[0].read_text())
    auth = AuthConfig(sns_topic_arns=frozenset(SNS_TOPIC_2022))
    config = WebhookConfig(auth=auth, host="127.0.0.1", port=0)
    service = WebhookService(dev_env.client, config, clock=a_minute_after(message))
    try:  # the service's own fetcher, as deployed
        url = f"http://127.0.0.1:{await service.start()}/v1/events/aws"
        async with aiohttp.ClientSession() as http, http.post(url, json=message) as resp:
            assert resp.status == 503
    finally:
        await service.stop()
        server.close()
    assert connects == ["CONNECT sns.us-east-2.amazonaws.com:443 HTTP/1.1"]


# --- hostile headers and times ---------------------------------------------------------------


async def test_odd_hmac_timestamps_are_401_never_500(hook: Webhook) -> None:
    body = json.dumps(sentinel("i-0nobody")).encode()
    arabic_indic_now = "".join(chr(0x660 + int(d)) for d in str(int(time.time())))
    for ts in [arabic_indic_now, "\u00b2", "9" * 5000, "1" * 16, "-1", " 1", "1e9", ""]:
        headers = {**hmac_headers(HMAC_SECRET, body, "POST", "/v1/reclaims"), TIMESTAMP_HEADER: ts}
        assert (await hook.post("/v1/reclaims", body, headers=headers))[0] == 401, ts[:20]
    assert (
        await hook.post(
            "/v1/reclaims", body, headers=hmac_headers(HMAC_SECRET, body, "POST", "/v1/reclaims")
        )
    )[0] == 202


FAR = ["9999-12-31T23:59:59Z", "0001-01-01T00:00:00+01:00", "9999-12-31T23:59:59-05:00"]


async def test_far_calendar_times_are_422_never_500(hook: Webhook) -> None:
    for when in FAR:
        event = {**load("eventbridge/nth-spot-itn.json"), "time": when}
        assert (await hook.post("/v1/events/aws", event))[0] == 422, when
        plain = {"instance_id": NODE, "event_id": "far", "deadline": when}
        assert (await hook.post("/v1/reclaims", plain))[0] == 422, when
        nth = {**load("nth/queue-spot-itn.json"), "StartTime": when}
        assert (await hook.post("/v1/events/kubernetes", nth))[0] == 422, when


# --- queue mode -------------------------------------------------------------------------------


async def test_poison_messages_never_delay_or_lose_a_good_one(
    hook: Webhook, jobs: Jobs, queue: tuple[Any, str]
) -> None:
    """One batch: far-calendar events, garbage, an unknown instance, a foreign (ASG) event,
    and two good notices among them. Both good ones are signalled in the first poll, and the
    whole batch leaves the (dedicated) queue."""
    sqs, url = queue
    job = await jobs.start("i-0mix1", "i-0mix2")
    good = {**load("eventbridge/nth-spot-itn.json"), "id": "mix-1", "time": "2026-05-01T00:00:00Z"}
    good["detail"] = {**good["detail"], "instance-id": "i-0mix1"}
    lost = {**load("eventbridge/karpenter-state-change-stopping.json"), "id": "mix-2"}
    lost["detail"] = {**lost["detail"], "instance-id": "i-0mix2"}
    far = [{**good, "id": f"far-{i}", "time": when} for i, when in enumerate(FAR)]
    batch = [
        far[0],
        "not json",
        good,
        far[1],
        load("eventbridge/nth-asg-lifecycle-terminate.json"),
        {**good, "id": "mix-nobody", "detail": {"instance-id": "i-0nobody"}},
        lost,
        far[2],
        [1, 2],
    ]
    entries = [
        {"Id": str(i), "MessageBody": b if isinstance(b, str) else json.dumps(b)}
        for i, b in enumerate(batch)
    ]
    sqs.send_message_batch(QueueUrl=url, Entries=entries)
    poller = SqsPoller(sqs, url, hook.service.dispatcher, wait_s=1, visibility_s=30)
    deleted = 0
    for _ in range(5):  # moto may hand the batch out in more than one receive
        deleted += await poller.poll_once()
        if deleted == len(batch):
            break
    assert deleted == len(batch)
    assert queued(sqs, url) == 0
    await eventually(lambda: _count(job, 2))
    got = sorted((s["signal"], s["node_id"], s["event_id"]) for s in await received(job))
    assert got == [("node_lost", "i-0mix2", "mix-2"), ("reclaim", "i-0mix1", "mix-1")]


async def _count(job: Any, n: int) -> bool:
    return len(await received(job)) >= n


def test_queue_mode_refuses_a_queue_not_declared_its_own() -> None:
    with pytest.raises(ConfigError, match="SPOTRAIN_WEBHOOK_QUEUE_DEDICATED=1"):
        WebhookConfig(queue_url="http://127.0.0.1:1/q")
    env = {"SPOTRAIN_WEBHOOK_QUEUE_URL": "u", "SPOTRAIN_WEBHOOK_QUEUE_DEDICATED": "1"}
    assert WebhookConfig.from_env(env).queue_dedicated


# --- the certificate cache's lifetimes (the verifier alone, no service) -----------------------


async def test_cached_keys_expire_and_never_outlive_their_certificate() -> None:
    message = json.loads(SNS_FIXTURES[0].read_text())
    host = RealSnsHost()
    now = [a_minute_after(message)()]
    topics = frozenset(SNS_TOPIC_2022)
    cached = SnsVerifier(topics, host.get, clock=lambda: now[0])
    for _ in range(3):
        await cached.verify(message)
    assert host.urls == [LEAF_URL, ISSUER_URL]  # fetched once, then cached
    uncached = SnsVerifier(topics, host.get, clock=lambda: now[0], key_ttl_s=0)
    for _ in range(2):
        await uncached.verify(message)
    assert host.urls == [LEAF_URL, ISSUER_URL] * 3  # a lifetime of 0: fetched every time
    expired = datetime(2022, 8, 18, tzinfo=UTC).timestamp()  # the leaf ended 2022-08-17
    now[0] = expired
    sent_before_expiry = {**message, "Timestamp": "2022-08-17T23:59:00.000Z"}
    with pytest.raises(SnsRejected, match="expired"):
        await cached.verify(sent_before_expiry)
