"""The webhook's checks as pure functions, in milliseconds and without a server: who may send
(webhook.auth.check_headers) and how a notice's times are read (webhook.events). The same
behaviours are tested end to end over HTTP in test_webhook.py and test_webhook_hardening.py;
these are the fast tests that tests/test_breaks.py runs against each deliberate break."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from spotrain.workers.webhook.auth import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    AuthConfig,
    check_headers,
    hmac_headers,
    legacy_string_to_sign,
)
from spotrain.workers.webhook.events import SchemaError, parse_aws, parse_kubernetes, parse_reclaim
from spotrain.workflows.contract import ReclaimNotice

SECRET = "s3cret-for-tests"
TOKEN = "t0ken-for-tests"
CONFIG = AuthConfig(bearer_token=TOKEN, hmac_secret=SECRET)
BODY = b'{"instance_id": "i-0abc12345", "event_id": "e1"}'
PATH = "/v1/reclaims"


def check(
    headers: dict[str, str], method: str = "POST", path: str = PATH, **config: Any
) -> str | None:
    return check_headers(dataclasses.replace(CONFIG, **config), method, path, headers, BODY)


def test_a_bearer_token_must_match_exactly() -> None:
    assert check({"Authorization": f"Bearer {TOKEN}"}) == "bearer"
    for wrong in [TOKEN[:-1], TOKEN + "x", "", TOKEN.upper()]:
        assert check({"Authorization": f"Bearer {wrong}"}) is None, wrong
    assert check({"Authorization": f"Bearer {TOKEN}"}, bearer_token=None) is None


def test_a_signature_binds_method_and_path() -> None:
    assert check(hmac_headers(SECRET, BODY, "POST", PATH)) == "hmac"
    for method, path in [("PUT", PATH), ("POST", "/v1/events/aws"), ("POST", PATH + "?x=1")]:
        assert check(hmac_headers(SECRET, BODY, method, path)) is None, (method, path)
    assert check(hmac_headers(SECRET, BODY + b" ", "POST", PATH)) is None
    assert check(hmac_headers("another secret", BODY, "POST", PATH)) is None


def test_a_signature_cut_short_or_lengthened_is_refused() -> None:
    good = hmac_headers(SECRET, BODY, "POST", PATH)
    signature = good[SIGNATURE_HEADER]
    for cut in [signature[:-1], signature[:-32], signature[:8], "sha256=", signature + "0"]:
        assert check({**good, SIGNATURE_HEADER: cut}) is None, cut


def test_a_signature_too_old_or_dated_ahead_is_refused() -> None:
    """Up to 60 s ahead is clock skew; further ahead would outlive the replay window."""
    now = time.time()
    for ahead_s in [0, 30, 55, -290]:
        assert check(hmac_headers(SECRET, BODY, "POST", PATH, now=now + ahead_s)) == "hmac"
    for ahead_s in [65, 120, 3600, 10**9, -310, -(10**6)]:
        assert check(hmac_headers(SECRET, BODY, "POST", PATH, now=now + ahead_s)) is None


def test_the_legacy_signature_only_when_asked_for() -> None:
    ts = str(int(time.time()))
    digest = hmac.new(SECRET.encode(), legacy_string_to_sign(ts, BODY), hashlib.sha256)
    legacy = {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: f"sha256={digest.hexdigest()}"}
    assert check(legacy) is None
    assert check(legacy, hmac_legacy=True) == "hmac-legacy"


# --- a notice's time is read in its own zone ---------------------------------------------------

UTC_DEADLINE = datetime(2026, 1, 2, 3, 10, tzinfo=UTC)


def deadline_of(outcomes: list[Any]) -> datetime | None:
    (notice,) = outcomes
    assert isinstance(notice, ReclaimNotice)
    return notice.deadline


@pytest.mark.parametrize(
    "sent",
    ["2026-01-02T05:10:00+02:00", "2026-01-01T23:10:00-04:00", "2026-01-02T03:10:00Z"],
)
def test_a_deadline_with_an_offset_is_converted_not_relabelled(sent: str) -> None:
    plain = parse_reclaim({"instance_id": "i-0abc12345", "event_id": "e1", "deadline": sent})
    kube = parse_kubernetes(
        {"event_id": "k1", "kind": "SPOT_ITN", "instance_id": "i-0abc12345", "deadline": sent}
    )
    nth = parse_kubernetes(
        {
            "EventID": "k2",
            "Kind": "SPOT_ITN",
            "InstanceID": "i-0abc12345",
            "Monitor": "SPOT_ITN_MONITOR",
            "StartTime": sent,
        }
    )
    for outcomes in (plain, kube, nth):
        deadline = deadline_of(outcomes)
        assert deadline == UTC_DEADLINE and deadline.utcoffset() == UTC_DEADLINE.utcoffset()


def test_an_eventbridge_warning_comes_two_minutes_before_in_utc() -> None:
    event = {
        "version": "0",
        "id": "z4",
        "source": "aws.ec2",
        "detail-type": "EC2 Spot Instance Interruption Warning",
        "time": "2026-01-02T05:08:00+02:00",
        "detail": {"instance-id": "i-0abc12345"},
    }
    assert deadline_of(parse_aws(event)) == UTC_DEADLINE
    queued = {
        "EventID": "k3",
        "Kind": "SPOT_ITN",
        "InstanceID": "i-0abc12345",
        "Monitor": "SQS_MONITOR",
        "StartTime": "2026-01-02T05:08:00+02:00",
    }
    assert deadline_of(parse_kubernetes(queued)) == UTC_DEADLINE


def test_a_deadline_without_a_zone_or_out_of_range_is_refused() -> None:
    for sent in ["2026-01-02T03:10:00", "0001-01-01T00:00:00+14:00", "3001-01-01T00:00:00Z"]:
        with pytest.raises(SchemaError, match="deadline"):
            parse_reclaim({"instance_id": "i-0abc12345", "event_id": "e1", "deadline": sent})
