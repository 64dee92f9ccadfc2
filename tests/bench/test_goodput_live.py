"""The goodput benchmark's model of what resizes and launches cost: the measured-figure
readers, the hand-over's scaling with state size, the boot delays (and a boot waited out once
on the time-skipping server), the pause figure that leaves out hours with no capacity, and
the simulated runtime's two resize modes."""

from __future__ import annotations

import json
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError

from bench.common import Trace
from bench.goodput import live as goodput_live
from bench.goodput.model import Row, Setup, no_capacity, overlap_h
from spotrain.activities import simulated
from spotrain.activities.simulated import LivePauses, SimulatedCloud, SimulatedRuntime
from spotrain.workflows.contract import GenerationPlan, LaunchRequest, Member, StopRequest

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_handover_scales_with_state_size() -> None:
    points = [(0.1, 0.2), (1.0, 1.1)]
    assert goodput_live.handover_s(0.05, points) == 0.2  # below: the fixed cost
    assert goodput_live.handover_s(0.55, points) == pytest.approx(0.65)  # linear between
    assert goodput_live.handover_s(2.0, points) == pytest.approx(2.2)  # beyond: 1.1 s per GB
    pauses = goodput_live.live_pauses(2.0, {"growth": 0.2, "shrink": 0.3, "loss": 0.4}, points)
    # measured on the tiny model, whose growth already paid the hand-over's fixed 0.2 s
    assert pauses == LivePauses(growth_s=pytest.approx(2.2), shrink_s=0.3, loss_s=0.4)
    # measured on 1 GB already: growth adds only the hand-over of the second GB
    pauses = goodput_live.live_pauses(2.0, {"growth": 1.5, "shrink": 0.3, "loss": 0.4}, points, 1.0)
    assert pauses.growth_s == pytest.approx(1.5 + 1.1)


def test_live_pauses_come_from_the_file_measured_nearest_the_state_size(tmp_path: Path) -> None:
    def results(name: str, state_mb: float | None, kinds: list[str], **settings: str) -> None:
        rows = [{"kind": k, "mode": "live", "median": 1.0} for k in kinds]
        data = {"settings": {"runtime": "local", "state_mb": state_mb} | settings, "rows": rows}
        (tmp_path / f"live_resize{name}.json").write_text(json.dumps(data))

    every = list(goodput_live.LIVE_KINDS)
    results("", None, every)  # the tiny model's
    results("_100m", 772.0, every)
    results("_100m_quiet", 772.0, every[:2])  # no loss measured: not a source
    results("_fsdp_1b", 8000.0, every, example="fsdp")  # a sharded model's: only if asked
    results("_k8s_1b", 8000.0, every, runtime="kubernetes")
    pick = [goodput_live.live_results_for(gb, tmp_path).name for gb in (0.0, 0.3, 0.8, 9.0)]
    assert pick == [
        "live_resize.json",
        "live_resize.json",
        "live_resize_100m.json",
        "live_resize_100m.json",
    ]


