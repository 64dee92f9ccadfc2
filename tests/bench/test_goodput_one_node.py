"""The goodput benchmark's 1-node job without notice (issue 48): the real TrainingJob workflow
on the time-skipping server, live and restart mode, against the fixed-restart model on the
same trace. A 1-node job that loses its node has nothing to resize onto: both modes, like the
model, go back to the last periodic checkpoint and restart once a node is on offer, so they
must not trail the model by more than the workflow's own pacing (a capacity check, a
progress report: one tick)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench import goodput
from bench.common import Trace
from bench.goodput.harness import RowLog
from tests.bench.test_bench_smoke import write_trace

GAP_S = 900
BOOT_S = 300.0  # every node's boot (sigma 0)
RESTART_S = 120.0
# While an activity runs, the time-skipping server's clock moves at real speed, so a starved
# machine's seconds land on the simulated timeline (a start 15 s late was seen beside two
# busy loops). The bugs guarded here cost a whole boot (300 s): a minute's slack tells them
# apart from a slow machine.
SLACK_S = 60


def test_a_one_node_job_without_notice_keeps_pace_with_fixed_restart(tmp_path: Path) -> None:
    # a node for 1 h, none for 1 h, over and over
    trace = Trace.load(f"us-test-1a={write_trace(tmp_path / 't.json', [1] * 4 + [0] * 4, GAP_S)}")
    setup = goodput.Setup(
        traces=[trace],
        max_nodes=1,
        min_nodes=1,
        work_node_hours=2,  # 7200 steps, a checkpoint every 1800
        checkpoint_minutes=30,
        restart_cost_s=RESTART_S,
        boot_median_s=BOOT_S,
        boot_sigma=0.0,
        notice_s=0,
        wedge_s=15,
        run_timeout_s=120,
    )
    log = tmp_path / "rows.jsonl"
    rows = asyncio.run(
        goodput.benchmark(
            setup,
            deadline=False,
            mbb=False,
            modes=("live", "restart"),
            log=RowLog(log),
            only=("elastic",),
        )
    )
    by_name = {r.policy: r for r in rows}
    reports = {r["policy"]: r for r in map(json.loads, log.read_text().splitlines())}
    fixed = by_name["fixed-restart"]
    # The model: 3180 steps an hour-long window (boot and start-up first), 1380 of them past
    # the last checkpoint lost at each drop; the fourth window finishes at 6.62 h.
    assert (fixed.wall_h, fixed.steps_lost) == (pytest.approx(23820 / 3600), 3 * 1380)
    # Its only pauses with capacity: each restart's boot and start-up (the outages, the one
    # after the oracle's end at 4.08 h too, are left out).
    assert by_name["oracle"].wall_h == pytest.approx(14700 / 3600)
    assert reports["fixed-restart"]["pause_s_per_reclaim_with_capacity"] == pytest.approx(
        BOOT_S + RESTART_S
    )
    for policy in ("spotrain elastic", "spotrain elastic (restart)"):
        row = by_name[policy]
        starts = [round(3600 * t) for t, world in row.series if world > 0]
        # each generation starts one boot after a node is on offer, not two
        for start, offered in zip(starts, [0, 7200, 14400, 21600], strict=True):
            assert offered + BOOT_S <= start <= offered + BOOT_S + SLACK_S, (policy, starts)
        # (its checks run a moment after each tick: a few steps fewer before each drop)
        assert row.steps_lost == pytest.approx(fixed.steps_lost, abs=30), policy
        assert fixed.wall_h <= row.wall_h <= fixed.wall_h + GAP_S / 3600, policy
        # the boot and the start-up per reclaim, as the model's
        assert reports[policy]["pause_s_per_reclaim_with_capacity"] == pytest.approx(
            BOOT_S + RESTART_S, abs=SLACK_S
        ), policy
