"""Stragglers: the rank library's step clock, the pure decisions
(workflows/policies/stragglers.py), and a job on real rank processes (local runtime, Temporal
dev server, simulated cloud) where one node turns slow or hangs: flagged in `status`, its node
replaced, the job completes."""

from __future__ import annotations

import asyncio
import textwrap
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from rich.console import Console
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.local import LocalRuntime
from spotrain.activities.simulated import SimulatedCloud
from spotrain.elastic.step_times import (
    RECENT_STEPS,
    STUCK_AFTER_S,
    USUAL_STEPS,
    WARMUP_STEPS,
    StepClock,
)
from spotrain.workers.cli.views import status_view
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.contract import CleanupRequest
from spotrain.workflows.job.state import JobResult, JobStatus
from spotrain.workflows.policies.stragglers import (
    RankSteps,
    assess,
    hung_ranks,
    rank_nodes,
    slow_ranks,
)
from spotrain.workflows.spec import SpecError, StragglerPolicy, parse_spec
from tests.jobs import FAST_ELASTIC, job_spec, leftover_processes, polled, record_history
from tests.warm_python import WARM_PYTHON
from tests.workflows.test_planner_job import node

pytestmark = pytest.mark.slow

T0 = datetime(2026, 11, 24, tzinfo=UTC)
POLICY = StragglerPolicy(slowdown=2.0, patience_s=300)


def steps(rank: int, recent: float | None, usual: float | None, since: float = 0.5) -> RankSteps:
    return RankSteps(rank=rank, step=100, since_step_s=since, recent_s=recent, usual_s=usual)


# --- the rank's step clock ---------------------------------------------------------------------


def test_clock_knows_recent_and_usual_step_times_once_it_has_enough_steps() -> None:
    clock, now = StepClock(), 0.0
    clock.tick(0, now)
    for step in range(1, WARMUP_STEPS + USUAL_STEPS + 1):
        now += 5.0 if step == 1 else 0.1  # the warm-up step does not count
        clock.tick(step, now)
    usual = clock.record(step, 1000.0)
    assert usual["usual_s"] == pytest.approx(0.1) and usual["recent_s"] == pytest.approx(0.1)
    for _ in range(RECENT_STEPS):  # the node turns slow: recent follows, usual stays
        step, now = step + 1, now + 0.5
        clock.tick(step, now)
    slow = clock.record(step, 1001.0)
    assert slow["recent_s"] == pytest.approx(0.5) and slow["usual_s"] == pytest.approx(0.1)
    assert (slow["step"], slow["time"]) == (step, 1001.0)


def test_clock_times_marked_work_per_step_when_the_script_marks_it() -> None:
    clock = StepClock()
    clock.tick(0, 0.0)
    assert clock.record(0, 0.0)["recent_s"] is None  # not known yet
    for i in range(1, RECENT_STEPS + 1):
        clock.add_busy(0.3)  # four steps' work between two reports, 4 s of wall time
        clock.tick(4 * i, 4.0 * i)
    assert clock.record(4 * RECENT_STEPS, 0.0)["recent_s"] == pytest.approx(0.3 / 4)


def test_a_section_in_progress_too_long_is_written_once_with_its_start() -> None:
    clock = StepClock()
    assert clock.stuck_record(100.0) is None  # nothing written yet
    clock.tick(3, 0.0)
    written = clock.record(3, 50.0)
    clock.tick(4, 0.1)  # a step not written (throttled)
    clock.begin_busy(60.0)
    assert clock.stuck_record(60.0 + STUCK_AFTER_S / 2) is None  # a normal step's work
    stuck = clock.stuck_record(60.0 + STUCK_AFTER_S)
    assert stuck == {**written, "step": 4, "busy_since": 60.0}
    assert clock.stuck_record(70.0) is None  # once per section
    clock.end_busy(10.0)
    assert clock.stuck_record(80.0) is None  # out of it


# --- decisions ---------------------------------------------------------------------------------


def test_a_rank_slower_than_its_history_and_its_peers_is_flagged() -> None:
    ranks = [steps(0, 0.1, 0.1), steps(1, 0.5, 0.1), steps(2, 0.11, 0.1)]
    found = slow_ranks(ranks, 2.0)
    assert list(found) == [1] and "5.0x its usual" in found[1]


def test_a_job_wide_slowdown_points_at_no_rank() -> None:
    ranks = [steps(r, 0.5, 0.1) for r in range(3)]  # every rank 5x slower: not one node
    assert slow_ranks(ranks, 2.0) == {}


