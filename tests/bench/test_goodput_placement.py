"""The goodput benchmark and placement: it bills a ring across zones as the product does
(bench/goodput/model.py: ring_transfer over workflows/policies/locality.py's rule), for
spotrain and the baselines that span zones alike, slows a step of such a ring by the stated
factor, holds the baselines to one zone when spotrain is (`--placement zone`), and lets the
fixed job hop between zones as spotrain does."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from bench.common import Trace
from bench.goodput import RecordingRuntime
from bench.goodput.model import (
    Setup,
    fixed_restart,
    hop_seconds,
    one_zone_baselines,
    oracle,
    ring_transfer,
    sent,
    spread,
)
from spotrain.workflows.contract import GenerationPlan, Member

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


def traces_of(tmp_path: Path, zones: dict[str, list[int]]) -> list[Trace]:
    """One trace a zone: its capacity every 5 minutes."""
    traces = []
    for zone, data in zones.items():
        path = tmp_path / f"{zone}.json"
        path.write_text(json.dumps({"metadata": {"gap_seconds": 300}, "data": data}))
        traces.append(Trace.load(f"{zone}={path}"))
    return traces


def test_one_zone_baselines_run_in_the_zone_where_the_oracle_finishes_first(
    tmp_path: Path,
) -> None:
    traces = traces_of(tmp_path, {"us-test-1a": [2] * 12, "us-test-1b": [4] * 12})
    setup = Setup(traces=traces, max_nodes=4, work_node_hours=8.0, placement="zone")
    rows = one_zone_baselines(setup)
    assert [r.policy for r in rows] == [
        "oracle (one zone: us-test-1b)",
        "fixed +notice ckpt (one zone: us-test-1b)",
        "fixed +notice ckpt (hops zones)",
    ]
    six = replace(setup, max_nodes=6)  # more than one zone ever offers
    (alone,) = one_zone_baselines(six)  # (no fixed job: it would never start)
    assert alone.wall_h == oracle(replace(six, traces=traces[1:])).wall_h
    assert alone.wall_h > oracle(six).wall_h  # one zone: less capacity than both
    assert one_zone_baselines(replace(setup, placement="any")) == []
    assert one_zone_baselines(replace(setup, traces=traces[:1])) == []


def test_baselines_that_span_zones_pay_for_their_rings_and_their_slower_steps(
    tmp_path: Path,
) -> None:
    """The merged oracle and fixed job hold nodes in both zones (most-offering zone first),
    so every step's ring crosses twice: billed as spotrain's is, and slowed by the factor."""
    traces = traces_of(tmp_path, {"us-test-1a": [1] * 48, "us-test-1b": [3] * 48})
    setup = Setup(traces=traces, max_nodes=4, base_nodes=0, work_node_hours=4.0)
    assert spread(setup, 0.0, 4) == ["us-test-1b"] * 3 + ["us-test-1a"]
    assert spread(setup, 0.0, 2) == ["us-test-1b"] * 2  # one zone holds them: no crossing
    best = oracle(setup)
    training_s = best.wall_h * 3600 - setup.boot_median_s
    expected = sent(setup, spread(setup, 0.0, 4), training_s)
    assert expected.zone_gb > 0
    assert best.transfer.zone_gb == pytest.approx(expected.zone_gb)
    assert (
        best.report(setup, best.wall_h)["cost_with_transfer"]
        > best.report(setup, best.wall_h)["cost"]
    )
    slow = replace(setup, cross_zone_slowdown=1.5)
    assert oracle(slow).wall_h * 3600 - slow.boot_median_s == pytest.approx(1.5 * training_s)
    assert oracle(slow).transfer.zone_gb == pytest.approx(best.transfer.zone_gb)  # same steps
    fixed = fixed_restart(setup)
    assert fixed.transfer.zone_gb > 0
    assert fixed_restart(slow).wall_h > fixed.wall_h
    one = replace(setup, traces=traces[1:], max_nodes=3)  # one zone: no bytes, no slowdown
    assert oracle(one).transfer.usd == 0 == fixed_restart(one).transfer.usd
    assert oracle(replace(one, cross_zone_slowdown=1.5)).wall_h == oracle(one).wall_h


def test_the_fixed_job_that_hops_restarts_in_a_zone_that_holds_it_all(tmp_path: Path) -> None:
    """Zone a holds all 4 nodes for 2 h, then 1; b none, then 4 (and a again later): the
    hopping fixed job runs in a, loses a node, restarts in b (one hop) and finishes there,
    never spanning the zones; held to a it waits for a to come back."""
    a = [4] * 24 + [1] * 24 + [4] * 48
    b = [0] * 24 + [4] * 72
    traces = traces_of(tmp_path, {"us-test-1a": a, "us-test-1b": b})
    setup = Setup(traces=traces, max_nodes=4, base_nodes=0, work_node_hours=12.0)
    hopping = fixed_restart(setup, on_notice=True, hop=True)
    assert hopping.policy == "fixed +notice ckpt (hops zones)"
    assert (hopping.hops, hopping.resizes, hopping.transfer.usd) == (1, 1, 0.0)
    stays = fixed_restart(replace(setup, traces=traces[:1]), on_notice=True)
    assert stays.wall_h > hopping.wall_h + 1.9  # it waited out a's 2 h at 1 node
    assert hopping.wall_h == pytest.approx(3 + 2 * setup.start_s / 3600, abs=0.01)
    # a stops at 2 h and b holds it at once: the hop is one boot and one start-up
    assert hopping.hop_s == hopping.hop_move_s == [setup.start_s]
    assert hopping.report(setup, hopping.wall_h)["hop_s_max"] == setup.start_s
    # both zones hold it again at once (b listed first): it restarts where it was
    both = traces_of(tmp_path, {"us-test-1b": [0] * 36 + [4] * 60, "us-test-1a": a[:36] + [4] * 60})
    back = fixed_restart(replace(setup, traces=both), on_notice=True, hop=True)
    assert (back.hops, back.resizes) == (0, 1)


def test_a_hop_is_timed_from_the_last_stop_and_from_itself_to_the_first_step() -> None:
    """Two hops: one that stops training itself (stop and hop at once, 150 s to the next
    first step), one after the job lost its last node at 1000 s and waited for capacity
    until it hopped at 1600 s (100 s to the next first step). A generation that made no step
    is not in `trains`; a hop with no first step after it is not timed."""

    def at(*seconds: float) -> list[datetime]:
        return [T0 + timedelta(seconds=x) for x in seconds]

    down, moving = hop_seconds(hops=at(10, 1600, 5000), stops=at(10, 1000), trains=at(5, 160, 1700))
    assert (down, moving) == ([150.0, 700.0], [150.0, 100.0])


def test_spotrains_simulated_ring_across_zones_steps_slower() -> None:
    """The benchmark's runtime slows a generation whose members span zones, not one in a
    single zone (the workflow runs see the same factor as the models)."""
    zones = {"n1": "us-test-1a", "n2": "us-test-1a", "n3": "us-test-1b"}
    setup = Setup(traces=[], cross_zone_slowdown=2.0)
    runtime = RecordingRuntime(setup, zones.__getitem__)

    def plan(*nodes: str) -> GenerationPlan:
        members = [Member(node_id=n, address=n) for n in nodes]
        return GenerationPlan(
            job="j",
            generation=1,
            members=members,
            command=["true"],
            checkpoint="file:///x",
            total_steps=10,
        )

    assert runtime.rate(plan("n1", "n2")) == setup.steps_per_hour(2)
    assert runtime.rate(plan("n1", "n2", "n3")) == setup.steps_per_hour(3) / 2
