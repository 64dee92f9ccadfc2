"""TrainingJob scenarios on the real Temporal dev server, with the simulated cloud and runtime
running at seconds instead of minutes: reclaims with and without notice, replacements, growth,
user scaling, pause, faults, stalls, cancel and storms of duplicate signals.

The dev server suggests continue-as-new every 200 events (conftest), so these runs also
cross continue-as-new boundaries with state carried over."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedCloud, SimulatedRuntime
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    DescribeRequest,
    LaunchRequest,
    NodeInfo,
    Offer,
    StopRequest,
    StopResult,
)
from spotrain.workflows.job.state import JobStatus
from spotrain.workflows.spec import SpotPolicy
from tests.jobs import (
    continue_as_new_now,
    fast_runtime,
    fast_spec,
    left_before_the_shrink,
    record_history,
    running_at,
    simulated,
    sizes,
    until,
)

pytestmark = pytest.mark.slow

Handle = WorkflowHandle[Any, Any]
ONE_ZONE = {"zones": ["us-east-1a"]}


def members(status: JobStatus) -> list[str]:
    ranked = sorted((n for n in status.nodes if n.rank is not None), key=lambda n: n.rank or 0)
    return [n.node_id or "" for n in ranked]


def in_seconds(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


async def update_error(handle: Handle, name: str, arg: dict[str, Any]) -> str:
    """The message of an update that the workflow's validator rejected."""
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await handle.execute_update(name, arg)
    return str(err.value.cause)


async def test_reclaim_with_notice_checkpoints_shrinks_and_grows_back(
    dev_env: WorkflowEnvironment,
) -> None:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec())
        before = await until(sim, handle, lambda s: running_at(4)(s) and s.step > 50)
        victim = members(before)[1]
        await handle.signal(
            "reclaim", {"node_id": victim, "deadline": in_seconds(120), "event_id": "e1"}
        )
        result = await handle.result()
        await record_history(handle, "reclaim_with_notice")
    assert left_before_the_shrink(result, victim), result.timeline
    assert sizes(result)[-3:] == [4, 3, 4]
    assert result.reclaims == 1
    assert result.steps_lost == 0  # the checkpoint on notice keeps every step
    assert result.steps_done == 600
    assert sim.cloud.running() == []
    assert sim.runtime.jobs[handle.id].history[-1][3] == 600


async def test_node_lost_restarts_from_checkpoint_on_a_replacement(
    dev_env: WorkflowEnvironment,
) -> None:
    async with simulated(dev_env.client, runtime=fast_runtime(checkpoint_every=100)) as sim:
        handle = await sim.start(fast_spec())
        before = await until(sim, handle, lambda s: running_at(4)(s) and s.step % 100 > 20)
        victim = members(before)[0]
        sim.cloud.reclaim(victim)
        await handle.signal("node_lost", {"node_id": victim, "event_id": "lost-1"})
        result = await handle.result()
        await record_history(handle, "node_lost")
    assert sizes(result) == [4, 4]  # the replacement came within the faulty scale-down timeout
    # The ranks lost every step since the last periodic checkpoint, and the next generation
    # resumed from it. (Not `0 < steps_lost`: under load the loss can reach the job after its
    # ranks have trained their last step, at a checkpoint; a run beside two busy loops did.)
    (*_, reached), (*_, resumed, _) = sim.runtime.jobs[handle.id].history
    assert resumed == reached // 100 * 100
    assert result.steps_lost == reached - resumed
    assert result.reclaims == 1
    assert result.steps_done == 600
    assert sim.cloud.running() == []


def redone(history: list[tuple[int, int, int, int]]) -> int:
    """Steps the simulated ranks really did twice: each generation's end beyond where the next
    one resumed (history rows: generation, world size, from step, to step)."""
    return sum(max(0, a[3] - b[2]) for a, b in itertools.pairwise(history))


