"""The goodput benchmark bills a ring across zones as the product does
(bench/goodput_model.py: ring_transfer over workflows/policies/locality.py's rule)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from bench.goodput_model import Setup, ring_transfer

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ZONES = {"a": "us-east-2b", "b": "us-east-2b", "c": "us-west-2a", "d": "us-west-2c"}


def test_each_generations_time_at_one_step_a_second_bills_its_crossing_links() -> None:
    setup = Setup(traces=[], gradient_gb=0.4, sync_steps_per_s=1.0)  # (no trace needed)
    hour = timedelta(hours=1)
    rings = [
        (T0, ["a", "b"]),  # one zone: nothing crosses
        (T0 + hour, ["a", "b", "c", "d"]),  # 3 of 4 links cross (2 of them regions)
        (T0 + 2 * hour, []),  # stopped
        (T0 + 3 * hour, ["c"]),
        (T0 + 4 * hour, []),
    ]
    billed = ring_transfer(rings, ZONES, setup)
    per_link = 2 * 3 / 4 * 0.4  # GB a step on each link of a 4-ring
    assert billed.zone_gb == pytest.approx(3 * per_link * 3600)
    assert billed.usd == pytest.approx(billed.zone_gb * 0.02)  # both rates are 0.02/GB
    assert ring_transfer(rings[:1] + rings[2:3], ZONES, setup).zone_gb == 0
