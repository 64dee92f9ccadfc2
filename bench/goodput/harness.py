"""The goodput benchmark's harness: each spotrain run on a fresh time-skipping server, watched
so that a wedged server cannot hold the benchmark silently, and each finished row written at
once, so that a killed benchmark keeps what it measured.

The time-skipping test server sometimes wedges a workflow task ("invalid history builder
state for action"): the server and this process then sit nearly idle while the run awaits a
result that never comes, and the server's clock, no longer skipping, only keeps pace with
real time (seen: 0.05 CPU-s/s for both, server time +3 s per 3 s, with a jump once a minute).
A watchdog samples the server's time and the CPU this process and its children (the server)
asked for, every `wedge_s / 6` seconds. A run is wedged when, over the last `wedge_s`, the
server's clock moved less than `SKIPPING` times real time (a real-time pace and its jumps
count as still) and the processes asked for under `STILL_CPU` of a core: CPU they used plus
time they waited runnable for a core (/proc/PID/schedstat), so a run starved on a loaded
machine, which wants CPU it does not get, is not taken for a wedged one. A working run does
one or the other: it skips hours of server time a second, or it computes (or waits to).
A wedged run is abandoned and retried on a fresh server; a policy wedged every time is
reported as abandoned and the benchmark goes on with the next.

It can also skip time over a workflow task: after workflow tasks timed out on a CPU-starved
worker, the task scheduled next waited, unstarted, while the server skipped to the
benchmark's next event (15 h and 50 h later in two 1-node runs), and the simulated job
trained on unseen: its completion, or a node on offer, went unnoticed that long. Such a run
moves time and CPU as a working one does; its history shows it (`skipped_over`), and it is
retried as a wedged one is.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment

from ..common import time_skipping_server
from .model import Row, Setup

RETRIES = 3  # fresh servers a policy's run gets after a wedged one
STILL_CPU = 0.15  # CPU asked for (used or waited for), in cores, that counts as idle
SKIPPING = 10.0  # server seconds per real second, over `wedge_s`, that count as skipping
CANCEL_WAIT_S = 10.0  # how long an abandoned run gets to unwind before the server goes
SEEN = 12  # watchdog samples printed when a run passes its timeout
# a workflow task that waited longer than this in server time to start was skipped over (a
# working one starts within real seconds: the server does not skip while one is pending)
STALE_TASK_S = 60.0

RunFn = Callable[[WorkflowEnvironment], Awaitable[Row]]


class Wedged(Exception):
    """The time-skipping test server stopped moving a run (its time or its workflow)."""


def cpu_demand(root: int) -> float:
    """Seconds `root` and every process below it spent on a CPU or runnable waiting for one
    (/proc/PID/schedstat; 0 where absent): what they asked for, whether or not they got it."""
    tree: dict[int, list[int]] = {}
    asked: dict[int, int] = {}
    proc = Path("/proc")
    if not proc.is_dir():
        return 0.0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            on_cpu_ns, waited_ns = (entry / "schedstat").read_text().split()[:2]
        except (OSError, ValueError):  # gone meanwhile
            continue
        pid = int(entry.name)
        tree.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(pid)
        asked[pid] = int(on_cpu_ns) + int(waited_ns)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += asked.get(pid, 0)
        todo += tree.get(pid, [])
    return total / 1e9


Sample = tuple[datetime | None, float, float]  # server time (None: no answer), CPU asked, real s


def describe(before: Sample, after: Sample) -> str:
    """Server seconds and CPU asked for per real second between two samples (for the log of
    a run abandoned on its timeout: which of the two kept it from counting as still)."""
    real = max(after[2] - before[2], 1e-9)
    server = (
        "no answer"
        if after[0] is None or before[0] is None
        else f"{(after[0] - before[0]).total_seconds() / real:.3g}"
    )
    return f"server {server} s/s, CPU {(after[1] - before[1]) / real:.2f}"


def still(before: Sample, after: Sample) -> bool:
    """Between two samples the server did not skip time (its clock, if it answered, kept
    about real time's pace) and the processes asked for next to no CPU."""
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
    return now, cpu_demand(os.getpid()), real


async def watched(env: WorkflowEnvironment, run: Awaitable[Row], wedge_s: float) -> Row:
    """`run`'s row; `Wedged` once the run was still over the last `wedge_s` real seconds,
    taken as a whole (the run is cancelled first)."""
    task = asyncio.ensure_future(run)
    window: deque[Sample] = deque([await _sample(env)])
    seen: deque[str] = deque(maxlen=SEEN)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=wedge_s / 6)
            if done:
                return task.result()
            sample = await _sample(env)
            seen.append(describe(window[-1], sample))
            window.append(sample)
            while len(window) > 2 and sample[2] - window[1][2] >= wedge_s:
                window.popleft()  # (the oldest sample kept is the newest one wedge_s old)
            if sample[2] - window[0][2] >= wedge_s and still(window[0], sample):
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
                raise Wedged(f"no time skipped and no CPU asked for in {wedge_s:.0f} s")
    except asyncio.CancelledError:  # `run_timeout_s` passed: say what the watchdog saw
        print(f"run timed out; the watchdog's last samples: {'; '.join(seen)}", file=sys.stderr)
        task.cancel()
        raise


def skipped_over(events: Iterable[HistoryEvent]) -> str | None:
    """Why a run's history shows the test server skipping time over a pending workflow task
    (one that started more than `STALE_TASK_S` of server time after it was scheduled), or
    None."""
    scheduled: datetime | None = None
    for e in events:
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_SCHEDULED:
            scheduled = e.event_time.ToDatetime()
        elif e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED and scheduled:
            waited = (e.event_time.ToDatetime() - scheduled).total_seconds()
            if waited > STALE_TASK_S:
                return (
                    f"workflow task {e.event_id} waited {waited:.0f} s of server time to start: "
                    "the server skipped time over it"
                )
    return None


async def check_not_skipped(client: Client, workflow_id: str, first_run_id: str | None) -> None:
    """`Wedged` if any run of the workflow's chain (continue-as-new) was skipped over."""
    run_id = first_run_id
    while run_id:
        history = await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        if why := skipped_over(history.events):
            raise Wedged(why)
        last = history.events[-1]
        attrs = last.workflow_execution_continued_as_new_event_attributes
        continued = last.HasField("workflow_execution_continued_as_new_event_attributes")
        run_id = attrs.new_execution_run_id if continued else None


async def on_fresh_server(setup: Setup, policy: str, run: RunFn) -> Row | None:
    """One policy's run on its own time-skipping server; a run the server wedges (or that
    passes `run_timeout_s`) is abandoned and retried on a fresh server, up to RETRIES times
    (counted in the row's `retries`). None: wedged every time (the caller goes on without
    this row and reports it abandoned)."""
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
    print(f"{policy}: wedged {RETRIES + 1} times in a row: abandoned", file=sys.stderr)
    return None


class RowLog:
    """Each finished row, appended to a JSON-lines file as it completes; removed once the
    whole report is written. Also the policies abandoned on wedged servers, for the report."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.abandoned: list[str] = []
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")

    def write(self, row: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(row, default=str) + "\n")

    def abandon(self, policy: str) -> None:
        self.abandoned.append(policy)
        self.write({"policy": policy, "abandoned": f"wedged {RETRIES + 1} times in a row"})

    def done(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
