"""The main loop's wake-up timers, kept across wakes rather than cancelled at each.

A wait that ends early (a signal, an activity's result) used to cancel its timer, and the
next wait started a new one for the same instant. The time-skipping test server refuses a
workflow task that cancels a timer which fired while the task was with the worker, and then
never sends the run another task (temporalio/sdk-java#3088, #2606): the run is stranded, a
test hangs, a benchmark's run wedges. The real server accepts such a cancel. So a timer is
cancelled only when it is due more than `CANCEL_BEYOND_S` away, longer than a workflow
task may take; a nearer one is left to fire (a wake with nothing to do). A timer that the
next wait wants again is reused, which also saves its TimerStarted and TimerCanceled events.
"""

from __future__ import annotations

import asyncio
from datetime import datetime

from temporalio import workflow

# More than the workflow task timeout (10 s): no task is still with a worker when a timer
# this far from its start fires.
CANCEL_BEYOND_S = 30.0
# The shortest timer set: finer timing buys nothing (a workflow task takes about that long).
SHORTEST_WAIT_S = 0.1


class Alarms:
    def __init__(self) -> None:
        self._timers: dict[datetime, asyncio.Task[None]] = {}

    def at(self, due: datetime, why: str) -> asyncio.Task[None]:
        """A timer that fires at `due` (at least `SHORTEST_WAIT_S` from now), named `why` in
        the Web UI: the one already set for that instant, or a new one. Timers for other
        instants are cancelled if they are due beyond `CANCEL_BEYOND_S`, else kept until
        they fire."""
        now = workflow.now()
        for at, timer in list(self._timers.items()):
            if timer.done():
                del self._timers[at]
            elif at != due and (at - now).total_seconds() > CANCEL_BEYOND_S:
                timer.cancel()
                del self._timers[at]
        if due not in self._timers:
            seconds = max((due - now).total_seconds(), SHORTEST_WAIT_S)
            self._timers[due] = asyncio.ensure_future(workflow.sleep(seconds, summary=why))
        return self._timers[due]