async def test_steps_lost_count_what_the_ranks_redo(dev_env: WorkflowEnvironment) -> None:
    """A loss between two progress reports: the job counts the steps since the checkpoint
    that the ranks had reached, not the fewer its last watch saw (reports 3 s apart here)."""
    runtime = fast_runtime(checkpoint_every=10**6)  # no periodic checkpoint: all is redone
    async with simulated(dev_env.client, runtime=runtime) as sim:
        spec = fast_spec(elastic={"progress_report_interval_s": 3, "stall_timeout_s": 30})
        handle = await sim.start(spec)
        seen = await until(sim, handle, lambda s: running_at(4)(s) and s.step > 0)
        await asyncio.sleep(1.5)  # the ranks move on; the job's last watch stays behind
        victim = members(seen)[0]
        sim.cloud.reclaim(victim)
        await handle.signal("node_lost", {"node_id": victim, "event_id": "lost-1"})
        result = await handle.result()
    history = sim.runtime.jobs[handle.id].history
    assert redone(history) > seen.step  # the ranks went on past what the job had seen
    assert result.steps_lost == redone(history)
    assert result.steps_done == 600


async def test_replacement_falls_back_to_on_demand_then_returns_to_spot(
    dev_env: WorkflowEnvironment,
) -> None:
    spot = {"n": 1000}
    cloud = SimulatedCloud(zones=["us-east-1a"], capacity=lambda _t, _z, _w: spot["n"])
    async with simulated(dev_env.client, cloud=cloud, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec(total_steps=10**6, spot=ONE_ZONE))
        before = await until(sim, handle, running_at(4))
        spot["n"] = 3  # the pool now holds only the 3 survivors
        victim = members(before)[3]
        sim.cloud.reclaim(victim)
        await handle.signal("node_lost", {"node_id": victim, "event_id": "x"})

        def on_demand_member(s: JobStatus) -> bool:
            return running_at(4)(s) and any(
                n.lifecycle == "on-demand" and n.rank is not None for n in s.nodes
            )

        fallback = await until(sim, handle, on_demand_member)
        spot["n"] = 1000  # spot is back: move off the on-demand node

        def all_spot(s: JobStatus) -> bool:
            ready = [n for n in s.nodes if n.state == "ready"]
            return running_at(4)(s) and all(n.lifecycle == "spot" for n in ready)

        swapped = await until(sim, handle, all_spot)
        await handle.cancel()
        await until(sim, handle, lambda s: s.phase == "Cancelled")
    assert fallback.generation < swapped.generation
    assert swapped.cost["on-demand"] > 0
    assert any(e.event == "node ready" and "on-demand" in e.detail for e in swapped.timeline)
    assert sim.cloud.running() == []


class StaleOffers(SimulatedCloud):
    """Offers every pool, but us-east-1a has no capacity when a launch gets there (price
    history says nothing about capacity): the launch is where a pool turns out empty."""

    @activity.defn(name=contract.LAUNCH_NODE)
    def launch_node(self, req: LaunchRequest) -> NodeInfo:
        if req.lifecycle == "spot" and req.zone == "us-east-1a":
            raise ApplicationError(
                "InsufficientInstanceCapacity", type=contract.CAPACITY_ERROR, non_retryable=True
            )
        return super().launch_node(req)

    @activity.defn(name=contract.FIND_OFFERS)
    def find_offers(self, policy: SpotPolicy) -> list[Offer]:
        return [Offer(instance_type="p3.2xlarge", zone=z, price=0.9) for z in self.zones]


async def test_capacity_error_falls_over_to_the_next_pool_then_on_demand(
    dev_env: WorkflowEnvironment,
) -> None:
    """`placement: any`: a node goes to the next pool, in any zone, then to on-demand."""
    b_capacity = {"us-east-1a": 1000, "us-east-1b": 2}
    cloud = StaleOffers(capacity=lambda _t, zone, _w: b_capacity[zone])
    spec = fast_spec(total_steps=10**6, on_demand={"max_nodes": 2}, placement="any")
    async with simulated(dev_env.client, cloud=cloud, runtime=fast_runtime()) as sim:
        handle = await sim.start(spec)
        status = await until(sim, handle, running_at(4))
        await handle.cancel()
    launched = [(launch.lifecycle, launch.zone) for launch in sim.cloud.launches]
    assert sorted(launched) == [("on-demand", None)] * 2 + [("spot", "us-east-1b")] * 2
    assert all(n.zone != "us-east-1a" for n in status.nodes if n.lifecycle == "spot")