def test_a_rank_slow_among_peers_but_as_usual_for_itself_is_not_flagged() -> None:
    ranks = [steps(0, 0.1, 0.1), steps(1, 0.5, 0.45)]  # a bigger share of the batch, say
    assert slow_ranks(ranks, 2.0) == {}


def test_a_lone_rank_is_judged_by_its_own_history() -> None:
    assert list(slow_ranks([steps(0, 0.5, 0.1)], 2.0)) == [0]
    assert slow_ranks([steps(0, 0.15, 0.1)], 2.0) == {}
    assert slow_ranks([steps(0, 0.5, None)], 2.0) == {}  # no history yet


def test_a_rank_without_steps_while_peers_step_is_hung_but_a_whole_job_stall_is_not() -> None:
    ranks = [steps(0, 0.1, 0.1, since=1), steps(1, 0.1, 0.1, since=700)]
    assert list(hung_ranks(ranks, 600, job_stalled=False)) == [1]
    stalled = [steps(r, 0.1, 0.1, since=700) for r in range(2)]
    assert hung_ranks(stalled, 600, job_stalled=True) == {}  # nobody stands out


def test_in_a_stalled_lockstep_job_the_rank_stuck_in_its_own_work_is_hung() -> None:
    """Its peers wait in the collective it never reaches: outside their own work."""
    ranks = [steps(r, 0.1, 0.1, since=700) for r in range(3)]
    ranks[2] = ranks[2].model_copy(update={"busy_s": 690.0})
    assert hung_ranks(ranks, 600, job_stalled=False) == {}  # not before the job stalls
    found = hung_ranks(ranks, 600, job_stalled=True)
    assert list(found) == [2] and "stuck in its own work for 690s" in found[2]
    every = [r.model_copy(update={"busy_s": 690.0}) for r in ranks]  # all stuck: no culprit
    assert hung_ranks(every, 600, job_stalled=True) == {}


def test_the_store_record_of_a_rank_stuck_in_its_work_carries_how_long() -> None:
    record = {"step": 7, "time": 100.0, "recent_s": 0.1, "usual_s": 0.1, "busy_since": 101.0}
    assert RankSteps.of(3, record, now=130.0).busy_s == 29.0
    assert RankSteps.of(3, {"step": 7, "time": 100.0}, now=130.0).busy_s is None


@given(
    usual=st.floats(0.01, 10),
    peers=st.integers(0, 6),
    factor=st.floats(0.01, 100),
    ratio=st.floats(1, 50),
    slowdown=st.floats(1.01, 10),
)
@example(usual=0.1, peers=3, factor=8.0, ratio=1.0, slowdown=2.0)  # a job-wide slowdown
def test_only_a_rank_slower_than_its_history_and_its_peers_is_flagged(
    usual: float, peers: int, factor: float, ratio: float, slowdown: float
) -> None:
    """Every rank's steps changed by `factor` (job-wide), rank 0's by `ratio` more: only rank 0
    may be flagged; with peers once `ratio` passes the threshold, alone once its own slowdown
    (`factor * ratio`) does."""
    own = factor * ratio
    assume(abs(own / slowdown - 1) > 1e-6 and abs(ratio / slowdown - 1) > 1e-6)
    ranks = [steps(0, usual * own, usual)]
    ranks += [steps(r, usual * factor, usual) for r in range(1, peers + 1)]
    flagged = own > slowdown and (peers == 0 or ratio > slowdown)
    assert set(slow_ranks(ranks, slowdown)) == ({0} if flagged else set())


def test_patience_counts_from_the_first_flag_and_a_hang_is_replaced_at_once() -> None:
    nodes = ["i-a", "i-b", "i-c"]
    slow = [steps(0, 0.1, 0.1), steps(1, 0.5, 0.1), steps(2, 0.1, 0.1)]
    first = assess(POLICY, 600, 4, slow, nodes, [], T0)
    assert [(f.rank, f.node_id, f.since) for f in first.raised] == [(1, "i-b", T0)]
    assert first.replace == []
    later = assess(POLICY, 600, 4, slow, nodes, first.flags, T0 + timedelta(seconds=299))
    assert later.raised == [] and later.flags[0].since == T0 and later.replace == []
    due = assess(POLICY, 600, 4, slow, nodes, later.flags, T0 + timedelta(seconds=300))
    assert due.replace == ["i-b"]
    hang = [steps(0, 0.1, 0.1), steps(1, 0.1, 0.1), steps(2, 0.1, 0.1, since=601)]
    hung = assess(POLICY, 600, 4, hang, nodes, first.flags, T0 + timedelta(seconds=10))
    assert hung.replace == ["i-c"] and hung.flags[0].hung
    assert [f.rank for f in hung.cleared] == [1]  # rank 1 is fine again


