"""The goodput benchmark's harness: each spotrain run on a fresh time-skipping server, watched
so that a wedged server cannot hold the benchmark silently, and each finished row written at
once, so that a killed benchmark keeps what it measured.

The time-skipping test server sometimes wedges a workflow task ("invalid history builder
state for action"): the server and this process then sit nearly idle while the run awaits a
result that never comes, and the server's clock, no longer skipping, only keeps pace with
real time (seen: 0.05 CPU-s/s for both, server time +3 s per 3 s). A watchdog samples the
server's time and the CPU time of this process and its children (the server) every
`wedge_s / 6` seconds; when for `wedge_s` the server time has not skipped ahead and the CPU
has stayed under `STILL_CPU`, the run is abandoned and retried at once on a fresh server. A
working run does one or the other: it skips hours of server time a second, or it computes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from .common import time_skipping_server
from .goodput_model import Row, Setup

RETRIES = 2  # fresh servers a policy's run gets after a wedged one
STILL_CPU = 0.15  # CPU seconds per second (all processes together) that count as idle
SKIPPING = 2.0  # server seconds per real second above which the server is skipping time
CANCEL_WAIT_S = 10.0  # how long an abandoned run gets to unwind before the server goes
SEEN = 12  # watchdog samples printed when a run passes its timeout

RunFn = Callable[[WorkflowEnvironment], Awaitable[Row]]


class Wedged(Exception):
    """The time-skipping test server stopped moving a run (its time or its workflow)."""


def cpu_seconds(root: int) -> float:
    """CPU time used by `root` and every process below it (from /proc; 0 where absent)."""
    tree: dict[int, list[int]] = {}
    ticks: dict[int, int] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return 0.0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = text[text.rindex(")") + 2 :].split()
        pid = int(entry.name)
        tree.setdefault(int(fields[1]), []).append(pid)
        ticks[pid] = int(fields[11]) + int(fields[12])  # utime + stime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += tree.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


Sample = tuple[datetime | None, float, float]  # server time (None: no answer), CPU s, real s


def describe(before: Sample, after: Sample) -> str:
    """Server seconds and CPU seconds per real second between two samples (for the log of a
    run abandoned on its timeout: which of the two kept it from counting as still)."""
    real = max(after[2] - before[2], 1e-9)
    server = (
        "no answer"
        if after[0] is None or before[0] is None
        else f"{(after[0] - before[0]).total_seconds() / real:.3g}"
    )
    return f"server {server} s/s, CPU {(after[1] - before[1]) / real:.2f}"


def still(before: Sample, after: Sample) -> bool:
    """Between two samples the server did not skip time (its clock, if it answered, kept at
    most real time's pace) and the CPU stayed idle."""
    real = after[2] - before[2]
    skipped = (
        after[0] is not None
        and before[0] is not None
        and (after[0] - before[0]).total_seconds() > SKIPPING * real
    )
    return not skipped and after[1] - before[1] < STILL_CPU * real


async def _sample(env: WorkflowEnvironment) -> Sample:
    real = time.monotonic()
    try:
        now: datetime | None = await asyncio.wait_for(env.get_current_time(), 5)
    except (TimeoutError, RPCError):  # (a server that does not answer does not move)
        now = None
    return now, cpu_seconds(os.getpid()), real


async def watched(env: WorkflowEnvironment, run: Awaitable[Row], wedge_s: float) -> Row:
    """`run`'s row; `Wedged` once the server skipped no time and the CPU stayed idle for
    `wedge_s` real seconds (the run is cancelled first)."""
    task = asyncio.ensure_future(run)
    period = wedge_s / 6
    last, still_since = await _sample(env), time.monotonic()
    seen: deque[str] = deque(maxlen=SEEN)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=period)
            if done:
                return task.result()
            sample = await _sample(env)
            seen.append(describe(last, sample))
            if not still(last, sample):
                still_since = time.monotonic()
            elif time.monotonic() - still_since >= wedge_s:
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
                raise Wedged(f"no time skipped and CPU idle for {wedge_s:.0f} s")
            last = sample
    except asyncio.CancelledError:  # `run_timeout_s` passed: say what the watchdog saw
        print(f"run timed out; the watchdog's last samples: {'; '.join(seen)}", file=sys.stderr)
        task.cancel()
        raise


async def on_fresh_server(setup: Setup, policy: str, run: RunFn) -> Row:
    """One policy's run on its own time-skipping server; a run the server wedges (or that
    passes `run_timeout_s`) is abandoned and retried on a fresh server, up to RETRIES times
    (counted in the row's `retries`)."""
    for retry in range(RETRIES + 1):
        try:
            async with time_skipping_server() as env:
                row = await asyncio.wait_for(
                    watched(env, run(env), setup.wedge_s), setup.run_timeout_s
                )
        except (Wedged, TimeoutError) as err:
            print(f"{policy}: wedged ({err or 'timed out'}), retrying", file=sys.stderr)
            continue
        row.retries = retry
        print(f"{policy}: {row.run_s:.0f} s", file=sys.stderr, flush=True)
        return row
    raise RuntimeError(f"{policy}: the test server wedged {RETRIES + 1} times in a row")


class RowLog:
    """Each finished row, appended to a JSON-lines file as it completes; removed once the
    whole report is written."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def write(self, row: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    def done(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