def test_measured_figures_are_read_from_the_results_files(tmp_path: Path) -> None:
    live = tmp_path / "live_resize.json"
    rows = [
        {"kind": "growth", "mode": "live", "median": 0.5},
        {"kind": "growth", "mode": "restart", "median": 9.0},
        {"kind": "loss without notice", "mode": "live", "median": 0.7},
        {"kind": "steps lost per loss", "mode": "live", "median": 0.0},
    ]
    live.write_text(json.dumps({"rows": rows}))
    medians = goodput_live.live_medians(live)
    assert medians == {"growth": 0.5, "loss": 0.7, "shrink": goodput_live.LIVE_MEDIANS["shrink"]}
    handover = tmp_path / "handover.json"
    rows = [
        {"method": "handover", "survivors": 3, "state_MB": 800, "median": 0.2},
        {"method": "handover", "survivors": 1, "state_MB": 800, "median": 0.5},
        {"method": "handover", "survivors": 1, "state_MB": 80, "median": 0.1},
        {"method": "raw", "survivors": 1, "state_MB": 800, "median": 0.4},
    ]
    handover.write_text(json.dumps({"rows": rows}))
    assert goodput_live.handover_points(handover) == [(0.08, 0.1), (0.8, 0.5)]
    missing = tmp_path / "none.json"
    assert goodput_live.live_medians(missing) == goodput_live.LIVE_MEDIANS
    assert goodput_live.handover_points(missing) == goodput_live.HANDOVER_POINTS
    # --live-resize-results: another model's pauses (a sharded one's), the hand-over added
    pauses, source = goodput_live.measured_live_pauses(0.8, str(live))
    assert source == live
    assert (pauses.loss_s, pauses.shrink_s) == (0.7, goodput_live.LIVE_MEDIANS["shrink"])
    points = goodput_live.handover_points()
    handover = goodput_live.handover_s(0.8, points) - goodput_live.handover_s(0.0, points)
    assert pauses.growth_s == pytest.approx(0.5 + handover)


def test_boot_delays_are_lognormal_around_the_median_and_reproducible() -> None:
    draw = goodput_live.lognormal_boot(60.0, 0.5, seed=7)
    delays = [draw() for _ in range(4000)]
    assert statistics.median(delays) == pytest.approx(60.0, rel=0.05)
    assert min(delays) > 0
    again = goodput_live.lognormal_boot(60.0, 0.5, seed=7)
    assert [again() for _ in range(5)] == delays[:5]
    assert goodput_live.lognormal_boot(0.0, 0.5, seed=7)() == 0.0


def test_pause_leaves_out_the_hours_with_no_capacity() -> None:
    # runs 0-1 h, idle 1-3 h, runs 3-4 h; the trace offered nothing from 1.5 h to 2.5 h
    row = Row("p", "workflow", 4.0, 1.0, 0.0, series=[(0.0, 2), (1.0, 0), (3.0, 2)])
    row.startup_s = 360.0
    assert row.idle() == [(1.0, 3.0)]
    assert row.pause_h() == pytest.approx(2.1)
    assert row.pause_h([(1.5, 2.5)]) == pytest.approx(1.1)
    assert overlap_h([(0, 1), (2, 3)], [(0.5, 2.5)]) == pytest.approx(1.0)


def test_no_capacity_is_read_from_the_trace_past_the_oracles_end() -> None:
    """The hours with no node on offer come from the trace over the whole run, not from the
    oracle's idle spans, which end where the oracle finishes (3.5 h here): a row that ran on
    had a later outage counted as a pause it chose."""
    trace = Trace(zone="us-test-1a", gap_s=3600, data=(1, 0, 0, 1))  # repeats every 4 h
    setup = Setup(traces=[trace], max_nodes=1, work_node_hours=1.5, boot_median_s=0)
    assert no_capacity(setup, 7.5) == [(1.0, 3.0), (5.0, 7.0)]
    assert no_capacity(setup, 6.0) == [(1.0, 3.0), (5.0, 6.0)]
    # idle through both outages, running whenever a node was on offer
    series = [(0.0, 1), (1.0, 0), (3.0, 1), (5.0, 0), (7.0, 1)]
    row = Row("p", "workflow", 7.5, 3.5, 0.0, reclaims=2, series=series)
    report = row.report(setup, 3.5, no_capacity(setup, row.wall_h))
    assert report["pause_s_per_reclaim_with_capacity"] == 0.0
    assert report["pause_s_per_reclaim"] == pytest.approx(3600 * 4 / 2)


