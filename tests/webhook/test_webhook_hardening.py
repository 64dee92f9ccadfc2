"""The webhook against hostile and careless clients (issue 27), over real sockets on loopback
and the real Temporal dev server, as in test_webhook.py: header values never reach a log, a
client that hangs up is its own error, slow clients are cut off, the HMAC signature binds the
method and path and refuses cut-short and future-dated signatures, and a deadline with a UTC
offset is read in its own zone. Each test here was seen to fail with its fix undone."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.webhook.auth import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    hmac_headers,
    legacy_string_to_sign,
)
from spotrain.workers.webhook.server import ConfigError, WebhookConfig
from tests.webhook.webhook_support import (
    HMAC_SECRET,
    TOKEN,
    Jobs,
    Webhook,
    eventually,
    received,
    running_webhook,
)

RECLAIMS = "/v1/reclaims"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def hook(dev_env: WorkflowEnvironment) -> AsyncIterator[Webhook]:
    """The default read timeouts (10 s from the connection's start): a test whose request is
    not about time is never cut off, even if this process stalls for a second. With 1 s, a
    stall (a busy run) let the header timeout close the connection before the server read the
    request that was waiting in its socket, so the client saw a reset, not the 400."""
    async with running_webhook(dev_env.client) as hook:
        yield hook


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def impatient(dev_env: WorkflowEnvironment) -> AsyncIterator[Webhook]:
    """Short read timeouts, so the slow-client tests take seconds."""
    async with running_webhook(dev_env.client, header_timeout_s=1.0, body_timeout_s=1.0) as hook:
        yield hook


async def raw(hook: Webhook, data: bytes, read_for_s: float = 5.0) -> bytes:
    """Send bytes as they are on a fresh connection; what comes back until the server closes
    it (or `read_for_s` passes)."""
    host, port = hook.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    answer = b""
    try:
        async with asyncio.timeout(read_for_s):
            while chunk := await reader.read(65536):
                answer += chunk
    except TimeoutError:
        pass
    writer.close()
    return answer


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.") else 0


def counter(hook: Webhook, name: str, **labels: str) -> int:
    return hook.service.metrics.counters[(name, tuple(sorted(labels.items())))]


# --- no header value ever reaches a log --------------------------------------------------------

BAD_HEADER_LINES = [
    f"Authorization: Bearer {TOKEN}\x00".encode(),  # NUL
    f"Authorization: Bearer {TOKEN}\rX: y".encode(),  # a bare CR
    f"Authorization: Bearer\r\n {TOKEN}".encode(),  # a folded line (obs-fold)
    f"X-Note: {TOKEN}\x01".encode(),  # a control character in another header
    f"Author\x00ization: Bearer {TOKEN}".encode(),  # in the name
    f"Authorization: Bearer {TOKEN}{'x' * 9000}".encode(),  # a line over the limit
]


@pytest.mark.parametrize("line", BAD_HEADER_LINES, ids=range(len(BAD_HEADER_LINES)))
async def test_a_malformed_header_is_400_and_its_value_never_logged(
    hook: Webhook, caplog: pytest.LogCaptureFixture, line: bytes
) -> None:
    caplog.set_level(logging.DEBUG)
    request = (
        b"POST /v1/reclaims HTTP/1.1\r\nHost: x\r\n" + line + b"\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert status_of(await raw(hook, request)) in (400, 431)
    logged = caplog.text + "".join(str(r.__dict__) for r in caplog.records)
    assert caplog.records, "the refusal is logged (without the header)"
    assert TOKEN not in logged and "Bearer" not in logged
    assert "Traceback" not in logged


# --- a client that hangs up is not a server error ------------------------------------------


async def test_a_client_that_hangs_up_mid_body_is_a_499_not_a_500(
    hook: Webhook, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    head = f"POST /v1/reclaims HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    before = counter(hook, "spotrain_webhook_requests_total", path=RECLAIMS, code="499")
    for _ in range(3):
        await raw(hook, (head + "Content-Length: 1000\r\n\r\n").encode() + b"{" * 100, 0.1)

    async def counted() -> bool:
        return (
            counter(hook, "spotrain_webhook_requests_total", path=RECLAIMS, code="499")
            == before + 3
        )

    await eventually(counted)
    assert counter(hook, "spotrain_webhook_requests_total", path=RECLAIMS, code="500") == 0
    assert "client_closed" in caplog.text
    assert "internal_error" not in caplog.text and "Traceback" not in caplog.text


# --- slow clients are cut off -------------------------------------------------------------


async def test_a_request_head_sent_slowly_is_cut_off(impatient: Webhook) -> None:
    """A byte every 0.2 s keeps a connection busy but never completes the head: closed once
    the header timeout (1 s here) has passed since it opened, answered or not."""
    host, port = impatient.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    started = time.monotonic()
    closed_after = None
    for byte in b"POST /v1/reclaims HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
        try:
            writer.write(bytes([byte]))
            await writer.drain()
            if await asyncio.wait_for(reader.read(1), 0.2) == b"":
                closed_after = time.monotonic() - started
                break
        except TimeoutError:
            continue
        except ConnectionError:
            closed_after = time.monotonic() - started
            break
    writer.close()
    assert closed_after is not None and closed_after < 4, closed_after


@pytest.mark.parametrize("path", [RECLAIMS, "/v1/events/aws", "/v1/events/kubernetes"])
async def test_a_body_that_does_not_decode_is_400_before_authentication(
    hook: Webhook, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """A `Content-Encoding: gzip` body that is not gzip: the sender's fault, so a 400 (no 500
    and traceback), and no credentials needed to learn it."""
    body = b"not gzip at all"
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Encoding: gzip\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    answer = await raw(hook, request)
    assert status_of(answer) == 400 and b"Content-Encoding" in answer, answer[:300]
    assert "Traceback" not in caplog.text


async def test_a_silent_connection_is_closed(impatient: Webhook) -> None:
    started = time.monotonic()
    assert await raw(impatient, b"", read_for_s=10) == b""
    assert time.monotonic() - started < 4


async def test_a_body_sent_too_slowly_is_answered_408_and_closed(impatient: Webhook) -> None:
    head = f"POST /v1/reclaims HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
    started = time.monotonic()
    answer = await raw(impatient, (head + "Content-Length: 100\r\n\r\n{").encode(), read_for_s=10)
    assert status_of(answer) == 408, answer[:200]
    assert time.monotonic() - started < 5  # the body timeout, then at most as long lingering
    assert counter(impatient, "spotrain_webhook_requests_total", path=RECLAIMS, code="408") >= 1


def test_read_timeouts_and_cache_settings_come_from_the_environment() -> None:
    config = WebhookConfig.from_env(
        {
            "SPOTRAIN_WEBHOOK_HEADER_TIMEOUT_S": "3",
            "SPOTRAIN_WEBHOOK_BODY_TIMEOUT_S": "4.5",
            "SPOTRAIN_WEBHOOK_OWNER_CACHE_TTL_S": "0",
            "SPOTRAIN_WEBHOOK_BUSY_RETRY_S": "2",
            "SPOTRAIN_WEBHOOK_RPC_TIMEOUT_S": "30",
            "SPOTRAIN_WEBHOOK_HMAC_LEGACY": "1",
        }
    )
    assert (config.header_timeout_s, config.body_timeout_s, config.rpc_timeout_s) == (3, 4.5, 30)
    assert (config.owner_cache_ttl_s, config.busy_retry_s) == (0.0, 2.0)
    assert config.auth.hmac_legacy and not WebhookConfig.from_env({}).auth.hmac_legacy
    for name, value in [
        ("SPOTRAIN_WEBHOOK_HEADER_TIMEOUT_S", "0"),
        ("SPOTRAIN_WEBHOOK_BODY_TIMEOUT_S", "inf"),
        ("SPOTRAIN_WEBHOOK_BODY_TIMEOUT_S", "nan"),
        ("SPOTRAIN_WEBHOOK_OWNER_CACHE_TTL_S", "-1"),
        ("SPOTRAIN_WEBHOOK_BUSY_RETRY_S", "soon"),
        ("SPOTRAIN_WEBHOOK_RPC_TIMEOUT_S", "0"),
    ]:
        with pytest.raises(ConfigError, match="s"):
            WebhookConfig.from_env({name: value})


# --- the signature binds method, path and time -------------------------------------------------


def plain(node_id: str, event_id: str) -> bytes:
    return json.dumps({"instance_id": node_id, "event_id": event_id}).encode()


async def test_a_signature_is_good_for_its_own_method_and_path_only(
    hook: Webhook, jobs: Jobs
) -> None:
    job = await jobs.start("i-0sig1")
    kube = json.dumps({"event_id": "k-sig", "kind": "SPOT_ITN", "instance_id": "i-0sig1"})
    body = kube.encode()
    for method, path in [
        ("POST", "/v1/reclaims"),  # signed for another endpoint
        ("POST", "/v1/events/aws"),
        ("PUT", "/v1/events/kubernetes"),  # another method
        ("POST", "/v1/events/kubernetes?x=1"),  # another query
        ("POST", "/v1/events/Kubernetes"),
    ]:
        headers = hmac_headers(HMAC_SECRET, body, method, path)
        assert (await hook.post("/v1/events/kubernetes", body, headers=headers))[0] == 401, path
    ts = str(int(time.time()))
    digest = hmac.new(HMAC_SECRET.encode(), legacy_string_to_sign(ts, body), hashlib.sha256)
    legacy = {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: f"sha256={digest.hexdigest()}"}
    assert (await hook.post("/v1/events/kubernetes", body, headers=legacy))[0] == 401
    signed = hmac_headers(HMAC_SECRET, body, "POST", "/v1/events/kubernetes")
    assert await hook.post("/v1/events/kubernetes", body, headers=signed) == (
        200,
        {"status": "signalled", "workflow_ids": [job.id]},
    )
    await eventually(lambda: _has(job, 1))
    assert [s["event_id"] for s in await received(job)] == ["k-sig"]


async def test_the_legacy_signature_only_when_asked_for(
    dev_env: WorkflowEnvironment, jobs: Jobs
) -> None:
    """SPOTRAIN_WEBHOOK_HMAC_LEGACY=1 (deprecated) also takes `<timestamp>.<body>`, and
    counts each such request; without it that form is 401."""
    job = await jobs.start("i-0sig2")
    body = plain("i-0sig2", "legacy-1")
    ts = str(int(time.time()))
    digest = hmac.new(HMAC_SECRET.encode(), legacy_string_to_sign(ts, body), hashlib.sha256)
    legacy = {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: f"sha256={digest.hexdigest()}"}
    async with running_webhook(dev_env.client) as strict:
        assert (await strict.post(RECLAIMS, body, headers=legacy))[0] == 401
    async with running_webhook(dev_env.client, hmac_legacy=True) as lenient:
        assert (await lenient.post(RECLAIMS, body, headers=legacy))[0] == 200
        assert counter(lenient, "spotrain_webhook_legacy_signatures_total") == 1
        v2_body = plain("i-0sig2", "v2-1")
        v2 = hmac_headers(HMAC_SECRET, v2_body, "POST", RECLAIMS)
        assert (await lenient.post(RECLAIMS, v2_body, headers=v2))[0] == 200
        assert counter(lenient, "spotrain_webhook_legacy_signatures_total") == 1
    await eventually(lambda: _has(job, 2))


async def _has(handle: Any, count: int) -> bool:
    return len(await received(handle)) >= count


async def test_a_signature_cut_short_is_refused(hook: Webhook) -> None:
    body = plain("i-0nobody", "short")
    signature = hmac_headers(HMAC_SECRET, body, "POST", RECLAIMS)[SIGNATURE_HEADER]
    ts = hmac_headers(HMAC_SECRET, body, "POST", RECLAIMS)[TIMESTAMP_HEADER]
    for cut in [signature[:-1], signature[:-32], signature[:8], "sha256=", signature + "0"]:
        headers = {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: cut}
        assert (await hook.post(RECLAIMS, body, headers=headers))[0] == 401, cut
    headers = {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: signature}
    assert (await hook.post(RECLAIMS, body, headers=headers))[0] == 202


async def test_a_signature_dated_in_the_future_is_refused(hook: Webhook) -> None:
    """A clock a little ahead is fine (up to 60 s); a timestamp further ahead would let a
    captured request live on past the replay window, so it is refused."""
    body = plain("i-0nobody", "future")
    for ahead_s in [61, 120, 299, 3600, 10**9]:
        headers = hmac_headers(HMAC_SECRET, body, "POST", RECLAIMS, now=time.time() + ahead_s)
        assert (await hook.post(RECLAIMS, body, headers=headers))[0] == 401, ahead_s
    for ahead_s in [0, 30, 55]:
        headers = hmac_headers(HMAC_SECRET, body, "POST", RECLAIMS, now=time.time() + ahead_s)
        assert (await hook.post(RECLAIMS, body, headers=headers))[0] == 202, ahead_s


# --- a deadline is read in its own zone ------------------------------------------------------


async def test_a_deadline_with_an_offset_is_converted_not_relabelled(
    hook: Webhook, jobs: Jobs
) -> None:
    """05:10 at +02:00 is 03:10 UTC, on every path that carries a time: the plain form's
    deadline, the kubernetes form's deadline and NTH's StartTime, and an EventBridge time."""
    job = await jobs.start("i-0zone1")
    sends = [
        (RECLAIMS, {"instance_id": "i-0zone1", "event_id": "z1",
                    "deadline": "2026-01-02T05:10:00+02:00"}),
        ("/v1/events/kubernetes", {"event_id": "z2", "kind": "SPOT_ITN",
                                   "instance_id": "i-0zone1",
                                   "deadline": "2026-01-02T01:10:00-02:00"}),
        ("/v1/events/kubernetes", {"EventID": "z3", "Kind": "SPOT_ITN",
                                   "InstanceID": "i-0zone1", "Monitor": "SPOT_ITN_MONITOR",
                                   "StartTime": "2026-01-02T05:10:00+02:00"}),
        ("/v1/events/aws", {"version": "0", "id": "z4", "source": "aws.ec2",
                            "detail-type": "EC2 Spot Instance Interruption Warning",
                            "time": "2026-01-02T05:08:00+02:00",
                            "detail": {"instance-id": "i-0zone1"}}),
    ]  # fmt: skip
    for path, body in sends:
        assert (await hook.post(path, body))[0] == 200, body
    await eventually(lambda: _has(job, len(sends)))
    deadlines = {s["event_id"]: s["deadline"] for s in await received(job)}
    assert deadlines == {e: "2026-01-02T03:10:00Z" for e in ("z1", "z2", "z3", "z4")}
