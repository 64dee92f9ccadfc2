"""Thousands of hostile or broken requests against the running webhook: never a 5xx, never a
signal, never a lost good event. Real HTTP on loopback, the real Temporal dev server and moto's
SQS on loopback, as in test_webhook.py; schemathesis drives a webhook process from the OpenAPI
description."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.webhook.auth import SIGNATURE_HEADER, TIMESTAMP_HEADER, hmac_headers
from spotrain.workers.webhook.server import SqsPoller
from tests.webhook.fuzz_bodies import UNKNOWN, bodies
from tests.webhook.webhook_support import (
    BEARER,
    HMAC_SECRET,
    INTERRUPTION,
    OPENAPI,
    TOKEN,
    Jobs,
    Webhook,
    aws_event,
    queued,
    received,
    recording_worker,
    running_webhook,
    webhook_process,
)

pytestmark = pytest.mark.slow

GUARD = "i-0fuzzguard"  # owned by a running job: no fuzz input may reach it

PATHS = ["/v1/reclaims", "/v1/events/aws", "/v1/events/kubernetes"]
FUZZ = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def target(dev_env: WorkflowEnvironment) -> AsyncIterator[tuple[Webhook, Any, Jobs]]:
    """The webhook, a guard job no fuzz input may reach, and the recording jobs' starter."""
    async with recording_worker(dev_env.client) as jobs, running_webhook(dev_env.client) as hook:
        yield hook, await jobs.start(GUARD), jobs


header_values = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80)
forged_headers = st.dictionaries(
    st.sampled_from(
        ["Authorization", "X-Spotrain-Timestamp", "X-Spotrain-Signature", "x-amz-sns-message-type"]
    ),
    header_values,
)


@FUZZ
@given(path=st.sampled_from(PATHS), body=bodies(UNKNOWN))
async def test_authenticated_garbage_never_5xx(
    target: tuple[Webhook, Any, Jobs], path: str, body: bytes
) -> None:
    hook, _, _ = target
    status, _ = await hook.post(path, body)
    assert status in {202, 400, 413, 422}, (path, body[:200])


@FUZZ
@given(path=st.sampled_from(PATHS), body=bodies(GUARD), headers=forged_headers)
async def test_unauthenticated_requests_never_signal(
    target: tuple[Webhook, Any, Jobs], path: str, body: bytes, headers: dict[str, str]
) -> None:
    hook, _, _ = target
    status, _ = await hook.post(path, body, headers=headers)
    assert status in {401, 413}, (path, body[:200], headers)


# --- headers, methods and paths ---------------------------------------------------------------

any_text = st.text(st.characters(blacklist_categories=["Cs", "Cc"]), max_size=60)
digits = st.text(st.characters(whitelist_categories=["Nd", "No"]), min_size=1, max_size=30)
timestamps = st.one_of(any_text, digits, st.integers(0, 10**40).map(str), st.just("9" * 5000))


@FUZZ
@given(path=st.sampled_from(PATHS), ts=timestamps, signature=any_text, auth=any_text)
async def test_any_auth_header_value_is_401_never_500(
    target: tuple[Webhook, Any, Jobs], path: str, ts: str, signature: str, auth: str
) -> None:
    """Timestamps of Unicode digits, thousands of digits, anything: 401, and a valid HMAC
    signature over the body does not help a timestamp that is not ASCII seconds."""
    hook, _, _ = target
    body = json.dumps({"instance_id": GUARD, "event_id": "h"}).encode()
    valid = hmac_headers(HMAC_SECRET, body, "POST", path)
    for headers in (
        {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: signature},
        {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: valid[SIGNATURE_HEADER]},
        {"Authorization": auth},
        {"Authorization": f"Bearer {auth}"},
    ):
        if headers.get(TIMESTAMP_HEADER) == valid[TIMESTAMP_HEADER] or auth == TOKEN:
            continue  # (the one valid combination)
        try:
            status, _ = await hook.post(path, body, headers=headers)
        except (ValueError, UnicodeEncodeError):
            continue  # the client library will not send that header at all
        assert status == 401, headers


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
    path=st.sampled_from([*PATHS, "/healthz", "/readyz", "/metrics", "/", "/v1", "/v1/events"])
    | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=30).map(
        lambda p: "/" + p.lstrip("/")
    ),
)
async def test_every_endpoint_and_method_never_5xx(
    target: tuple[Webhook, Any, Jobs], method: str, path: str
) -> None:
    hook, _, _ = target
    try:
        async with hook.http.request(method, hook.url + path, headers=BEARER) as resp:
            assert resp.status < 500, (method, path)
    except ValueError:
        pass  # a path the client library refuses to send


