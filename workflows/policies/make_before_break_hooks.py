"""A TrainingJob's make-before-break swaps, as its workflow applies them: sequencing only,
the decisions are `make_before_break`'s. Call from workflow code only.

Guarded by `workflow.patched(PATCH)`: only a job whose policy asks for make-before-break
reaches it, and histories from before it replay unchanged; the rule that weighs a rebalance
recommendation (`warning_rule`) is guarded by `RULE_PATCH` the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.capacity.fleet import Fleet
    from spotrain.workflows.job import events
    from spotrain.workflows.job.ranks import Ranks
    from spotrain.workflows.job.state import JobState, Swap
    from spotrain.workflows.policies import make_before_break, warning_rule

PATCH = "make-before-break"
RULE_PATCH = "make-before-break-warning-rule"


class Swapper:
    def __init__(
        self,
        state: JobState,
        fleet: Fleet,
        ranks: Ranks,
        notice_first: Callable[[str, datetime | None], None],
    ) -> None:
        self.s = state
        self.fleet = fleet
        self.ranks = ranks
        # Queues a reclaim notice ahead of the inbox. (The workflow builds the event: its
        # event classes are the sandbox's, which its `match` recognises; ours might not be.)
        self.notice_first = notice_first

    async def on_notice(self, event: events.Reclaim) -> bool:
        """Order a replacement ahead of a warned node if the job's policy says so; False: the
        usual reclaim path decides."""
        s = self.s
        plan = make_before_break.on_notice(s, event, workflow.now())
        if plan.action == "pass":
            s.swaps = plan.swaps
            if s.swaps:  # a shrink anyway: open notices leave with it
                self._shrink_now(make_before_break.leaving_with(s, event))
            return False
        if not workflow.patched(PATCH):
            return False
        if not self._worth_it(event, plan.action):
            return True
        s.swaps = plan.swaps
        if plan.action == "order":
            s.record(workflow.now(), "replacement ordered ahead", plan.detail)
            s.owed += 1  # like any replacement: on-demand if spot is short and policy allows
            held = sum(n.alive for n in s.nodes)
            await self.fleet.reconcile()
            if event.deadline and sum(n.alive for n in s.nodes) == held:
                # Nothing to order (no spot offered, no on-demand allowed): waiting for a
                # replacement only delays the shrink, so shrink now.
                s.owed -= 1
                s.record(workflow.now(), "no replacement to be had", f"{event.node_id}: shrinking")
                self._shrink_now([w for w in s.swaps if w.node_id == event.node_id])
        elif plan.action == "no room":
            s.record(workflow.now(), "no room for a replacement yet", plan.detail)
        elif plan.action == "deadline":
            s.record(workflow.now(), "warned node has a deadline", plan.detail)
        return True

    def _worth_it(self, event: events.Reclaim, action: str) -> bool:
        """A new early warning gets a replacement only if `warning_rule` says its expected
        gain beats its surge cost, a scheduled change taken as certain (histories from before
        the rule replay as they ran: every warning acted on)."""
        node = self.s.node_by_id(event.node_id)
        if event.kind not in events.WARNINGS or action not in ("order", "no room") or node is None:
            return True
        verdict = warning_rule.worth_acting(self.s, node, certain=event.kind == "scheduled")
        if verdict.act or not workflow.patched(RULE_PATCH):
            return True
        why = f"{event.node_id}: {verdict.describe()}"
        what = "rebalance recommendation" if event.kind == "rebalance" else "scheduled change"
        self.s.record(workflow.now(), f"{what} not worth a replacement", why)
        return False

    def _shrink_now(self, swaps: list[Swap]) -> None:
        """Give up waiting for these notices' replacements: they shrink as usual."""
        self.s.swaps = [w for w in self.s.swaps if w not in swaps]
        for w in swaps:
            self.notice_first(w.node_id, w.deadline)

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
        if step.late:
            late = ", ".join(w.node_id for w in step.late)
            s.record(now, "replacement late", f"{late}: shrinking before the deadline")
            self._shrink_now(step.late)
        if not step.pairs:
            return False
        warned = [a for a, _ in step.pairs]
        names = ", ".join(f"{a.node_id} -> {b.node_id}" for a, b in step.pairs)
        noticed = {w.node_id for w in s.swaps if w.deadline is not None}
        s.resizes += 1
        s.swapped += len(warned)
        s.reclaims += sum(a.node_id in noticed for a in warned)
        await self.ranks.stop(
            graceful=True,
            grace=step.grace,
            lost=[],
            reason=f"make-before-break: {names}",
            resize=True,
        )
        s.swaps = [w for w in s.swaps if w.node_id not in {a.node_id for a in warned}]
        await self.fleet.release(warned, "swapped out (make-before-break)")
        s.record(workflow.now(), "swapped in one resize", names)
        await self.fleet.reconcile()  # room for replacements still waiting for some
        return True
