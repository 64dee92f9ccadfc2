"""A rank's step times, kept in memory for straggler detection (no I/O, no torch).

Each rank times its steps between `report_progress` calls; the time of its own work where the
script marks it (`elastic.busy()`: in lockstep training, waits on peers inside collectives
make every rank's wall time the same, so only the work outside them tells a slow node apart),
else the wall time. The record it leaves in the store (with the throttled progress write) says
how long its recent steps take and how long they took when it started, so that the
orchestrator compares each rank with its own history and with its peers
(workflows/stragglers.py).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

RECENT_STEPS = 5  # the recent step time: the median of this many latest steps
WARMUP_STEPS = 1  # not part of the usual step time (compilation, caches, the first batch)
USUAL_STEPS = 20  # the usual step time: the median of this many steps after the warm-up


class StepClock:
    """Step durations of one rank: the latest few, and the reference window it started with."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.first: list[float] = []  # warm-up, then the reference window: never changes after
        self.busy_s = 0.0  # marked work since the last step
        self.marked = False  # the script marks its work: time that, not the wall clock
        self.last: tuple[int, float] | None = None  # (step, time) of the previous report

    def add_busy(self, seconds: float) -> None:
        self.busy_s += seconds
        self.marked = True

    def tick(self, step: int, now: float) -> None:
        """Rank reached `step` at `now` (monotonic seconds): book the steps since the last."""
        if self.last is not None and step > self.last[0]:
            spent = self.busy_s if self.marked else now - self.last[1]
            per_step = spent / (step - self.last[0])
            self.recent.append(per_step)
            if len(self.first) < WARMUP_STEPS + USUAL_STEPS:
                self.first.append(per_step)
        if self.last is None or step > self.last[0]:
            self.last, self.busy_s = (step, now), 0.0

    def record(self, step: int, wall_time: float) -> dict[str, Any]:
        """What the store keeps for this rank: its step, when (epoch seconds), and the recent
        and usual seconds per step (None until known)."""
        recent, usual = list(self.recent), self.first[WARMUP_STEPS:]
        return {
            "step": step,
            "time": wall_time,
            "recent_s": statistics.median(recent) if len(recent) == RECENT_STEPS else None,
            "usual_s": statistics.median(usual) if len(usual) == USUAL_STEPS else None,
        }