async def test_a_zone_whose_pools_turn_out_empty_is_left_for_one_that_serves(
    dev_env: WorkflowEnvironment,
) -> None:
    """`placement: zone`: zone a's offers are stale (its launches find no capacity), so its
    pools count as dry and the job, holding nothing, buys every node in zone b instead of
    retrying zone a for ever or spreading over both."""
    cloud = StaleOffers()
    spec = fast_spec(total_steps=10**6, on_demand={"fallback": False})
    async with simulated(dev_env.client, cloud=cloud, runtime=fast_runtime()) as sim:
        handle = await sim.start(spec)
        status = await until(sim, handle, running_at(4))
        await handle.cancel()
    assert {launch.zone for launch in sim.cloud.launches} == {"us-east-1b"}
    assert {n.zone for n in status.nodes if n.state == "ready"} == {"us-east-1b"}
    moves = [e.detail for e in status.timeline if e.event == "zone hop"]
    assert moves == ["to us-east-1b: it holds no node in us-east-1a"] and status.hops == 1


async def test_opportunistic_scale_out_when_spot_capacity_appears(
    dev_env: WorkflowEnvironment,
) -> None:
    spot = {"n": 2}
    cloud = SimulatedCloud(zones=["us-east-1a"], capacity=lambda _t, _z, _w: spot["n"])
    spec = fast_spec(elastic={"initial_nodes": 2}, on_demand={"fallback": False}, spot=ONE_ZONE)
    async with simulated(dev_env.client, cloud=cloud, runtime=fast_runtime()) as sim:
        handle = await sim.start(spec)
        await until(sim, handle, running_at(2))
        await asyncio.sleep(2)  # capacity checks find nothing: it stays at 2
        assert (await sim.status(handle)).world_size == 2
        spot["n"] = 4
        await until(sim, handle, running_at(4))
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    assert sim.cloud.running() == []


async def test_a_timed_scale_out_reverts_when_the_nodes_do_not_come(
    dev_env: WorkflowEnvironment,
) -> None:
    """`{"count", "timeout_s"}`: the update answers when the nodes came, or once the target
    went back because they did not come in time (no capacity: it used to wait for ever)."""
    spot = {"n": 2}
    cloud = SimulatedCloud(zones=["us-east-1a"], capacity=lambda _t, _z, _w: spot["n"])
    spec = fast_spec(
        total_steps=10**6,
        elastic={"initial_nodes": 2, "opportunistic": False},
        on_demand={"fallback": False},
        spot=ONE_ZONE,
    )
    async with simulated(dev_env.client, cloud=cloud, runtime=fast_runtime()) as sim:
        handle = await sim.start(spec)
        await until(sim, handle, running_at(2))
        answer = await handle.execute_update(
            "scale_out", {"count": 2, "timeout_s": 3}, result_type=str
        )
        assert answer == "timed out with 2 of 4 node(s) ready: target back to 2", answer
        status = await sim.status(handle)
        assert [e.detail for e in status.timeline if e.event == "scale out timed out"] == [answer]
        assert len([n for n in status.nodes if n.state in ("requested", "ready")]) == 2
        spot["n"] = 4  # now the nodes come
        answer = await handle.execute_update(
            "scale_out", {"count": 2, "timeout_s": 60}, result_type=str
        )
        assert answer == "scaled out: 4 nodes ready"
        await until(sim, handle, running_at(4))
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        await record_history(handle, "timed_scale_out")
    assert sim.cloud.running() == []


async def test_discrete_sizes_only(dev_env: WorkflowEnvironment) -> None:
    cloud = SimulatedCloud(zones=["us-east-1a"], capacity=lambda _t, _z, _w: 3)
    spec = fast_spec(
        elastic={"discrete_sizes": [2, 4]}, on_demand={"fallback": False}, spot=ONE_ZONE
    )
    async with simulated(dev_env.client, cloud=cloud, runtime=fast_runtime()) as sim:
        handle = await sim.start(spec)
        status = await until(sim, handle, lambda s: s.phase == "Running")
        await handle.cancel()
    assert status.world_size == 2  # 3 ready nodes, but 3 is not an allowed size
    assert len([n for n in status.nodes if n.state == "ready"]) == 3


