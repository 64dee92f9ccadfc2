"""Nodes leaving a TrainingJob: a reclaim notice (checkpoint, shrink onto the others), a node
already lost (stop at once), and the booking of a gone node with its replacement per the
reclaim policy. Sequencing only: the decisions are `job_planner`'s. Call from workflow code
only.
"""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.capacity.fleet import Fleet
    from spotrain.workflows.job import events, job_planner
    from spotrain.workflows.job.ranks import Ranks
    from spotrain.workflows.job.state import JobState, NodeRecord, NodeState
    from spotrain.workflows.policies.make_before_break_hooks import Swapper


class Departures:
    def __init__(self, state: JobState, fleet: Fleet, ranks: Ranks, swapper: Swapper) -> None:
        self.s, self.fleet, self.ranks, self.swapper = state, fleet, ranks, swapper

    async def on_reclaim(self, event: events.Reclaim) -> None:
        """A notice with time left: checkpoint, shrink onto the survivors, replace per policy."""
        s = self.s
        if await self.swapper.on_notice(event):
            return  # make-before-break: a replacement first, one resize later
        plan = job_planner.reclaim_plan(s, event, workflow.now())
        node = s.node_by_id(event.node_id)
        if node is None or plan.action == "ignore":
            return  # unknown or already gone: nothing to do, never a crash
        if plan.action == "ignore rebalance":
            s.record(workflow.now(), "rebalance recommendation ignored", node.node_id or "")
        elif plan.action == "ignore scheduled":
            s.record(workflow.now(), "scheduled change ignored", node.node_id or "")
        elif plan.action == "gone":
            await self.gone(node, "reclaimed")
        elif plan.action == "lost":
            await self.on_lost(node, "reclaimed")
        else:  # every member reclaimed by now leaves in the same resize
            for absorbed in plan.absorbed:
                s.inbox.remove(absorbed)
            s.resizes += 1
            names = ", ".join(n.node_id or "" for n in plan.leaving)
            await self.ranks.stop(
                graceful=True,
                grace=plan.grace,
                lost=[],
                reason=f"reclaim notice for {names}",
                notice_at=workflow.now(),
                # (every member leaving: nobody holds the state on, so it is checkpointed
                # before the ranks stop, even with live resize)
                resize=len(plan.leaving) < len(s.members),
            )
            for n in plan.leaving:
                await self.gone(n, "reclaimed")

    async def on_lost(self, node: NodeRecord, reason: str) -> None:
        """A node already gone: stop at once, resume from the last periodic checkpoint."""
        s = self.s
        if node.slot in s.members and s.running:
            s.resizes += 1
            s.losses += 1
            await self.ranks.stop(
                graceful=False,
                grace=0,
                lost=[node.node_id or ""],
                reason=f"{node.node_id} {reason}",
                resize=True,
            )
            s.hold_until = job_planner.replacement_hold(s, workflow.now())
        await self.gone(node, reason)

    async def gone(self, node: NodeRecord, reason: str) -> None:
        """Book a lost node and order its replacement per the reclaim policy."""
        s = self.s
        if not node.alive:
            return
        after = job_planner.after_loss(s, node, reason)
        s.reclaims += after.reclaim
        await self.fleet.release([node], reason, state=NodeState.GONE)
        s.owed += after.owe
        s.target = after.target
        await self.fleet.reconcile()
