"""A local rank's process and its files (activities/local.py lays them out): the pid record,
the exit code its launcher writes, its log, and the /proc reads that tell a live launcher
from a recycled pid. The runtime's activities start, signal and watch ranks through these;
leak checks and the demo find a job's processes with `job_processes` alone.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TAIL_LINES, TAIL_BYTES = 5, 2000  # of a failed rank's output, for the job's fault message


def read_json(path: Path) -> Any | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def proc_start_time(pid: int) -> int | None:
    """Kernel start time (clock ticks since boot) of a live, non-zombie process, else None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    state, start = fields[0], int(fields[19])
    return None if state in ("Z", "X") else start


def tail(log: Path, lines: int = TAIL_LINES) -> str:
    """The last non-empty lines of a rank's log (a traceback's last lines say why it died)."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join([line for line in text.splitlines() if line.strip()][-lines:])


def reap(pid: int) -> None:
    """Collect our own exited child so it does not linger as a zombie; others are not ours."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)


@dataclass(frozen=True)
class Rank:
    """One rank's files, and its process as recorded when it was started."""

    rank: int
    dir: Path

    @property
    def pid_file(self) -> Path:
        return self.dir / f"rank-{self.rank}.pid"

    @property
    def exit_file(self) -> Path:
        return self.dir / f"rank-{self.rank}.exit"

    @property
    def log_file(self) -> Path:
        return self.dir / f"rank-{self.rank}.log"

    def record(self) -> dict[str, Any] | None:
        return read_json(self.pid_file)

    def live_pid(self) -> int | None:
        """Its launcher's pid if still running: same pid AND same start time (not recycled)."""
        rec = self.record()
        if rec is None:
            return None
        reap(rec["pid"])
        return rec["pid"] if proc_start_time(rec["pid"]) == rec["start"] else None

    def alive(self) -> bool:
        return self.live_pid() is not None

    def exit_code(self) -> int | None:
        """Its launcher's code; an adopted rank's (live resize) is where it was launched."""
        where = (self.record() or {}).get("exit")
        rec = read_json(Path(where) if where else self.exit_file)
        return None if rec is None else rec["code"]

    def signal(self, signum: int, group: bool) -> bool:
        """Signal the launcher (which forwards) or its whole process group; False if gone."""
        pid = self.live_pid()
        if pid is None:
            return False
        try:
            os.killpg(pid, signum) if group else os.kill(pid, signum)
        except ProcessLookupError:
            return False
        return True


def job_processes(job: str) -> list[int]:
    """Live processes whose environment names `job` (SPOTRAIN_JOB): every rank of every
    generation, whether or not its pid file is still there. Leak checks use it."""
    marker = f"SPOTRAIN_JOB={job}\0".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker in (proc / "environ").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in ("Z", "X"):
                    pids.append(int(proc.name))
        except OSError:
            continue
    return pids