async def test_a_repeated_update_id_is_answered_once_across_continue_as_new(
    dev_env: WorkflowEnvironment,
) -> None:
    """Temporal answers a repeated update id with the first outcome only within one run; the
    operator repeats its ScaleIn/ScaleOut updates under their ids after a crash, and by then
    the job may have continued as new. The new run must answer from its books, not act again.
    No run is cached: every task replays its history, as after an eviction under load, so
    `continue_as_new_now` must leave the run's earlier decisions as they were (with the
    bound at 0 the replay fails as nondeterministic)."""
    uncached = {"max_cached_workflows": 0}
    async with simulated(dev_env.client, runtime=fast_runtime(), **uncached) as sim:
        elastic = {"min_nodes": 1, "max_nodes": 6, "initial_nodes": 4, "opportunistic": False}
        handle = await sim.start(fast_spec(total_steps=10_000_000, elastic=elastic))
        await until(sim, handle, running_at(4))
        asks = [
            ("scale_in", {"count": 1}, "op-in", 3),
            ("scale_out", {"count": 2, "timeout_s": 30}, "op-out", 5),
        ]
        for name, arg, update_id, size in asks:
            first = await handle.execute_update(name, arg, id=update_id, result_type=str)
            step = (await until(sim, handle, running_at(size))).step
            await continue_as_new_now(handle)
            again = await handle.execute_update(name, arg, id=update_id, result_type=str)
            after = await until(sim, handle, lambda s, at=step: s.step > at + 20)  # (turns later)
            assert again == first and after.target_nodes == size, (again, first, after.target_nodes)
        await handle.cancel()
    told = [e.event for e in after.timeline]
    assert told.count("scale in") == 1 and told.count("scale out") == 1, told


async def test_scale_in_by_name_and_by_count_then_out(dev_env: WorkflowEnvironment) -> None:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec(total_steps=1000, elastic={"min_nodes": 1}))
        named = members(await until(sim, handle, running_at(4)))[1]
        await handle.execute_update("scale_in", {"node_ids": [named]})
        after_named = await until(sim, handle, running_at(3))
        await handle.execute_update("scale_in", {"count": 1})
        after_count = await until(sim, handle, running_at(2))
        assert "min_nodes is 1" in await update_error(handle, "scale_in", {"count": 2})
        assert "unknown or gone node(s): i-nope" in await update_error(
            handle, "scale_in", {"node_ids": ["i-nope"]}
        )
        assert "max_nodes is 4" in await update_error(handle, "scale_out", {"count": 3})
        await handle.execute_update("scale_out", {"count": 2})
        await until(sim, handle, running_at(4))
        result = await handle.result()
        await record_history(handle, "scale_in_out")
    assert named not in members(after_named)
    assert members(after_count) == members(after_named)[:2]  # the highest rank went
    assert result.steps_lost == 0
    assert sim.cloud.running() == []


async def test_pause_releases_nodes_and_resume_continues(dev_env: WorkflowEnvironment) -> None:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec())
        await until(sim, handle, lambda s: running_at(4)(s) and s.step > 50)
        await handle.execute_update("pause", {})
        paused = await until(sim, handle, lambda s: s.phase == "Paused")
        await asyncio.sleep(1)
        still = await sim.status(handle)
        nodes_while_paused = len(sim.cloud.running())
        assert "already paused" in await update_error(handle, "pause", {})
        await handle.execute_update("resume", {})
        result = await handle.result()
    assert paused.world_size == 0 and nodes_while_paused == 0
    assert still.step == paused.step  # nothing trains, or bills, while paused
    assert result.steps_done == 600 and result.steps_lost == 0
    assert sim.cloud.running() == []


async def test_fault_restarts_the_generation_and_recovers(dev_env: WorkflowEnvironment) -> None:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec())
        await until(sim, handle, lambda s: running_at(4)(s) and s.step > 50)
        sim.runtime.fail(handle.id)
        result = await handle.result()
        await record_history(handle, "fault_recovers")
    assert result.faults == 1
    assert result.generations == 2
    assert result.steps_done == 600