def test_a_boot_is_waited_out_once_when_the_retry_reads_the_failed_attempts_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """launch_node fails (retryably) while its node boots, with a retry due when the boot
    ends. The time-skipping test server runs that retry on time but reports its scheduled
    time as when the attempt before failed: read as now, the node still booted and the job
    waited a second boot (issue 48: a 1-node job paid every boot twice)."""
    clock = Clock(monkeypatch)
    cloud = SimulatedCloud(zones=["us-test-1a"], boot_s=lambda: 300.0)
    req = LaunchRequest(
        job="j", slot=0, attempt=0, generation=0, lifecycle="spot", instance_type="p3.2xlarge"
    )
    with pytest.raises(ApplicationError) as booting:
        cloud.launch_node(req)
    assert booting.value.next_retry_delay == timedelta(seconds=300)
    clock.skip(0.005)  # the retry, 300 s later, as the time-skipping server reports it
    node = cloud.launch_node(req)
    assert node.state == "ready"
    assert cloud.boot_hours["spot"] == pytest.approx(300 / 3600)  # billed once
    # a server that reports the retry's own time: the same
    clock, cloud = Clock(monkeypatch), SimulatedCloud(zones=["us-test-1a"], boot_s=lambda: 300.0)
    with pytest.raises(ApplicationError):
        cloud.launch_node(req)
    clock.skip(300)
    assert cloud.launch_node(req).state == "ready"
    assert cloud.boot_hours["spot"] == pytest.approx(300 / 3600)


# --- the simulated runtime's resize modes ------------------------------------------------------


class Clock:
    """Stands in for the activity context: the server time each call is scheduled at."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = T0
        monkeypatch.setattr(simulated, "_now", lambda: self.now)

    def skip(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


def plan(generation: int, nodes: list[str], resize: str) -> GenerationPlan:
    members = [Member(node_id=n, address=n) for n in nodes]
    return GenerationPlan(
        job="j",
        generation=generation,
        members=members,
        command=["simulated"],
        checkpoint="file:///tmp/x",
        total_steps=10**9,
        resize=resize,
    )


def stop(generation: int, world: int, graceful: bool, live: bool, lost: list[str]) -> StopRequest:
    return StopRequest(
        job="j",
        generation=generation,
        world_size=world,
        checkpoint="file:///tmp/x",
        graceful=graceful,
        grace_s=60,
        lost_node_ids=lost,
        live=live,
    )


def runtime() -> SimulatedRuntime:
    return SimulatedRuntime(
        steps_per_hour=lambda w: 3600.0 * w,  # one step per node-second
        checkpoint_every=1000,
        restart_cost_s=100.0,
        checkpoint_s=10.0,
        live=LivePauses(growth_s=2.0, shrink_s=0.5, loss_s=0.25),
    )


def test_live_mode_resumes_from_memory_after_the_measured_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock, rt = Clock(monkeypatch), runtime()
    rt.start_generation(plan(1, ["a", "b", "c"], "live"))
    clock.skip(400.5)  # 100 s start-up, then 300.5 s at 3 steps/s: step 901
    lost = rt.stop_generation(stop(1, 3, graceful=False, live=True, lost=["c"]))
    assert (lost.step, lost.held_step, lost.forced) == (901, 901, True)  # only the step in flight
    rt.start_generation(plan(2, ["a", "b"], "live"))
    gen = rt.jobs["j"].generations[2]
    assert (gen.start_step, gen.startup_s, gen.started_at) == (901, 0.25, clock.now)
    clock.skip(100.25)  # the loss's pause, then 100 s at 2 steps/s
    noticed = rt.stop_generation(stop(2, 2, graceful=True, live=True, lost=[]))
    assert (noticed.held_step, noticed.forced, noticed.checkpoint_step) == (1101, False, 1101)
    rt.start_generation(plan(3, ["a"], "live"))  # a shrink: nothing waits for the checkpoint
    assert rt.jobs["j"].generations[3].startup_s == 0.5
    assert rt.jobs["j"].generations[3].started_at == clock.now
    rt.stop_generation(stop(3, 1, graceful=True, live=True, lost=[]))
    rt.prepare_generation(plan(4, ["a", "d"], "live"))  # the joiner's head start
    rt.start_generation(plan(4, ["a", "d"], "live"))
    assert rt.jobs["j"].generations[4].startup_s == 2.0
    rt.stop_generation(stop(4, 2, graceful=True, live=True, lost=[]))
    rt.start_generation(plan(5, ["a", "d", "e"], "live"))  # a joiner with no head start
    assert rt.jobs["j"].generations[5].startup_s == 102.0


def test_ranks_parked_while_starting_finish_their_start_up_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A live resize 30 s into a cold 100 s start-up leaves 70 s of it: the next generation
    trains after those, not after the resize's 2 s pause (every live goodput row before
    this skipped the rest of such start-ups)."""
    clock, rt = Clock(monkeypatch), runtime()
    rt.start_generation(plan(1, ["a", "b"], "live"))
    clock.skip(30)
    noticed = rt.stop_generation(stop(1, 2, graceful=True, live=True, lost=[]))
    assert (noticed.step, noticed.held_step) == (0, 0)
    rt.prepare_generation(plan(2, ["a", "b", "c"], "live"))
    rt.start_generation(plan(2, ["a", "b", "c"], "live"))
    assert rt.jobs["j"].generations[2].startup_s == 70.0
    clock.skip(100)  # 70 s of start-up left, then 30 s at 3 steps/s
    again = rt.stop_generation(stop(2, 3, graceful=True, live=True, lost=[]))
    assert again.held_step == 90
    rt.start_generation(plan(3, ["a", "b"], "live"))  # started long ago: the shrink's pause
    assert rt.jobs["j"].generations[3].startup_s == 0.5


