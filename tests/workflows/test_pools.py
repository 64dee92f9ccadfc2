"""Capacity pools on the real Temporal dev server, with the simulated cloud and runtime at
seconds instead of minutes: jobs sharing a quota, soft preemption by a higher priority, FIFO
within a priority, progress-first growth, budgets. The quota is checked at every instant: the
simulated cloud logs every launch and release in order, and the most the pool's jobs ever
held at once is computed from that log."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from spotrain.workflows.capacity.pool import PoolStatus
from spotrain.workflows.job.state import TimelineEntry
from tests.jobs import (
    fast_runtime,
    fast_spec,
    polled,
    record_history,
    running_at,
    simulated,
    sizes,
    until,
)

pytestmark = pytest.mark.slow

Handle = WorkflowHandle[Any, Any]


def runtime() -> Any:
    """20 steps per second per node."""
    return fast_runtime(steps_per_hour=lambda world: 72_000.0 * world)


def pooled(pool: str, steps: int, lo: int, hi: int, priority: int = 0, **pool_opts: Any) -> dict:
    return fast_spec(
        total_steps=steps,
        priority=priority,
        pool={"name": pool, **pool_opts},
        elastic={"min_nodes": lo, "max_nodes": hi},
    )


async def until_pool(
    pool: Handle, check: Callable[[PoolStatus], bool], timeout: float = 60
) -> PoolStatus:
    return await polled(lambda: pool.query("status", result_type=PoolStatus), check, timeout)


def state(status: PoolStatus, job: str) -> str | None:
    return next((j.state for j in status.jobs if j.job == job), None)


def events(status: PoolStatus, job: str) -> list[str]:
    """The pool's timeline for one job: claim, admit, shrink, grow, preempt, left."""
    return [e.event for e in status.timeline if e.detail == job or e.detail.startswith(f"{job}:")]


def in_order(status: PoolStatus, *wanted: tuple[str, str]) -> bool:
    """Whether the pool's timeline has each (event, job), one after the other."""
    entries = iter(status.timeline)
    return all(
        any(
            e.event == event and (e.detail == job or e.detail.startswith(f"{job}:"))
            for e in entries
        )
        for event, job in wanted
    )


def new_pool() -> str:
    return f"pool-{uuid.uuid4().hex[:6]}"


async def test_high_priority_arrival_shrinks_gracefully_and_growth_goes_progress_first(
    dev_env: WorkflowEnvironment,
) -> None:
    name = new_pool()
    async with simulated(dev_env.client, runtime=runtime()) as sim:
        pool = await sim.start_pool(name=name, max_nodes=6)
        # (quick's 600 steps left at 40 a second must outlast high's admission beside two busy
        # loops: with 300 left, quick once ended first, and the freed nodes went to slow)
        slow = await sim.start(pooled(name, 3200, 2, 4))  # first in, slow to progress
        await until(sim, slow, running_at(4))
        quick = await sim.start(pooled(name, 1000, 2, 4))  # a larger share of its work done
        await until(sim, quick, running_at(2))
        await until(sim, quick, lambda s: s.step >= 400)  # 40% of quick, ~25% of slow
        high = await sim.start(pooled(name, 100, 2, 2, priority=10))
        results = await asyncio.gather(*(h.result() for h in (slow, quick, high)))
        final = await until_pool(pool, lambda p: not p.jobs)
        await record_history(slow, "pool_shrunk_job")
        await record_history(pool, "pool_entity")
    jobs = {slow.id, quick.id, high.id}
    assert [r.phase for r in results] == ["Succeeded"] * 3
    assert sim.cloud.peak(jobs) <= 6 and final.peak["nodes"] <= 6  # never above the quota
    assert sim.cloud.running() == []
    slow_result = results[0]
    assert slow_result.steps_lost == 0  # shrunk after a checkpoint, never killed
    assert sizes(slow_result)[:2] == [4, 2] and sizes(slow_result)[-1] == 4  # grew back
    stops = [e.event for e in slow_result.timeline if e.event.startswith("generation ")]
    assert "generation stopped" not in stops  # every stop was a checkpoint
    # The nodes were handed over, not added; then the freed ones went to the job further along.
    assert in_order(final, ("shrink", slow.id), ("admit", high.id), ("left", high.id))
    assert in_order(final, ("left", high.id), ("grow", quick.id), ("grow", slow.id))
    assert "preempt" not in events(final, slow.id)


async def test_fifo_within_a_priority_a_small_job_does_not_jump_the_queue(
    dev_env: WorkflowEnvironment,
) -> None:
    name = new_pool()
    async with simulated(dev_env.client, runtime=runtime()) as sim:
        pool = await sim.start_pool(name=name, max_nodes=5)
        first = await sim.start(pooled(name, 150, 3, 3))
        await until(sim, first, running_at(3))
        big = await sim.start(pooled(name, 160, 4, 4))
        await until_pool(pool, lambda p: state(p, big.id) == "queued")
        small = await sim.start(pooled(name, 40, 2, 2))
        waiting = await until_pool(pool, lambda p: state(p, small.id) == "queued")
        assert waiting.usage["nodes"] == 3  # 2 nodes free, yet the small job waits its turn
        assert (await sim.status(small)).phase == "Queued"
        results = await asyncio.gather(*(h.result() for h in (first, big, small)))
        final = await until_pool(pool, lambda p: not p.jobs)
    assert [r.phase for r in results] == ["Succeeded"] * 3
    assert sim.cloud.peak({first.id, big.id, small.id}) <= 5
    assert in_order(final, ("admit", big.id), ("left", big.id), ("admit", small.id))


