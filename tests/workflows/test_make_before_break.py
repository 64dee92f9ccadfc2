"""Make-before-break on the time-skipping server (and once on the dev server, recorded for the
replay tests), with the simulated cloud and runtime: an early warning or a reclaim notice costs
one resize (N -> N onto a replacement ordered ahead) instead of two (a shrink, then a growth),
and a replacement that is not ready in time falls back to the shrink."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedCloud
from spotrain.workflows import contract
from spotrain.workflows.contract import Offer
from spotrain.workflows.job.state import JobResult, JobStatus
from spotrain.workflows.spec import SpotPolicy
from tests.jobs import (
    Sim,
    fast_runtime,
    fast_spec,
    job_spec,
    record_history,
    running_at,
    simulated,
    skip,
    until,
)
from tests.jobs import sizes as world_sizes

pytestmark = pytest.mark.slow

Handle = WorkflowHandle[Any, Any]
MBB = {"early_warning": "make_before_break", "reclaim_notice": "make_before_break"}
ALWAYS = {"warning_rule": "always"}  # the swap's mechanics, whatever a warning is worth
SURGE = {"max_surge_nodes": 1}


def ranked(status: JobStatus) -> list[str]:
    members = sorted((n for n in status.nodes if n.rank is not None), key=lambda n: n.rank or 0)
    return [n.node_id or "" for n in members]


def events(result: JobResult | JobStatus, name: str) -> list[str]:
    return [e.detail for e in result.timeline if e.event == name]


async def warn(
    env: WorkflowEnvironment, handle: Handle, node_id: str, kind: str, notice_s: float | None
) -> None:
    """A rebalance recommendation (no deadline) or a reclaim notice `notice_s` ahead."""
    signal: dict[str, Any] = {"node_id": node_id, "event_id": f"{kind}-{node_id}", "kind": kind}
    if notice_s is not None:
        deadline: datetime = await env.get_current_time() + timedelta(seconds=notice_s)
        signal["deadline"] = deadline.isoformat()
    await handle.signal("reclaim", signal)


async def run_one_reclaim(
    env: WorkflowEnvironment, sim: Sim, elastic: dict[str, Any], kind: str
) -> tuple[JobResult, str]:
    """A 2.5 h job at 4 nodes; 20 min in, one node is warned (`kind`) and, for a notice,
    taken by the cloud 120 s later. Returns the result and the warned node."""
    handle = await sim.start(job_spec(elastic=elastic))
    await skip(env, timedelta(minutes=20))
    victim = ranked(await sim.status(handle))[1]
    await warn(env, handle, victim, kind, 120 if kind == "interruption" else None)
    await skip(env, timedelta(seconds=120))
    if sim.cloud.nodes[victim].info.state != "gone":
        sim.cloud.reclaim(victim)
        await handle.signal("node_lost", {"node_id": victim, "event_id": f"lost-{victim}"})
    return await handle.result(), victim


@pytest.mark.parametrize("kind", ["interruption", "rebalance"])
async def test_one_resize_per_warned_node_with_make_before_break_two_without(
    ts_env: WorkflowEnvironment, kind: str
) -> None:
    without = {"act_on_rebalance": True}  # today: a warning is a notice, both shrink
    async with simulated(ts_env.client) as sim:
        before, _ = await run_one_reclaim(ts_env, sim, without, kind)
    async with simulated(ts_env.client) as sim:
        after, victim = await run_one_reclaim(ts_env, sim, MBB | SURGE | ALWAYS, kind)
        released = sim.cloud.nodes[victim].info.reason
    assert (world_sizes(before), before.resizes) == ([4, 3, 4], 2)
    assert (world_sizes(after), after.resizes, after.swapped) == ([4, 4], 1, 1)
    assert events(after, "replacement ordered ahead") == [f"replacement ordered ahead of {victim}"]
    [swapped] = events(after, "swapped in one resize")
    assert swapped.startswith(f"{victim} -> ")
    assert released == "terminated"  # the job released it before the cloud took it
    assert after.steps_done == before.steps_done == 36_000 and after.steps_lost == 0
    # Make before break: the replacement was ready (and billed) before the warned node went.
    replacement = swapped.split(" -> ")[1]
    order = [(e.event, e.detail) for e in after.timeline]
    ready = next(i for i, (e, d) in enumerate(order) if e == "node ready" and replacement in d)
    gone = next(i for i, (e, d) in enumerate(order) if e == "node released" and victim in d)
    assert ready < gone
    assert after.reclaims == (1 if kind == "interruption" else 0)


class OffersWithoutCapacity(SimulatedCloud):
    """Offers every pool (price history says nothing about capacity), so the replacement is
    ordered; its launch then fails while capacity is short."""

    @activity.defn(name=contract.FIND_OFFERS)
    def find_offers(self, policy: SpotPolicy) -> list[Offer]:
        return [Offer(instance_type="p3.2xlarge", zone=z, price=0.9) for z in self.zones]


@pytest.mark.parametrize(
    ("cloud", "why"),
    [
        (OffersWithoutCapacity, "replacement late"),  # ordered, not ready by deadline - p99
        (SimulatedCloud, "no replacement to be had"),  # nothing offered: shrink at once
    ],
)
async def test_a_notice_without_a_replacement_in_time_shrinks_and_grows_back_later(
    ts_env: WorkflowEnvironment, cloud: type[SimulatedCloud], why: str
) -> None:
    """No spot anywhere for 10 minutes after the notice: the swap cannot happen by the
    deadline minus the checkpoint time, so the job shrinks as before (checkpointing within
    the notice), then grows when spot returns."""
    t0: list[datetime] = []

    def capacity(_type: str, _zone: str, when: datetime) -> int:
        short = t0 and t0[0] <= when < t0[0] + timedelta(minutes=10)
        return 0 if short else 1000

    spec = job_spec(elastic=MBB | SURGE, on_demand={"fallback": False})
    async with simulated(ts_env.client, cloud=cloud(capacity=capacity)) as sim:
        handle = await sim.start(spec)
        await skip(ts_env, timedelta(minutes=20))
        victim = ranked(await sim.status(handle))[1]
        t0.append(await ts_env.get_current_time())
        await warn(ts_env, handle, victim, "interruption", 120)
        await skip(ts_env, timedelta(seconds=120))
        sim.cloud.reclaim(victim)
        await handle.signal("node_lost", {"node_id": victim, "event_id": "lost"})
        result = await handle.result()
    assert world_sizes(result) == [4, 3, 4] and result.swapped == 0
    assert len(events(result, why)) == 1 and events(result, why)[0].startswith(victim)
    # The shrink checkpointed within the notice, before the cloud took the node: nothing lost.
    assert events(result, "generation checkpointed")[0].startswith(f"reclaim notice for {victim}")
    assert events(result, "generation stopped") == []
    assert result.steps_lost == 0 and result.reclaims == 1


async def test_no_room_for_the_overlap_at_max_nodes_without_surge(
    ts_env: WorkflowEnvironment,
) -> None:
    """At max_nodes with max_surge_nodes 0, a warning orders nothing: training goes on at 4,
    and the status says why."""
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(job_spec(elastic=MBB | ALWAYS))
        await skip(ts_env, timedelta(minutes=20))
        victim = ranked(await sim.status(handle))[0]
        await warn(ts_env, handle, victim, "rebalance", None)
        await skip(ts_env, timedelta(minutes=5))
        status = await sim.status(handle)
        await handle.cancel()
    assert status.world_size == 4 and status.resizes == 0
    assert events(status, "no room for a replacement yet") == [
        f"{victim}: holding 4 node(s) already"
    ]
    assert len(sim.cloud.launches) == 4


async def test_make_before_break_swap_on_the_dev_server(dev_env: WorkflowEnvironment) -> None:
    """The swap in real time, crossing continue-as-new; its history is replayed in CI."""
    spec = fast_spec(elastic=MBB | SURGE | ALWAYS)
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(spec)
        before = await until(sim, handle, lambda s: running_at(4)(s) and s.step > 50)
        victim = ranked(before)[2]
        await warn(dev_env, handle, victim, "rebalance", None)
        swapped = await until(sim, handle, lambda s: s.swapped == 1 and running_at(4)(s))
        result = await handle.result()
        await record_history(handle, "make_before_break_swap")
    assert victim not in ranked(swapped)
    assert world_sizes(result) == [4, 4] and result.resizes == 1
    assert result.steps_done == 600 and result.steps_lost == 0
    assert sim.cloud.running() == []
