"""TrainingJob end to end on the time-skipping server, simulated cloud and runtime."""

from __future__ import annotations

import contextlib
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedCloud, SimulatedRuntime
from spotrain.elastic.job_store import JobStore
from spotrain.workflows import contract
from spotrain.workflows.contract import CleanupRequest, LaunchRequest, NodeInfo
from spotrain.workflows.history import HISTORY_EVENTS_BEFORE_CONTINUE
from spotrain.workflows.job import events
from spotrain.workflows.job.state import JobState
from spotrain.workflows.spec import parse_spec
from tests.jobs import job_spec, record_history, simulated, skip, until


async def test_job_runs_to_completion_and_releases_everything(ts_env: WorkflowEnvironment) -> None:
    async with simulated(ts_env.client) as sim:
        spec = job_spec()
        handle = await sim.start(spec)
        result = await handle.result()
    assert result.phase == "Succeeded"
    assert result.steps_done == spec["total_steps"]
    assert result.generations == 1
    assert result.steps_lost == 0
    assert sim.cloud.running() == []
    assert len(sim.cloud.launches) == 4
    assert all(launch.lifecycle == "spot" for launch in sim.cloud.launches)
    # One zone (placement: zone, the default): the job's all-reduce never crosses zones.
    assert {launch.zone for launch in sim.cloud.launches} == {"us-east-1a"}
    assert result.transfer.zone_gb == 0
    # 36,000 steps at 4 nodes x 3,600 steps/h = 2.5 h of 4 nodes (+ 60 s start-up).
    assert 9.9 < result.node_hours["spot"] < 10.5
    assert result.cost["on-demand"] == 0
    assert abs(result.savings - (1 - 0.97 / 3.06)) < 1e-6


async def test_spot_cost_is_the_market_price_when_the_spec_gives_none(
    ts_env: WorkflowEnvironment,
) -> None:
    """No `spot_price` in the spec: spot nodes cost what the provider offered them at."""
    types = [{"name": "p3.2xlarge", "gpus": 1, "on_demand_price": 3.06}]
    spec = job_spec(spot={"instance_types": types})
    async with simulated(ts_env.client, cloud=SimulatedCloud(spot_price=0.5)) as sim:
        result = await (await sim.start(spec)).result()
    assert result.cost["spot"] == pytest.approx(0.5 * result.node_hours["spot"], rel=1e-3)
    assert result.savings == pytest.approx(1 - 0.5 / 3.06, rel=1e-3)


async def test_a_launch_that_cannot_work_fails_the_job_with_the_reason(
    ts_env: WorkflowEnvironment,
) -> None:
    """Bad credentials or an unknown instance type will not heal by retrying: the job fails
    at once with the provider's message, and nothing is left behind."""

    class Misconfigured(SimulatedCloud):
        @activity.defn(name=contract.LAUNCH_NODE)
        def launch_node(self, req: LaunchRequest) -> NodeInfo:
            raise ApplicationError(
                "InvalidInstanceType.NotFound: p3.2xlarge is not offered",
                type=contract.CONFIG_ERROR,
                non_retryable=True,
            )

    async with simulated(ts_env.client, cloud=Misconfigured()) as sim:
        handle = await sim.start(job_spec())
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    assert "InvalidInstanceType.NotFound" in str(failure.value.cause)
    assert sim.cloud.running() == [] and sim.runtime.running_generations(handle.id) == []


