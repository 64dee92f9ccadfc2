"""Hypothesis strategies for the webhook's fuzz tests (test_webhook_fuzz.py,
test_webhook_fuzz_faults.py): JSON values, and request bodies made from one valid request of
each shape a sender posts, mutated, or not JSON at all."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

from tests.webhook.webhook_support import CERT_URL, INTERRUPTION, STATE_CHANGE, TOPIC, aws_event

UNKNOWN = "i-0fuzzunknown"  # owned by nobody: valid-looking inputs end as 202

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
