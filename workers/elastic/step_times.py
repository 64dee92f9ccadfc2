"""A rank's step times, kept in memory for straggler detection (no I/O, no torch).

Each rank times its steps between `report_progress` calls; the time of its own work where the
script marks it (`elastic.busy()`: in lockstep training, waits on peers inside collectives
make every rank's wall time the same, so only the work outside them tells a slow node apart),
else the wall time. The record it leaves in the store (`report_progress` writes it every few
seconds: no I/O per step) says how long its recent steps take and how long they took when it
started, so that the orchestrator compares each rank with its own history and with its peers
(workflows/policies/stragglers.py).

A rank stuck in its own work cannot write from its main thread: a daemon thread writes its
last record once more, marked with the start of the section in progress (`busy_since`), once
that section has lasted `STUCK_AFTER_S`. In lockstep training its peers then wait in a
collective, outside their sections: that tells the stuck rank apart when the whole job stalls.
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Any

RECENT_STEPS = 5  # the recent step time: the median of this many latest steps
WARMUP_STEPS = 1  # not part of the usual step time (compilation, caches, the first batch)
USUAL_STEPS = 20  # the usual step time: the median of this many steps after the warm-up
STUCK_AFTER_S = 1.0  # a marked section this long is written once, while in progress


class StepClock:
    """Step durations of one rank: the latest few, and the reference window it started with."""

    def __init__(self) -> None:
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self.first: list[float] = []  # warm-up, then the reference window: never changes after
        self.busy_s = 0.0  # marked work since the last step
        self.marked = False  # the script marks its work: time that, not the wall clock
        self.last: tuple[int, float] | None = None  # (step, time) of the previous report
        self.busy_since: float | None = None  # epoch start of the marked section in progress
        self.written: dict[str, Any] | None = None  # the record last written
        self.noted: float | None = None  # the section in progress already written as such
        self.stuck_written = False  # the last record written says a section is in progress
        self.lock = threading.Lock()  # one writer at a time: the loop, or the stuck watch

    def begin_busy(self, now: float) -> None:
        self.busy_since = now

    def end_busy(self, seconds: float) -> None:
        self.busy_since = None
        self.add_busy(seconds)

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

    def stuck_record(self, now: float) -> dict[str, Any] | None:
        """The last record marked with the section in progress, if that section has lasted
        `STUCK_AFTER_S` (epoch `now`) and was not written yet; call with `lock` held."""
        since = self.busy_since
        if since is None or since == self.noted or self.written is None:
            return None
        if now - since < STUCK_AFTER_S:
            return None
        self.noted, self.stuck_written = since, True
        step = self.last[0] if self.last else self.written["step"]  # (writes are throttled)
        return {**self.written, "step": step, "busy_since": since}

    def stale(self) -> bool:
        """The last record written has a section in progress that has ended: write a new one
        now, not at the next interval. (Under load a normal step's work can outlast
        STUCK_AFTER_S; left standing, the record would show this rank stuck in its own work
        while it waits in a collective, and a lockstep job's real culprit would have no peer
        that waits.)"""
        return self.stuck_written and self.busy_since != self.noted

    def record(self, step: int, wall_time: float) -> dict[str, Any]:
        """What the store keeps for this rank: its step, when (epoch seconds), and the recent
        and usual seconds per step (None until known)."""
        recent, usual = list(self.recent), self.first[WARMUP_STEPS:]
        self.stuck_written = False
        self.written = {
            "step": step,
            "time": wall_time,
            "recent_s": statistics.median(recent) if len(recent) == RECENT_STEPS else None,
            "usual_s": statistics.median(usual) if len(usual) == USUAL_STEPS else None,
        }
        return self.written
