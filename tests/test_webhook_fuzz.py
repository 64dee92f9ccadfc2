"""Thousands of hostile or broken requests against the running webhook: never a 5xx, never a
signal. Real HTTP on loopback and the real Temporal dev server, as in test_webhook.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.testing import WorkflowEnvironment

from tests.test_webhook import (
    CERT_URL,
    INTERRUPTION,
    STATE_CHANGE,
    TOPIC,
    Webhook,
    aws_event,
    received,
    recording_worker,
    running_webhook,
)

GUARD = "i-0fuzzguard"  # owned by a running job: no fuzz input may reach it
UNKNOWN = "i-0fuzzunknown"  # owned by nobody: valid-looking inputs end as 202
PATHS = ["/v1/reclaims", "/v1/events/aws", "/v1/events/kubernetes"]
FUZZ = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def target(dev_env: WorkflowEnvironment) -> AsyncIterator[tuple[Webhook, Any]]:
    async with recording_worker(dev_env.client) as jobs, running_webhook(dev_env.client) as hook:
        yield hook, await jobs.start(GUARD)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=12,
)


def templates(node_id: str) -> list[dict[str, Any]]:
    """One valid request of each shape, for the mutations below to start from."""
    return [
        {"instance_id": node_id, "event_id": "e1", "deadline": "2026-01-01T00:00:00Z"},
        {"instance_id": node_id, "event_id": "e2", "lost": True},
        aws_event(INTERRUPTION, node_id),
        aws_event(STATE_CHANGE, node_id, state="terminated"),
        {"EventID": "e3", "Kind": "SPOT_ITN", "ProviderID": f"aws:///us-east-1a/{node_id}"},
        {
            "Type": "Notification",
            "TopicArn": TOPIC,
            "Message": json.dumps(aws_event(INTERRUPTION, node_id)),
            "SignatureVersion": "2",
            "SigningCertURL": CERT_URL,
            "Signature": "AAAA",
        },
    ]


@st.composite
def mutated(draw: st.DrawFn, node_id: str) -> bytes:
    """A valid request with fields replaced, removed, added, or nested under `detail`."""
    body = dict(draw(st.sampled_from(templates(node_id))))
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from([*body, "detail", "kind", "time", "id", "lost"]))
        action = draw(st.sampled_from(["replace", "delete", "nest"]))
        if action == "delete":
            body.pop(key, None)
        elif action == "nest" and isinstance(body.get("detail"), dict):
            body["detail"] = {**body["detail"], key: draw(json_values)}
        else:
            body[key] = draw(json_values)
    return json.dumps(body).encode()


def bodies(node_id: str) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        json_values.map(lambda v: json.dumps(v).encode()),
        mutated(node_id),
        st.just(b"[" * 5000),  # deep nesting
        st.just(b"{}" + b" " * (64 * 1024)),  # over the size limit
    )


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
    target: tuple[Webhook, Any], path: str, body: bytes
) -> None:
    hook, _ = target
    status, _ = await hook.post(path, body)
    assert status in {202, 400, 413, 422}, (path, body[:200])


@FUZZ
@given(path=st.sampled_from(PATHS), body=bodies(GUARD), headers=forged_headers)
async def test_unauthenticated_requests_never_signal(
    target: tuple[Webhook, Any], path: str, body: bytes, headers: dict[str, str]
) -> None:
    hook, _ = target
    status, _ = await hook.post(path, body, headers=headers)
    assert status in {401, 413}, (path, body[:200], headers)


async def test_after_fuzzing_the_guard_job_got_nothing(target: tuple[Webhook, Any]) -> None:
    """Runs after the two fuzz tests above (file order), on the same service and job."""
    hook, guard = target
    assert await received(guard) == []
    assert hook.service.metrics.latency_count == 0  # no signal was sent anywhere
    codes = [labels for (name, labels) in hook.service.metrics.counters if "requests" in name]
    assert not [c for c in codes if dict(c)["code"].startswith("5")]
