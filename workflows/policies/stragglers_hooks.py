"""A TrainingJob's stragglers, as its workflow flags them after each watch and replaces their
nodes: sequencing only (the decisions are `stragglers.assess`). A node replaced is handled like
a node lost with a planned removal: the generation checkpoints and stops without it, the node
is released, a replacement ordered per the reclaim policy (`job_planner.after_loss`), and the
next generation waits up to `faulty_scale_down_timeout_s` for it. Call from workflow code only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.capacity.fleet import Fleet
    from spotrain.workflows.contract import WatchResult
    from spotrain.workflows.job import job_planner
    from spotrain.workflows.job.state import JobState, NodeRecord
    from spotrain.workflows.policies import stragglers

REASON = "straggler"


class StragglerWatch:
    def __init__(
        self,
        state: JobState,
        fleet: Fleet,
        remove: Callable[[list[NodeRecord], str, str], Awaitable[None]],
    ) -> None:
        self.s, self.fleet, self.remove = state, fleet, remove

    async def on_watch(self, w: WatchResult) -> bool:
        """Flag (timeline, status) and clear the running generation's stragglers; replace the
        nodes of those past their patience, and of a rank that holds up a stalled job (then
        True: no stall fault, the generation is already stopped)."""
        s, now = self.s, workflow.now()
        policy = s.spec.elastic.straggler
        if policy is None or w.outcome != "progress" or not s.running:
            return False
        if not workflow.patched("straggler-replace"):
            return False
        stalled = job_planner.watch_verdict(s, w, now)[0] == "fault"  # (a progress watch)
        found = stragglers.assess(
            policy,
            s.spec.elastic.stall_timeout_s,
            s.generation,
            w.ranks,
            stragglers.rank_nodes(s.member_nodes),
            s.stragglers,
            now,
            job_stalled=stalled,
        )
        for f in found.raised:
            s.record(now, "straggler", f"rank {f.rank} on {f.node_id}: {f.why}")
        for f in found.cleared:
            s.record(now, "straggler cleared", f"rank {f.rank} on {f.node_id}")
        s.stragglers = found.flags
        victims = [n for n in s.member_nodes if n.node_id in found.replace]
        if victims:
            await self._replace(victims)
        return bool(victims)

    async def _replace(self, victims: list[NodeRecord]) -> None:
        s, names = self.s, ", ".join(n.node_id or "" for n in victims)
        s.record(workflow.now(), "straggler replaced", names)
        await self.remove(victims, REASON, REASON)  # checkpoint, stop, release
        for node in victims:
            after = job_planner.after_loss(s, node, REASON)
            s.owed += after.owe
            s.target = after.target
        s.stragglers = []
        s.hold_until = job_planner.replacement_hold(s, workflow.now())
        await self.fleet.reconcile()
