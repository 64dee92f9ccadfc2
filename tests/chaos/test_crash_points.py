"""Crash-point sweep: SIGKILL the worker at each point of a reclaim-resize-replace cycle.

Each point runs its own job (2 nodes x 2 ranks, one node reclaimed with notice, a replacement
joins) on its own task queue with a worker that kills itself there; a fresh worker takes over.
The points run concurrently to fit CI; CHAOS_FULL=1 adds more.
"""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from spotrain.workflows.job.state import JobResult
from tests.chaos.harness import (
    CYCLE_PLANS,
    FULL,
    ChaosEnv,
    Figures,
    WorkerProcess,
    check_job,
    member,
    reclaim,
    replaced,
    running,
    supervise,
    until,
)
from tests.jobs import record_history

POINTS = [
    "before:stop_generation",
    "elastic-event-raised",
    "after:stop_generation",
    "before:release_nodes",
    "api:TerminateInstances",
    "after:release_nodes",
    "before:find_offers",
    "before:launch_node",
    "api:RunInstances",
    "after:launch_node",
    "before:start_generation",
    "some-ranks-started",
    "after:start_generation",
    "before:watch_generation",
    "after:describe_nodes",
    "before:cleanup_job",
]
FULL_POINTS = [
    "after:find_offers",
    "after:watch_generation",
    "before:describe_nodes",
    "api:DescribeInstances",
    "after:cleanup_job",
]
CONCURRENT = 16
# All the points' jobs come up at once (16 workers, 32 nodes on moto, 64 ranks) on a 2-core
# machine that CI shares with other tests. Beside 5 CPU hogs they reach full size in 25-57 s
# here. The slow set-ups seen before (231 s, and past 300 s in CI) came from moto's cost of
# listing instances, quadratic in all the session's earlier ones: scenarios now start with
# those forgotten (tests/moto_ec2.py), and the limit stays generous.
START_TIMEOUT_S = 300
RECORDED = {"after:launch_node", "elastic-event-raised"}  # histories for the replay test


async def crash_cycle(env: ChaosEnv, point: str, limit: asyncio.Semaphore) -> Figures:
    """One job through the cycle with the worker killed at `point`; its figures."""
    job = "crash-" + re.sub(r"[^a-z0-9]+", "-", point.lower()).strip("-")
    async with limit:
        worker = WorkerProcess(env, job, crash=point)
        handle = await env.start(env.spec(job))
        before = await until(env, handle, running(4, min_step=20), START_TIMEOUT_S)
        env.arm_file(job).touch()
        victim = member(before, 1)
        await reclaim(handle, victim, f"{job}-notice")
        result, deaths = await supervise(env, handle, worker, replaced(victim))
    if point in RECORDED:
        await record_history(handle, f"chaos_{job.replace('-', '_')}")
    fig = check_job(env, job, plans=CYCLE_PLANS, sizes_from=before.generation)
    fig.scenario = f"crash at {point}"
    fired = env.fired_file(job)
    if not fired.exists() or deaths != 1:
        fig.problems.append(f"crash point not reached ({deaths} worker deaths)")
    if not isinstance(result, JobResult) or result.phase != "Succeeded":
        fig.problems.append(f"job ended with {result!r}")
    elif fig.problems:  # the job's own account of its generations says why
        fig.problems += [f"{e.generation} {e.event}: {e.detail}" for e in result.timeline]
    fig.survived = int(not fig.problems)
    return fig


# The set-up alone may take START_TIMEOUT_S, then a reclaim cycle with a worker's death and
# restart: pytest's default 300 s for the whole test ended it beside two busy loops in CI.
# The points in two halves, every other one: each half's eight jobs at once took about half
# of the whole sweep's 127 s (a full suite on 2 cores), and no test of the suite runs over 90 s.
@pytest.mark.timeout(START_TIMEOUT_S + 600)
@pytest.mark.parametrize("half", [0, 1])
async def test_worker_killed_at_every_point_of_a_reclaim_cycle(
    chaos_env: ChaosEnv, half: int
) -> None:
    limit = asyncio.Semaphore(CONCURRENT)
    only = os.environ.get("CHAOS_POINTS")  # a comma-separated subset, to chase one failure
    points = (only.split(",") if only else POINTS + (FULL_POINTS if FULL else []))[half::2]
    figures = await asyncio.gather(*(crash_cycle(chaos_env, p, limit) for p in points))
    for fig in figures:
        fig.write()
    failed = {f.scenario: f.problems for f in figures if f.problems}
    assert not failed, failed
    assert len(figures) >= (0 if only else 8)