async def test_fault_then_scale_down_when_no_replacement_comes(
    dev_env: WorkflowEnvironment,
) -> None:
    spot = {"n": 4}
    cloud = SimulatedCloud(zones=["us-east-1a"], capacity=lambda _t, _z, _w: spot["n"])
    spec = fast_spec(on_demand={"fallback": False}, spot=ONE_ZONE)
    async with simulated(dev_env.client, cloud=cloud, runtime=fast_runtime()) as sim:
        handle = await sim.start(spec)
        victim = members(await until(sim, handle, running_at(4)))[2]
        spot["n"] = 3  # no capacity for a replacement
        sim.cloud.reclaim(victim)
        lost_at = time.monotonic()
        await handle.signal("node_lost", {"node_id": victim, "event_id": "gone"})
        await until(sim, handle, running_at(3))
        waited = time.monotonic() - lost_at
        await handle.cancel()
    assert waited >= 2.5  # held up to faulty_scale_down_timeout (3 s) before shrinking


async def test_stall_is_a_fault(dev_env: WorkflowEnvironment) -> None:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec())
        await until(sim, handle, lambda s: running_at(4)(s) and s.step > 50)
        sim.runtime.stall(handle.id, datetime.now(UTC))
        result = await handle.result()
    assert result.faults == 1
    assert any("stalled" in e.detail for e in result.timeline)
    assert result.steps_done == 600


class FinishesAsStoppedRuntime(SimulatedRuntime):
    """The ranks run their last step just as a stop reaches them: a resize decided before a
    watch saw the end (on a loaded machine, Kubernetes showed the growth after a loss
    starting a whole new generation of pods for a job already finished)."""

    @activity.defn(name=contract.STOP_GENERATION)
    def stop_generation(self, req: StopRequest) -> StopResult:
        with self._lock:
            gen = self.jobs[req.job].generations[req.generation]
            gen.start_step = gen.plan.total_steps
        return super().stop_generation(req)


async def test_a_job_finished_as_its_generation_stops_completes(
    dev_env: WorkflowEnvironment,
) -> None:
    async with simulated(dev_env.client, runtime=FinishesAsStoppedRuntime()) as sim:
        handle = await sim.start(fast_spec())
        victim = members(await until(sim, handle, running_at(4)))[0]
        await handle.signal(
            "reclaim", {"node_id": victim, "deadline": in_seconds(120), "event_id": "r"}
        )
        result = await handle.result()
        await record_history(handle, "finished_in_stop")
    assert (result.phase, result.steps_done, result.steps_lost) == ("Succeeded", 600, 0)
    assert sizes(result) == [4]  # no generation after the end
    events = [e.event for e in result.timeline]
    assert events[events.index("completed") - 1] == "generation checkpointed", events
    assert sim.cloud.running() == []


async def test_max_restarts_exceeded_fails_with_reason(dev_env: WorkflowEnvironment) -> None:
    # No generation checkpoints or ends before its fault, however late a loaded machine
    # injects it (beside two busy loops one generation ran the whole job first).
    runtime = fast_runtime(checkpoint_every=10**9)
    async with simulated(dev_env.client, runtime=runtime) as sim:
        # (no stall watchdog: under load it could end a generation before the injected fault)
        elastic = {"max_restarts": 2, "stall_timeout_s": 600}
        handle = await sim.start(fast_spec(total_steps=10**8, elastic=elastic))
        for generation in range(1, 5):
            # (the runtime's own word that the generation runs: the job's status says so
            # before its start activity has run, and a fault injected then hits nothing)
            await until(
                sim,
                handle,
                lambda s, g=generation: (
                    s.phase == "Failed" or g in runtime.running_generations(handle.id)
                ),
            )
            runtime.fail(handle.id, "rank 3 exited with code 137")
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "JobFailed"
    assert "max_restarts=2" in cause.message and "code 137" in cause.message
    assert sim.cloud.running() == []


class SlowStopRuntime(SimulatedRuntime):
    """Checkpoints take until the test says so: the resize is caught in the middle."""

    def __init__(self) -> None:
        super().__init__(steps_per_hour=lambda world: 36_000.0 * world, restart_cost_s=0.5)
        self.stopping = threading.Event()
        self.go = threading.Event()

    @activity.defn(name=contract.STOP_GENERATION)
    def stop_generation(self, req: StopRequest) -> StopResult:
        self.stopping.set()
        while not self.go.wait(1):
            activity.heartbeat()
        return super().stop_generation(req)


