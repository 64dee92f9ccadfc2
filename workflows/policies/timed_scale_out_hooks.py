"""Timed scale-outs as the TrainingJob workflow runs them: the update waits for its answer, a
timer queues the deadline as an event, ready nodes settle it early. Decisions are in
`timed_scale_out`; this only sequences them. Call from workflow code only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.capacity.fleet import Fleet
    from spotrain.workflows.job import events
    from spotrain.workflows.job.state import JobState, NodeState
    from spotrain.workflows.policies import timed_scale_out


class ScaleOutWaits:
    def __init__(self, s: JobState, now: Callable[[], datetime]) -> None:
        self.s, self.now = s, now
        self.waiting = 0  # updates not answered yet: the run must not continue as new
        self._timers: set[asyncio.Task[None]] = set()

    async def ask(self, count: int, timeout_s: float) -> str:
        """The update's body: queue the scale-out, then wait for its answer."""
        s = self.s
        s.scale_outs += 1
        seq = s.scale_outs
        s.inbox.append(events.ScaleOut(count=count, timeout_s=timeout_s, seq=seq))
        self.waiting += 1
        await workflow.wait_condition(lambda: (s.scale_out_answer or (0, ""))[0] == seq)
        self.waiting -= 1
        return (s.scale_out_answer or (0, ""))[1]

    def begin(self, event: events.ScaleOut) -> None:
        """Before the target moves: remember how to undo it, and start its timer."""
        assert event.timeout_s is not None
        timed_scale_out.begin(self.s, event.seq, event.count, event.timeout_s, self.now())

        async def due() -> None:
            await workflow.sleep(event.timeout_s or 0, summary=f"scale-out {event.seq}: in time?")
            self.s.inbox.append(events.ScaleOutDue(seq=event.seq))

        task = asyncio.create_task(due())
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    def settle(self) -> None:
        """Answer the pending scale-out if its nodes are all ready."""
        s = self.s
        if s.pending_scale_out is not None and timed_scale_out.reached(s):
            ready = f"{s.pending_scale_out.target} nodes ready"
            s.record(self.now(), "scaled out", ready)
            timed_scale_out.answer(s, f"scaled out: {ready}")

    async def due(self, seq: int, fleet: Fleet) -> None:
        """The nodes did not come in time: the target goes back, idle extras are released."""
        s = self.s
        pending = s.pending_scale_out
        if pending is None or pending.seq != seq:
            return  # they came in time
        undo = timed_scale_out.revert(s)
        s.target, s.ceiling, s.owed = undo.target, undo.ceiling, undo.owed
        ready = sum(1 for n in s.nodes if n.state == NodeState.READY)
        why = (
            f"timed out with {ready} of {pending.target} node(s) ready: "
            f"target back to {undo.target}"
        )
        s.record(self.now(), "scale out timed out", why)
        timed_scale_out.answer(s, why)
        await fleet.release(undo.surplus, "scale out timed out")
