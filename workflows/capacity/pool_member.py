"""A TrainingJob as a member of its capacity pool: it applies the pool's grants and reports
what it claims and holds. The rules are `job_planner.grant_plan` and `pool_report`; this only
sequences them. Call from workflow code only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.capacity.fleet import Fleet
    from spotrain.workflows.capacity.pool import pool_workflow_id
    from spotrain.workflows.contract import PoolGrant
    from spotrain.workflows.job import job_planner
    from spotrain.workflows.job.state import JobFailed, JobState, NodeRecord, Phase


class PoolMember:
    def __init__(
        self,
        s: JobState,
        fleet: Fleet,
        set_phase: Callable[[Phase], None],
        release_everything: Callable[[str, str, str], Awaitable[None]],
        remove: Callable[[list[NodeRecord], str, str], Awaitable[None]],
    ) -> None:
        self.s, self.fleet, self.set_phase = s, fleet, set_phase
        self.release_everything, self.remove = release_everything, remove
        self._reported: dict[str, Any] | None = None  # the figures last sent

    async def on_grant(self, grant: PoolGrant) -> None:
        """Apply the pool's grant: fail if it can never fit, pause whole below the min, shrink
        gracefully, or order more (`job_planner.grant_plan` says which)."""
        s = self.s
        pool = s.spec.pool.name if s.spec.pool else ""
        if grant.refused:
            raise JobFailed(f"capacity pool {pool!r} cannot run this job: {grant.refused}")
        plan = job_planner.grant_plan(s, grant)
        s.grant, s.target = grant, plan.target
        if plan.preempt:
            if any(n.alive for n in s.nodes):
                s.record(workflow.now(), "preempted", f"by pool {pool}: queued until it has room")
                await self.release_everything(
                    "preempted", f"pool {pool} needs the nodes", "preempted by the pool"
                )
            self.set_phase(Phase.QUEUED)
            return
        if plan.admit:
            s.record(workflow.now(), "admitted", f"by pool {pool}: {grant.nodes} node(s)")
            s.owed = plan.owed
            self.set_phase(Phase.PENDING)
        if plan.victims:
            s.record(
                workflow.now(),
                "pool shrinks the job",
                f"to {grant.nodes} node(s) ({grant.on_demand} on-demand) for pool {pool}",
            )
            await self.remove(
                plan.victims, f"pool {pool} shrinks the job", "given back to the pool"
            )
        await self.fleet.reconcile()

    async def report(self) -> None:
        """Tell the pool what the job claims and holds, whenever that changed."""
        s = self.s
        if s.spec.pool is None:
            return
        report = job_planner.pool_report(s)
        figures = report.model_dump(exclude={"seq"})
        if figures == self._reported:
            return
        s.pool_reports += 1
        report.seq = s.pool_reports
        pool = s.spec.pool.name
        try:
            await workflow.get_external_workflow_handle(pool_workflow_id(pool)).signal(
                "report", report
            )
        except ApplicationError as err:
            if report.claiming:
                raise JobFailed(
                    f"capacity pool {pool!r} cannot be reached ({err.message}): "
                    f"create it with `spotrain pool create {pool}`"
                ) from None
        self._reported = figures