def test_flags_of_another_generation_are_forgotten_and_flag_only_replaces_nothing() -> None:
    slow = [steps(0, 0.1, 0.1), steps(1, 0.5, 0.1)]
    old = assess(POLICY, 600, 4, slow, ["i-a", "i-b"], [], T0).flags
    fresh = assess(POLICY, 600, 5, slow, ["i-a", "i-c"], old, T0 + timedelta(hours=1))
    assert [(f.node_id, f.since) for f in fresh.raised] == [("i-c", T0 + timedelta(hours=1))]
    assert fresh.cleared == [] and fresh.replace == []
    watch_only = StragglerPolicy(patience_s=0, replace=False)
    assert assess(watch_only, 600, 4, slow, ["i-a", "i-b"], [], T0).replace == []


def test_with_two_ranks_to_a_node_a_slow_rank_is_blamed_on_its_own_node() -> None:
    members = [node(0, procs=2), node(1, procs=2)]  # i-0 runs ranks 0-1, i-1 ranks 2-3
    assert rank_nodes(members) == ["i-0", "i-0", "i-1", "i-1"]
    slow = [steps(0, 0.1, 0.1), steps(1, 0.1, 0.1), steps(2, 0.1, 0.1), steps(3, 0.5, 0.1)]
    found = assess(POLICY, 600, 1, slow, rank_nodes(members), [], T0)
    assert [(f.rank, f.node_id) for f in found.flags] == [(3, "i-1")]


def test_spec_takes_the_straggler_policy_and_refuses_nonsense() -> None:
    spec = parse_spec(job_spec(elastic={"straggler": {"slowdown": 3, "patience_s": 60}}))
    assert spec.elastic.straggler == StragglerPolicy(slowdown=3, patience_s=60)
    assert parse_spec(job_spec()).elastic.straggler is None  # off unless asked for
    with pytest.raises(SpecError, match="slowdown"):
        parse_spec(job_spec(elastic={"straggler": {"slowdown": 1}}))


# --- a job on real rank processes --------------------------------------------------------------

# Independent ranks (no collectives): 20 ms of marked work per step. The node rank 1 first
# ran on turns slow (or hangs) SLOW_AFTER steps into each rank's run: only replacing that node
# cures it.
RANK = textwrap.dedent(
    """
    import os, sys, time
    from spotrain import elastic

    s = elastic.wait_for_gang()
    lockstep = os.environ["SLOW_MODE"] == "lockstep-hang"
    if lockstep:  # DDP-like: every step ends in a collective
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
    latest = elastic.latest_checkpoint()
    step = first = latest["step"] if latest else 0
    marker = os.environ["SLOW_NODE_FILE"]
    if s.rank == 1 and not os.path.exists(marker):
        with open(marker + ".tmp", "w") as f:
            f.write(s.node_id)
        os.replace(marker + ".tmp", marker)
    slow_node = open(marker).read() if os.path.exists(marker) else ""
    extra = 0.2 if os.environ["SLOW_MODE"] == "slow" else 3600.0
    slow_after = first + int(os.environ["SLOW_AFTER"])
    while step < s.total_steps and (step % 10 or elastic.store().done() is None):
        with elastic.busy():  # this rank's own work
            time.sleep(0.02 + (extra if s.node_id == slow_node and step >= slow_after else 0))
        step += 1
        stopping = elastic.elastic_event_detected()
        if lockstep:  # (waits on the peers: outside this rank's own work)
            flag = torch.tensor([float(stopping)])
            dist.all_reduce(flag)
            stopping = flag.item() > 0
        if stopping or step % 10 == 0:
            elastic.mark_checkpoint(step, f"ckpt-{step}")  # (rank 0's counts)
        elastic.report_progress(step)
        if stopping:
            elastic.ack_checkpoint(step)
            sys.exit(0)
    elastic.mark_done(step)
    while not elastic.store().done():  # the barrier after mark_done
        time.sleep(0.02)
    """
)


STEPS = 900  # 18 s of rank 0's steps: it must not finish before the straggler is replaced


