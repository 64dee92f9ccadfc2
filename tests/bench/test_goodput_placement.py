"""The goodput benchmark and placement: it bills a ring across zones as the product does
(bench/goodput_model.py: ring_transfer over workflows/policies/locality.py's rule), and holds
the baselines to one zone when spotrain is (`--placement zone`)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench.common import Trace
from bench.goodput_model import Setup, one_zone_baselines, oracle, ring_transfer

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


def test_one_zone_baselines_run_in_the_zone_where_the_oracle_finishes_first(
    tmp_path: Path,
) -> None:
    traces = []
    for zone, data in (("us-test-1a", [2] * 12), ("us-test-1b", [4] * 12)):
        path = tmp_path / f"{zone}.json"
        path.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": data}))
        traces.append(Trace.load(f"{zone}={path}"))
    setup = Setup(traces=traces, max_nodes=4, work_node_hours=8.0, placement="zone")
    rows = one_zone_baselines(setup)
    assert [r.policy for r in rows] == [
        "oracle (one zone: us-test-1b)",
        "fixed +notice ckpt (one zone: us-test-1b)",
    ]
    six = replace(setup, max_nodes=6)  # more than one zone ever offers
    (alone,) = one_zone_baselines(six)  # (no fixed job: it would never start)
    assert alone.wall_h == oracle(replace(six, traces=traces[1:])).wall_h
    assert alone.wall_h > oracle(six).wall_h  # one zone: less capacity than both
    assert one_zone_baselines(replace(setup, placement="any")) == []
    assert one_zone_baselines(replace(setup, traces=traces[:1])) == []
