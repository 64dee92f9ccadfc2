"""Deadlines: spotrain's own deadline policy (the job spec's `deadline`, decided in
`workflows/policies/deadline.py`) against the benchmark's earlier greedy controller, on the
same trace and work, over a sweep of deadlines (multiples of the all-on-demand time).

    .venv/bin/python -m bench.goodput --deadline-factors 1.1,1.25,1.5,2 [...]

Both run the real TrainingJob workflow on the time-skipping server (see bench/goodput/).
"""

from __future__ import annotations

import statistics
import time
import uuid
from dataclasses import replace
from typing import Any

from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimJob
from spotrain.workflows.job.state import JobStatus

from . import Row, RunFn, Setup, job_spec, new_run, on_fresh_server, spotrain

SWEEP_COLUMNS = [
    "factor",
    "deadline_h",
    "policy",
    "wall_h",
    "met",
    "cost_vs_on_demand",
    "cost_vs_greedy",
    "retries",
]


def deadline_runs(setup: Setup) -> list[tuple[str, RunFn]]:
    """spotrain's own deadline policy, and the earlier greedy controller beside it."""
    policy = setup.deadline_policy()
    return [
        ("spotrain deadline", lambda env: spotrain(env, setup, "spotrain deadline", policy)),
        ("greedy controller", lambda env: greedy_controller(env, setup)),
    ]


async def greedy_controller(env: WorkflowEnvironment, setup: Setup) -> Row:
    """The benchmark's earlier greedy "Can't Be Late", kept to compare spotrain's own
    deadline policy against: elastic on spot while on-demand could still finish by the
    deadline from here; then pause (checkpoint), and finish with an all-on-demand job that
    resumes from the same checkpoint, driven from outside: reclaim notices (a checkpoint),
    cancel, and a second job on the same checkpoint."""
    began = time.monotonic()
    margin = setup.tick_s + 60 + setup.restart_cost_s  # one check late, grace, start-up
    od_rate = setup.steps_per_hour(setup.max_nodes) / 3600
    async with new_run(env, setup) as run:
        name = f"bench-{uuid.uuid4().hex[:8]}"
        spot = await run.start(job_spec(setup, name))

        async def check(offset: float) -> float | None:
            status = await spot.query("status", result_type=JobStatus)
            switch_at = setup.deadline_s() - margin - (setup.total_steps - status.step) / od_rate
            return None if offset >= switch_at else max(switch_at, offset + setup.tick_s)

        if await run.drive(spot, check):
            totals, wall_h = await run.finish(spot)
        else:
            await run.drain(spot)
            await spot.cancel()
            while (await spot.describe()).status == WorkflowExecutionStatus.RUNNING:
                # (skipping: the job's cleanup waits for launches whose nodes still boot)
                await run.sleep_until(await run.elapsed_s() + 5)
            first = await spot.query("status", result_type=JobStatus)
            resumed = SimJob(checkpoint_step=run.runtime.jobs[name].checkpoint_step)
            run.runtime.jobs[f"{name}-od"] = resumed  # the same checkpoint location
            spec = job_spec(setup, f"{name}-od", fallback=True)
            spec["spot"]["enabled"] = False
            totals, wall_h = await run.finish(await run.start(spec))
            totals.node_hours["spot"] = first.cost_so_far / setup.spot_price  # all spot
            totals.steps_lost += first.steps_lost
            totals.resizes += first.resizes + 1
            totals.reclaims += first.reclaims
    return run.row("greedy controller", wall_h, totals, began)


async def sweep(setup: Setup, factors: list[float]) -> dict[str, Any]:
    """Each policy at each deadline (factor x the all-on-demand time): whether it met it, and
    its cost against all on-demand and against the greedy controller at the same deadline."""
    rows: list[dict[str, Any]] = []
    abandoned: list[float] = []
    for factor in factors:
        at = replace(setup, deadline_h=factor * setup.on_demand_hours())
        results = {p: await on_fresh_server(at, p, run) for p, run in deadline_runs(at)}
        reports = {p: r.report(at, 1.0) for p, r in results.items() if r is not None}
        if "greedy controller" not in reports:  # wedged every time: nothing to compare with
            abandoned.append(factor)
            continue
        for policy, report in reports.items():
            rows.append(
                {
                    "factor": factor,
                    "deadline_h": at.deadline_s() / 3600,
                    "policy": policy,
                    "wall_h": report["wall_h"],
                    "met": report["deadline_hit"],
                    "cost_vs_on_demand": report["cost_vs_on_demand"],
                    "cost_vs_greedy": report["cost"] / reports["greedy controller"]["cost"],
                    "retries": report["retries"],
                }
            )
    summary = {
        policy: {
            "met": sum(r["met"] for r in mine) / len(mine),
            "cost_vs_on_demand_median": statistics.median(r["cost_vs_on_demand"] for r in mine),
            "cost_vs_greedy_median": statistics.median(r["cost_vs_greedy"] for r in mine),
        }
        for policy in ("spotrain deadline", "greedy controller")
        if (mine := [r for r in rows if r["policy"] == policy])
    }
    return {"rows": rows, "summary": summary, "abandoned_factors": abandoned}