def straggler_job(tmp_path: Path, mode: str) -> dict[str, Any]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    return job_spec(
        name=f"straggler-{mode}-{uuid.uuid4().hex[:6]}",
        command=[*WARM_PYTHON, str(script)],  # (lockstep: torch at once, however busy)
        total_steps=STEPS,
        checkpoint=f"file://{tmp_path / 'ckpt'}",
        env={"SLOW_NODE_FILE": str(tmp_path / "slow-node"), "SLOW_MODE": mode, "SLOW_AFTER": "30"},
        elastic={
            **FAST_ELASTIC,
            "min_nodes": 2,
            "max_nodes": 2,
            "graceful_shutdown_timeout_s": 2,
            # The stall clock runs from the generation's start: lockstep ranks import torch
            # and form a gloo group before their first step, seen to take over 8 s under load
            # (a stall fault at step 0, then more: the job restarted or Failed). The other
            # modes import no torch, and their hang must be told before rank 0 finishes.
            "stall_timeout_s": 30 if mode == "lockstep-hang" else 8,
            "straggler": {"slowdown": 3, "patience_s": 1},
        },
        spot={
            "instance_types": [{"name": "m5.large", "on_demand_price": 0.1, "spot_price": 0.03}],
            "zones": ["us-east-1a"],
        },
    )


@contextmanager
def killed_at_exit(runtime: LocalRuntime, job: str) -> Iterator[None]:
    """A failed test leaves no rank running (the job's own teardown does that when it ends)."""
    try:
        yield
    finally:
        runtime.cleanup_job(CleanupRequest(job=job, keep=True))


RECORDED = {"slow": "straggler_replace", "lockstep-hang": "straggler_lockstep_hang"}


@pytest.mark.usefixtures("warm_python_server")
@pytest.mark.parametrize("mode", ["slow", "hang", "lockstep-hang"])
async def test_a_slow_or_hung_node_is_flagged_and_replaced_and_the_job_completes(
    dev_env: WorkflowEnvironment, tmp_path: Path, mode: str
) -> None:
    spec = straggler_job(tmp_path, mode)
    runtime = LocalRuntime(tmp_path / "rt", term_grace_s=1)
    with ThreadPoolExecutor(8) as pool, killed_at_exit(runtime, spec["name"]):
        async with workflow_worker(
            dev_env.client,
            spec["name"],
            SimulatedCloud(zones=["us-east-1a"]).activities() + runtime.activities(),
            activity_executor=pool,
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob",
                spec,
                id=spec["name"],
                task_queue=spec["name"],
                result_type=JobResult,
            )
            flagged = await polled(
                lambda: handle.query("status", result_type=JobStatus),
                lambda s: bool(s.stragglers),
                timeout=150,
            )
            result = await asyncio.wait_for(handle.result(), 180)
            if recording := RECORDED.get(mode):
                await record_history(handle, recording)
    slow_node = (tmp_path / "slow-node").read_text()
    [flag] = flagged.stragglers
    assert (flag.rank, flag.node_id, flag.hung) == (1, slow_node, mode != "slow"), flag
    why = {"slow": ["its usual"], "hang": ["while 1 peer(s) step"], "lockstep-hang": ["wait"]}
    # Lockstep: once the job stalls, rank 1 is stuck in its work while rank 0 waits. But if
    # rank 0's record is newer than rank 1's (its work once outlasted STUCK_AFTER_S under load,
    # so it rewrote its record at the next step: StepClock.stale), rank 1 is told first by
    # having had no step for stall_timeout_s while rank 0 has: the same culprit, as hung.
    why["lockstep-hang"].append("while 1 peer(s) step")
    assert any(w in flag.why for w in why[mode]), flag
    shown = Console(width=200, record=True)
    shown.print(status_view(flagged))  # `spotrain status`
    kind = "slow" if mode == "slow" else "hung"
    assert f"{kind} rank 1 on {slow_node}" in shown.export_text()
    events = [(e.event, e.detail) for e in result.timeline]
    assert ("straggler replaced", slow_node) in events, events
    assert ("node released", f"spot {slow_node}: straggler") in events, events
    assert result.phase == "Succeeded" and result.steps_done == STEPS
    assert result.faults == 0 and result.generations == 2, events  # replaced, not restarted
    assert not (left := leftover_processes(spec["name"])), left
    # (generation 2 ran on the replacement: on the slow node, rank 1 would be flagged again)
    assert [e for e, _ in events].count("straggler") == 1, events
