"""A TrainingJob's make-before-break swaps, as its workflow applies them: sequencing only,
the decisions are `make_before_break`'s. Call from workflow code only.

Guarded by `workflow.patched(PATCH)`: only a job whose policy asks for make-before-break
reaches it, and histories from before it replay unchanged.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows import events, make_before_break
    from spotrain.workflows.fleet import Fleet
    from spotrain.workflows.ranks import Ranks
    from spotrain.workflows.state import JobState

PATCH = "make-before-break"


class Swapper:
    def __init__(self, state: JobState, fleet: Fleet, ranks: Ranks) -> None:
        self.s = state
        self.fleet = fleet
        self.ranks = ranks

    async def on_notice(self, event: events.Reclaim) -> bool:
        """Order a replacement ahead of a warned node if the job's policy says so; False: the
        usual reclaim path decides."""
        s = self.s
        plan = make_before_break.on_notice(s, event, workflow.now())
        if plan.action == "pass":
            s.swaps = plan.swaps
            return False
        if not workflow.patched(PATCH):
            return False
        s.swaps = plan.swaps
        if plan.action == "order":
            s.record(workflow.now(), "replacement ordered ahead", plan.detail)
            s.owed += 1  # like any replacement: on-demand if spot is short and policy allows
            await self.fleet.reconcile()
        elif plan.action == "no room":
            s.record(workflow.now(), "no room for a replacement ahead", plan.detail)
        elif plan.action == "deadline":
            s.record(workflow.now(), "warned node has a deadline", plan.detail)
        return True

    def wake(self) -> datetime | None:
        """When an open notice's replacement becomes late (None: no such notice)."""
        return make_before_break.next_step(self.s, workflow.now()).wake if self.s.swaps else None

    async def step(self) -> bool:
        """Swap warned members for ready replacements in one resize (N -> N), or hand notices
        whose replacement is late back to the usual reclaim path (a shrink). True: the
        generation stopped for a swap."""
        s = self.s
        if not s.swaps:
            return False
        now = workflow.now()
        step = make_before_break.next_step(s, now)
        s.swaps = step.swaps
        for late in step.late:
            s.record(now, "replacement late", f"{late.node_id}: shrinking before its deadline")
            s.inbox.insert(0, events.Reclaim(node_id=late.node_id, deadline=late.deadline))
        if not step.pairs:
            return False
        warned = [a for a, _ in step.pairs]
        names = ", ".join(f"{a.node_id} -> {b.node_id}" for a, b in step.pairs)
        noticed = {w.node_id for w in s.swaps if w.deadline is not None}
        s.resizes += 1
        s.swapped += len(warned)
        s.reclaims += sum(a.node_id in noticed for a in warned)
        await self.ranks.stop(
            graceful=True, grace=step.grace, lost=[], reason=f"make-before-break: {names}"
        )
        s.swaps = [w for w in s.swaps if w.node_id not in {a.node_id for a in warned}]
        await self.fleet.release(warned, "swapped out (make-before-break)")
        s.record(workflow.now(), "swapped in one resize", names)
        return True