async def test_after_fuzzing_the_guard_job_got_nothing(target: tuple[Webhook, Any, Jobs]) -> None:
    """Runs after the fuzz tests above (file order), on the same service and job."""
    hook, guard, _ = target
    assert await received(guard) == []
    assert hook.service.metrics.latency_count == 0  # no signal was sent anywhere
    codes = [labels for (name, labels) in hook.service.metrics.counters if "requests" in name]
    assert not [c for c in codes if dict(c)["code"].startswith("5")]


# --- queue mode: mixed batches ----------------------------------------------------------------


@pytest.fixture(scope="module")
def fuzz_queue(moto_endpoint: str) -> tuple[Any, str]:
    sqs = boto3.client("sqs", endpoint_url=moto_endpoint, region_name="us-east-1")
    return sqs, sqs.create_queue(QueueName="fuzz-reclaims")["QueueUrl"]


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(junk=st.lists(bodies(UNKNOWN), min_size=1, max_size=9), slot=st.integers(0, 9))
async def test_queue_mode_mixed_batches_lose_no_good_event(
    target: tuple[Webhook, Any, Jobs], fuzz_queue: tuple[Any, str], junk: list[bytes], slot: int
) -> None:
    """Garbage and hostile messages around one good notice in one batch: the good one is
    signalled, and the whole batch leaves the (dedicated) queue."""
    hook, _, jobs = target
    sqs, url = fuzz_queue
    node = f"i-0{uuid.uuid4().hex[:12]}"
    job = await jobs.start(node)
    good = aws_event(INTERRUPTION, node)
    messages = [b.decode("utf-8", "replace")[:60000].strip() or "-" for b in junk]
    messages.insert(slot, json.dumps(good))
    entries = [{"Id": str(i), "MessageBody": m} for i, m in enumerate(messages)]
    sent = sqs.send_message_batch(QueueUrl=url, Entries=entries)
    assert "0" in {e["Id"] for e in sent.get("Successful", [])} or not sent.get("Failed")
    poller = SqsPoller(sqs, url, hook.service.dispatcher, wait_s=0, visibility_s=30)
    for _ in range(5):
        await poller.poll_once()
        if queued(sqs, url) == 0:
            break
    assert queued(sqs, url) == 0
    signals = await received(job)
    assert [(s["node_id"], s["event_id"]) for s in signals] == [(node, good["id"])]


# --- schemathesis against the OpenAPI description ---------------------------------------------

SCHEMATHESIS = shutil.which("st", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(SCHEMATHESIS is None, reason="schemathesis is not installed")
async def test_schemathesis_finds_no_server_error_and_no_undocumented_answer(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Requests generated from workers/webhook/openapi.yaml (valid and invalid ones) against a real
    webhook process: no 5xx, and every answer's status and body as the description says."""
    settings_env = {"SPOTRAIN_WEBHOOK_TOKEN": TOKEN}
    async with webhook_process(dev_env, settings_env) as (url, _):
        proc = await asyncio.create_subprocess_exec(
            str(SCHEMATHESIS), "run", str(OPENAPI), "--url", url,
            "--header", f"Authorization: Bearer {TOKEN}",
            "--checks", "not_a_server_error,status_code_conformance,response_schema_conformance",
            "--max-examples", "40", "--seed", "20",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=tmp_path,
        )  # fmt: skip
        output = (await asyncio.wait_for(proc.communicate(), 280))[0].decode()
    assert proc.returncode == 0, output[-4000:]