async def test_cancel_mid_resize_releases_all_nodes(dev_env: WorkflowEnvironment) -> None:
    runtime = SlowStopRuntime()
    async with simulated(dev_env.client, runtime=runtime) as sim:
        handle = await sim.start(fast_spec())
        victim = members(await until(sim, handle, running_at(4)))[0]
        await handle.signal(
            "reclaim", {"node_id": victim, "deadline": in_seconds(120), "event_id": "r"}
        )
        await asyncio.to_thread(runtime.stopping.wait, 30)
        assert (await sim.status(handle)).phase == "Resizing"  # the checkpoint is under way
        await handle.cancel()
        runtime.go.set()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        await record_history(handle, "cancel")
        status = await sim.status(handle)
    assert status.phase == "Cancelled"
    assert sim.cloud.running() == []
    assert sim.runtime.running_generations(handle.id) == []


class SlowDescribeCloud(SimulatedCloud):
    """Describing nodes takes until the test says so: a capacity check is caught mid-call."""

    def __init__(self) -> None:
        super().__init__()
        self.describing = threading.Event()
        self.go = threading.Event()

    @activity.defn(name=contract.DESCRIBE_NODES)
    def describe_nodes(self, req: DescribeRequest) -> list[NodeInfo]:
        if req.node_ids:  # the periodic check, not teardown's search by tag
            self.describing.set()
            while not self.go.wait(1):
                activity.heartbeat()
        return super().describe_nodes(req)


async def test_cancel_during_a_call_whose_failure_is_tolerated(
    dev_env: WorkflowEnvironment,
) -> None:
    """A failed capacity check is shrugged off (a flaky API changes nothing), but a check
    cut short because the job is being cancelled is the cancellation: the job tears down."""
    cloud = SlowDescribeCloud()
    async with simulated(dev_env.client, cloud=cloud, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec(total_steps=10**6))
        await until(sim, handle, running_at(4))
        await asyncio.to_thread(cloud.describing.wait, 30)
        await handle.cancel()
        cloud.go.set()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
        status = await sim.status(handle)
    assert status.phase == "Cancelled"
    assert sim.cloud.running() == []


async def test_duplicate_unknown_and_out_of_order_signals(dev_env: WorkflowEnvironment) -> None:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec(total_steps=1200))
        victim = members(await until(sim, handle, running_at(4)))[1]
        deadline = in_seconds(120)
        for _ in range(10):
            await handle.signal(
                "reclaim", {"node_id": victim, "deadline": deadline, "event_id": "same"}
            )
        await handle.signal(
            "node_lost", {"node_id": victim, "event_id": "later"}
        )  # after the notice
        await handle.signal(
            "reclaim", {"node_id": "i-unknown", "deadline": deadline, "event_id": "u"}
        )
        await handle.signal("node_lost", {"node_id": "i-unknown", "event_id": None})
        second = members(await until(sim, handle, running_at(4, generation=3)))[2]
        await handle.signal("node_lost", {"node_id": second, "event_id": "gone-first"})
        await handle.signal(  # the notice arrives after the loss
            "reclaim", {"node_id": second, "deadline": in_seconds(120), "event_id": "late"}
        )
        result = await handle.result()
    # One membership change per real loss: the notice shrinks at once then grows back; the
    # loss without notice restarts on the replacement if it is ready within
    # faulty_scale_down_timeout_s, else smaller and grows back.
    assert sizes(result)[:3] == [4, 3, 4] and sizes(result)[3:] in ([4], [3, 4])
    assert result.reclaims == 2


async def test_invalid_spec_fails_at_once_with_field_message(dev_env: WorkflowEnvironment) -> None:
    async with simulated(dev_env.client) as sim:
        handle = await sim.start(fast_spec(elastic={"min_nodes": 5}))
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec"
    assert "elastic: min_nodes (5) > max_nodes (4)" in cause.message


async def test_duplicate_running_name_is_rejected(dev_env: WorkflowEnvironment) -> None:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        spec = fast_spec()
        handle = await sim.start(spec)
        with pytest.raises(WorkflowAlreadyStartedError):
            await sim.start(spec)
        await handle.cancel()