async def test_a_finished_jobs_checkpoint_fails_a_new_job_before_it_buys_a_node(
    ts_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A spec renamed but still pointing at a finished job's `checkpoint:` fails at once,
    saying how to resume, with no node launched (it used to buy them all first)."""
    checkpoint = (tmp_path / "ckpt").as_uri()
    JobStore(checkpoint).write_done(600, 0.0)  # the earlier job's ranks finished here
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(job_spec(checkpoint=checkpoint))
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
        await record_history(handle, "checkpoint_of_a_finished_job")
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "JobFailed"
    assert "already finished (step 600)" in cause.message and "--resume" in cause.message
    assert sim.cloud.launches == [] and sim.runtime.running_generations(handle.id) == []
    launched = [
        e
        async for e in handle.fetch_history_events()
        if e.activity_task_scheduled_event_attributes.activity_type.name == contract.LAUNCH_NODE
    ]
    assert launched == []


async def test_total_gpus_are_packed_onto_node_shapes(ts_env: WorkflowEnvironment) -> None:
    types = [
        {"name": "p4.big", "gpus": 10, "on_demand_price": 30.0, "spot_price": 9.0},
        {"name": "p4.mid", "gpus": 8, "on_demand_price": 24.0, "spot_price": 7.0},
    ]
    spec = job_spec(
        total_gpus=15,
        total_steps=3_600,
        elastic={"min_nodes": 1, "max_nodes": 2},
        spot={"instance_types": types},
    )
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(spec)
        result = await handle.result()
    launched = sorted((launch.instance_type, launch.slot) for launch in sim.cloud.launches)
    assert [t for t, _ in launched] == ["p4.big", "p4.mid"]  # 10 + 5 GPUs, never 10 + 10
    started = next(e for e in result.timeline if e.event == "generation started")
    assert "world size 15" in started.detail
    assert result.steps_done == 3_600


@pytest.mark.slow
async def test_a_week_with_120_reclaims_continues_as_new_with_its_books_and_stays_bounded(
    ts_env: WorkflowEnvironment,
) -> None:
    """A week of training with a reclaim notice every 84 minutes, each node replaced (about
    13,000 events): the job continues as new soon after a run passes its bound (so any run
    replays quickly), carries its books across, and launches exactly one replacement per
    reclaim. (A month with 500 reclaims, 27 runs, proved no more at five times the cost.)"""
    reclaims, week_s = 120, 7 * 24 * 3600
    hourly = {"progress_report_interval_s": 3600, "capacity_check_interval_s": 3600}
    spec = job_spec(total_steps=10**9, elastic=hourly)
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(spec)
        for i in range(reclaims):
            await skip(ts_env, week_s / reclaims)
            status = await sim.status(handle)
            ranked = sorted((n for n in status.nodes if n.rank is not None), key=lambda n: n.slot)
            victim = ranked[i % len(ranked)].node_id
            deadline = await ts_env.get_current_time() + timedelta(seconds=120)
            notice = {"node_id": victim, "deadline": deadline.isoformat(), "event_id": f"r{i}"}
            await handle.signal("reclaim", notice)
        await skip(ts_env, week_s / reclaims)
        status = await sim.status(handle)
        await handle.cancel()
        lengths = []  # events per run, newest first, following the continue-as-new chain
        run_id: str | None = None
        while True:
            run = ts_env.client.get_workflow_handle(handle.id, run_id=run_id)
            events = (await run.fetch_history()).events
            lengths.append(len(events))
            started = events[0].workflow_execution_started_event_attributes
            run_id = started.continued_execution_run_id
            if not run_id:
                break
    assert status.reclaims == reclaims and status.phase == "Running" and status.world_size == 4
    assert len(lengths) > 3 and max(lengths) < HISTORY_EVENTS_BEFORE_CONTINUE + 500, lengths
    assert len(sim.cloud.launches) == 4 + reclaims
    assert status.node_hours["spot"] > 0.95 * 4 * 7 * 24  # a week of 4 nodes, books carried
    assert sim.cloud.running() == []


async def test_an_event_queued_before_continue_as_new_is_acted_on_in_the_next_run(
    ts_env: WorkflowEnvironment,
) -> None:
    """Continue-as-new carries the inbox in JobState; the next run must dispatch what it
    decodes from it. (Found by bench/scale.py: with the sandbox's re-imported copies of
    spotrain's modules the carried event matched no case and a reclaim notice was dropped.)"""
    async with simulated(ts_env.client) as sim:
        spec = job_spec()
        carried = JobState.new(parse_spec(spec))
        carried.inbox.append(events.Pause())
        handle = await sim.client.start_workflow(
            "TrainingJob", args=[spec, carried], id=spec["name"], task_queue=sim.task_queue
        )
        status = await until(sim, handle, lambda s: s.phase == "Paused", timeout=30)
        await handle.terminate()
    assert any(e.event == "paused" for e in status.timeline)
    assert status.generation == 0  # paused before any generation started


@pytest.mark.parametrize("attempts", [2, 3])
async def test_a_nodes_launch_is_tried_max_launch_attempts_times(
    ts_env: WorkflowEnvironment, attempts: int
) -> None:
    """An API that fails twice before it answers: three attempts get the node, two give it
    up ("launch failed") and never try a third time."""
    tried: list[int] = []

    class Flaky(SimulatedCloud):
        @activity.defn(name=contract.LAUNCH_NODE)
        def launch_node(self, req: LaunchRequest) -> NodeInfo:
            tried.append(activity.info().attempt)
            if activity.info().attempt <= 2:
                raise ApplicationError("RequestLimitExceeded: slow down", type="Throttled")
            return super().launch_node(req)

    spec = job_spec(elastic={"min_nodes": 1, "max_nodes": 1, "max_launch_attempts": attempts})
    async with simulated(ts_env.client, cloud=Flaky()) as sim:
        handle = await sim.start(spec)
        if attempts == 3:
            status = await until(sim, handle, lambda s: s.phase == "Running", timeout=60)
        else:
            status = await until(
                sim, handle, lambda s: any(e.event == "launch failed" for e in s.timeline), 60
            )
        await handle.terminate()
    assert max(tried) == attempts
    assert any(e.event == "launch failed" for e in status.timeline) == (attempts == 2)


@pytest.mark.parametrize(
    ("cleanup", "fails", "keep"),
    [
        ("always", False, False),
        ("always", True, False),
        ("keep_failed", False, False),
        ("keep_failed", True, True),
        ("never", False, True),
        ("never", True, True),
    ],
)
async def test_each_cleanup_policy_keeps_what_it_says(
    ts_env: WorkflowEnvironment, cleanup: str, fails: bool, keep: bool
) -> None:
    """`cleanup`: what the runtime is told to keep (pods, logs) when the job ends."""
    kept: list[bool] = []

    class Recording(SimulatedRuntime):
        @activity.defn(name=contract.CLEANUP_JOB)
        def cleanup_job(self, req: CleanupRequest) -> None:
            kept.append(req.keep)
            super().cleanup_job(req)

    class Misconfigured(SimulatedCloud):
        @activity.defn(name=contract.LAUNCH_NODE)
        def launch_node(self, req: LaunchRequest) -> NodeInfo:
            raise ApplicationError("bad type", type=contract.CONFIG_ERROR, non_retryable=True)

    cloud = Misconfigured() if fails else SimulatedCloud()
    spec = job_spec(total_steps=100, cleanup=cleanup)
    async with simulated(ts_env.client, cloud=cloud, runtime=Recording()) as sim:
        handle = await sim.start(spec)
        with contextlib.suppress(WorkflowFailureError):
            await handle.result()
    assert kept == [keep]


async def test_a_signal_that_does_not_parse_is_refused_on_the_jobs_timeline(
    ts_env: WorkflowEnvironment, caplog: pytest.LogCaptureFixture
) -> None:
    """A signal has no answer (the Temporal CLI says "succeeded" whatever the workflow makes
    of it): a payload with an unknown or missing field is named on the job's timeline and in
    one log line, not dropped with the SDK's traceback; a good one after it is acted on."""
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(job_spec())
        status = await until(sim, handle, lambda s: s.world_size == 4)
        victim = next(n.node_id for n in status.nodes if n.rank is not None)
        await handle.signal("reclaim", {"node_id": victim, "deadline_s": 120})
        await handle.signal("node_lost", {"node": victim})
        await handle.signal("reclaim", {"node_id": victim, "event_id": "good"})
        status = await until(sim, handle, lambda s: s.reclaims == 1)
        await handle.cancel()
    refused = [e.detail for e in status.timeline if e.event == "signal refused"]
    assert refused == [
        "reclaim: deadline_s: Extra inputs are not permitted",
        "node_lost: node_id: Field required; node: Extra inputs are not permitted",
    ]
    assert "Failed deserializing signal input" not in caplog.text