async def test_budget_cap_stops_growth(dev_env: WorkflowEnvironment) -> None:
    name = new_pool()
    async with simulated(dev_env.client, runtime=runtime()) as sim:
        # Spot nodes cost $0.97/h: $2.5/h for the team buys 2 of the 4 the job would take.
        pool = await sim.start_pool(name=name, max_nodes=8, team_budgets={"vision": 2.5})
        job = await sim.start(pooled(name, 200, 2, 4, team="vision"))
        result = await job.result()
        final = await until_pool(pool, lambda p: not p.jobs)
    assert result.phase == "Succeeded"
    assert set(sizes(result)) == {2} and sim.cloud.peak({job.id}) == 2
    assert final.peak["cost_per_hour"] <= 2.5


async def test_job_naming_a_missing_pool_fails_with_the_fix(dev_env: WorkflowEnvironment) -> None:
    async with simulated(dev_env.client, runtime=runtime()) as sim:
        handle = await sim.start(pooled("no-such-pool", 100, 2, 2))
        try:
            await handle.result()
        except WorkflowFailureError as err:
            message = str(err.cause)
        else:
            raise AssertionError("a job in a missing pool must fail")
    assert "no-such-pool" in message and "spotrain pool create" in message
    assert sim.cloud.launches == []


async def test_job_that_can_never_fit_is_refused(dev_env: WorkflowEnvironment) -> None:
    name = new_pool()
    async with simulated(dev_env.client, runtime=runtime()) as sim:
        await sim.start_pool(name=name, max_nodes=2)
        handle = await sim.start(pooled(name, 100, 3, 4))
        try:
            await handle.result()
        except WorkflowFailureError as err:
            message = str(err.cause)
        else:
            raise AssertionError("a job larger than the pool must fail")
    assert "needs 3 node(s) at its min; the pool's quota is 2" in message


async def test_preemptible_job_at_its_min_is_paused_whole_and_resumes(
    dev_env: WorkflowEnvironment,
) -> None:
    name = new_pool()
    async with simulated(dev_env.client, runtime=runtime()) as sim:
        pool = await sim.start_pool(name=name, max_nodes=2)
        low = await sim.start(pooled(name, 200, 2, 2, preemptible=True))
        await until(sim, low, lambda s: running_at(2)(s) and s.step >= 40)
        high = await sim.start(pooled(name, 100, 2, 2, priority=5))
        await until(sim, low, lambda s: s.phase == "Queued" and s.generation >= 1)
        results = await asyncio.gather(low.result(), high.result())
        final = await until_pool(pool, lambda p: not p.jobs)
        await record_history(low, "pool_preempted_job")
    assert [r.phase for r in results] == ["Succeeded"] * 2
    assert results[0].steps_lost == 0  # checkpointed before it gave its nodes back
    assert sim.cloud.peak({low.id, high.id}) <= 2
    assert in_order(
        final, ("preempt", low.id), ("admit", high.id), ("left", high.id), ("admit", low.id)
    )


async def test_shrinking_keeps_the_on_demand_base(dev_env: WorkflowEnvironment) -> None:
    """Base + elastic: the pool takes the elastic spot nodes, never the job's base."""
    name = new_pool()
    async with simulated(dev_env.client, runtime=runtime()) as sim:
        pool = await sim.start_pool(name=name, max_nodes=4)
        low = await sim.start(
            pooled(name, 10**6, 1, 3) | {"on_demand": {"base_nodes": 1, "fallback": False}}
        )
        await until(sim, low, running_at(3))
        high = await sim.start(pooled(name, 100, 3, 3, priority=5))
        await high.result()
        timeline = await low.query("timeline", result_type=list[TimelineEntry])
        await low.cancel()
        ledger = await pool.query("status", result_type=PoolStatus)
    shrunk = [e.detail for e in timeline if e.event == "pool shrinks the job"]
    given_back = [e.detail for e in timeline if "given back to the pool" in e.detail]
    assert shrunk and "to 1 node(s)" in shrunk[0]
    assert len(given_back) == 2 and all(d.startswith("spot ") for d in given_back), given_back
    assert sim.cloud.peak({low.id, high.id}) <= 4
    assert ledger.peak["nodes"] <= 4


async def test_a_terminated_holder_is_struck_off_while_others_queue(
    dev_env: WorkflowEnvironment,
) -> None:
    """Terminate runs no cleanup, so the job never says it left: the pool notices when it
    checks its holders (while someone queues) and hands the share on. (`spotrain gc` reaps
    the nodes the terminated job left.)"""
    name = new_pool()
    async with simulated(dev_env.client, runtime=runtime()) as sim:
        pool = await sim.start_pool(name=name, max_nodes=2, liveness_check_s=1)
        first = await sim.start(pooled(name, 10**6, 2, 2))
        await until(sim, first, running_at(2))
        second = await sim.start(pooled(name, 100, 2, 2))
        await until_pool(pool, lambda p: state(p, second.id) == "queued")
        await first.terminate("gone without cleanup")
        result = await second.result()
        final = await until_pool(pool, lambda p: not p.jobs)
    assert result.phase == "Succeeded"
    assert in_order(final, ("gone", first.id), ("admit", second.id))