def test_a_world_lost_whole_goes_back_to_the_last_checkpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Live mode holds state in the survivors' memory: with none left, nothing holds it."""
    clock, rt = Clock(monkeypatch), runtime()
    rt.start_generation(plan(1, ["a"], "live"))
    clock.skip(1300)  # 100 s start-up, 1200 steps; the periodic checkpoint at 1000
    lost = rt.stop_generation(stop(1, 1, graceful=False, live=True, lost=["a"]))
    assert (lost.step, lost.held_step, lost.checkpoint_step) == (1200, None, 1000)
    assert lost.forced
    rt.start_generation(plan(2, ["b"], "live"))
    gen = rt.jobs["j"].generations[2]
    assert (gen.start_step, gen.startup_s) == (1000, 100.0)  # a restart from the checkpoint


def test_restart_mode_restarts_and_a_loss_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, rt = Clock(monkeypatch), runtime()
    rt.start_generation(plan(1, ["a", "b"], "restart"))
    clock.skip(700)  # 600 s at 2 steps/s: step 1200, periodic checkpoint at 1000
    lost = rt.stop_generation(stop(1, 2, graceful=False, live=False, lost=["b"]))
    assert (lost.step, lost.held_step, lost.checkpoint_step) == (1200, None, 1000)
    rt.start_generation(plan(2, ["a"], "restart"))
    gen = rt.jobs["j"].generations[2]
    assert (gen.start_step, gen.startup_s) == (1000, 100.0)
    clock.skip(150)
    noticed = rt.stop_generation(stop(2, 1, graceful=True, live=False, lost=[]))
    assert (noticed.checkpoint_step, noticed.held_step) == (1050, None)
    rt.start_generation(plan(3, ["a"], "restart"))  # loads once the 10 s save is written
    assert rt.jobs["j"].generations[3].started_at == clock.now + timedelta(seconds=10)


def test_the_report_names_a_pauses_file_given_relative_or_absolute(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # --live-resize-results bench/results/live_resize.json (relative, as bench/README.md
    # writes it) once stopped the benchmark at its report, after every row had run
    monkeypatch.chdir(goodput_live.REPO)
    relative = Path("bench/results/live_resize.json")
    assert goodput_live.shown_path(relative) == "bench/results/live_resize.json"
    assert goodput_live.shown_path(goodput_live.REPO / relative) == str(relative)
    outside = tmp_path / "live_resize_elsewhere.json"
    assert goodput_live.shown_path(outside) == str(outside.resolve())
