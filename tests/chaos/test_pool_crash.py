"""A capacity pool's controller SIGKILLed in the middle of a soft preemption.

Two jobs share a pool of 2 nodes on one task queue (the pool's too), served by a worker that
kills itself just before the low-priority job's checkpoint-and-shrink runs. A fresh worker
takes over from Temporal's history: the shrink completes gracefully, the high-priority job
runs, the low one grows back, and at no sampled moment do the jobs hold more than the pool's
quota in EC2 (moto), nor does the pool's own ledger ever count more.
"""

from __future__ import annotations

import asyncio
import time

from spotrain.activities.ec2_ownership import LIVE_STATES
from spotrain.workflows.capacity.pool import PoolConfig, PoolStatus, pool_workflow_id
from spotrain.workflows.job.state import JobResult
from tests.chaos.harness import (
    ChaosEnv,
    Figures,
    WorkerProcess,
    check_job,
    fail_orphaned_attempts,
    job_instances,
    running,
    status,
    until,
)

QUEUE = "pool-crash"
POOL = "chaos"
QUOTA = 2


def live_instances(*jobs: str) -> int:
    return sum(state in LIVE_STATES for job in jobs for _, _, state in job_instances(job))


async def test_pool_controller_killed_mid_preemption_loses_nothing(chaos_env: ChaosEnv) -> None:
    env = chaos_env
    low, high = "pool-low", "pool-high"
    worker = WorkerProcess(env, QUEUE, crash="before:stop_generation")
    pool = await env.client.start_workflow(
        "CapacityPool",
        PoolConfig(name=POOL, max_nodes=QUOTA),
        id=pool_workflow_id(POOL),
        task_queue=QUEUE,
    )
    low_spec = env.spec(low) | {"pool": {"name": POOL}}
    low_handle = await env.start(low_spec, QUEUE)
    before = await until(env, low_handle, running(4, min_step=20))  # 2 nodes x 2 ranks
    env.arm_file(QUEUE).touch()  # the next stop is the shrink the pool asks for
    high_handle = await env.start(env.spec(high) | {"pool": {"name": POOL}, "priority": 5}, QUEUE)
    (env.records(high) / "go").touch()

    outcome = asyncio.ensure_future(
        asyncio.gather(low_handle.result(), high_handle.result(), return_exceptions=True)
    )
    deaths, most_held = 0, 0
    deadline = time.monotonic() + 240
    high_done = asyncio.ensure_future(high_handle.result())
    try:
        while not outcome.done():
            most_held = max(most_held, live_instances(low, high))
            # The low job trains on once it grew back after the high one left the pool.
            s = await status(low_handle) if high_done.done() else None
            if s is not None and running(4)(s) and s.generation > before.generation + 1:
                (env.records(low) / "go").touch()
            if worker.died():
                deaths += 1
                for job in (low, high):
                    await fail_orphaned_attempts(env.client, job)
                worker = WorkerProcess(env, QUEUE)
            assert time.monotonic() < deadline, f"no result in time (see {env.root})"
            await asyncio.wait([outcome], timeout=0.2)
        final = await pool.query("status", result_type=PoolStatus)
    finally:
        worker.stop()
        await pool.terminate("test over")
    results = outcome.result()
    assert all(isinstance(r, JobResult) and r.phase == "Succeeded" for r in results), results
    assert env.fired_file(QUEUE).read_text() == "before:stop_generation" and deaths == 1
    low_fig = check_job(env, low, plans=[[4, 2, 4]], sizes_from=before.generation)
    high_fig = check_job(env, high)
    fig = Figures(
        "pool controller SIGKILL mid-preemption",
        duplicates=low_fig.duplicates + high_fig.duplicates,
        leaks=low_fig.leaks + high_fig.leaks,
        lost_steps=low_fig.lost_steps + high_fig.lost_steps,
        problems=low_fig.problems + high_fig.problems,
    )
    if most_held > QUOTA or final.peak["nodes"] > QUOTA:
        fig.problems.append(f"over the quota: {most_held} held, {final.peak} in the ledger")
    if results[0].steps_lost:  # the shrink came after a checkpoint
        fig.problems.append(f"the shrunk job lost {results[0].steps_lost} steps")
    if final.jobs:
        fig.problems.append(f"still in the pool: {final.jobs}")
    fig.survived = int(not fig.problems)
    fig.write()
    assert not fig.problems, fig
