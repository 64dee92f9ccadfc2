"""Where a scale worker's CPU goes while it reclaims (`bench.scale --profile DIR`).

Two views of each workflow worker process over the reclaim window:
- its CPU split by thread name from /proc (the SDK core's Rust threads, `tokio-runtime-w`,
  against the Python threads: the event loop and the workflow activations), which no Python
  profiler sees whole;
- py-spy samples of its Python threads (idle ones left out, so the samples follow CPU), as
  collapsed stacks in DIR, summed by the function on top (self) and by spotrain's own
  workflow functions on the stack (inclusive).
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .common import stop

TOP = 15


def thread_cpu_s(pid: int) -> dict[str, float]:
    """A process's CPU seconds so far, summed by thread name."""
    by_name: dict[str, float] = collections.defaultdict(float)
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):
            text = stat.read_text()
            name = text[text.index("(") + 1 : text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            by_name[name] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return dict(by_name)


def frame_name(frame: str) -> str:
    """`function (path/to/module.py:123)` -> `function (module.py)`: lines summed."""
    function, _, where = frame.partition(" (")
    return f"{function} ({where.rsplit(':', 1)[0].rsplit('/', 1)[-1]})"


def summarize(collapsed: Path) -> dict[str, Any]:
    """Samples in a py-spy `raw` file by the top function and by workflow code inclusive."""
    self_time: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in collapsed.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [frame_name(f) for f in stack.split(";")]
        samples = int(count)
        total += samples
        self_time[frames[-1]] += samples
        ours = {f for f, raw in zip(frames, stack.split(";"), strict=True) if "workflows/" in raw}
        for frame in ours:
            inclusive[frame] += samples

    def shares(counter: collections.Counter[str]) -> dict[str, float]:
        return {k: round(v / max(1, total), 4) for k, v in counter.most_common(TOP)}

    return {"samples": total, "self": shares(self_time), "workflow_inclusive": shares(inclusive)}


@contextlib.asynccontextmanager
async def sampled(
    pids: list[int], duration_s: float, folder: Path | None
) -> AsyncIterator[dict[str, Any]]:
    """Profiles `pids` while the body runs, if `folder`; the dict yielded holds, once the
    body is done, each worker's thread CPU split and py-spy summary (empty without)."""
    found: dict[str, Any] = {}
    if folder is None:
        yield found
        return
    spy = shutil.which("py-spy") or str(Path(os.sys.executable).with_name("py-spy"))
    folder.mkdir(parents=True, exist_ok=True)
    before = [thread_cpu_s(pid) for pid in pids]
    outputs = [folder / f"worker-{pid}.txt" for pid in pids]
    command = [spy, "record", "--format", "raw", "--nonblocking", "--rate", "50"]
    command += ["--duration", str(int(duration_s) + 5)]
    procs = [
        subprocess.Popen(
            [*command, "--pid", str(pid), "--output", str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid, out in zip(pids, outputs, strict=True)
    ]
    try:
        yield found
    finally:
        stop(procs, signal.SIGINT)  # py-spy writes what it has on SIGINT
    for pid, was, out in zip(pids, before, outputs, strict=True):
        now = thread_cpu_s(pid)
        threads = {k: round(v - was.get(k, 0.0), 2) for k, v in now.items()}
        found[str(pid)] = {"thread_cpu_s": threads} | (summarize(out) if out.exists() else {})
