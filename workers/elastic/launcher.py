"""Run one rank's command and record its exit code, whoever else dies.

The local runtime starts every rank through this wrapper in a session of its own, so the rank
outlives a crashed controller and its exit code still lands on disk (atomically) for the next
controller to read. SIGTERM and SIGINT are forwarded to the rank, which decides how to exit.

Usage: python launcher.py EXIT_FILE -- COMMAND [ARG ...]
Standard library only, and run by file path (its module's `__file__`), not with `-m`: it starts
before, and independently of, everything else, without importing the package.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def write_exit_code(path: Path, code: int) -> None:
    """Temp file + rename: a reader sees the whole record or none. Signals are negative."""
    tmp = path.with_name(f".tmp-{path.name}")
    tmp.write_text(json.dumps({"code": code, "time": time.time()}))
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    exit_file, command = Path(argv[0]), argv[2:]
    pending: list[int] = []  # a signal that arrived before the child existed
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: object) -> None:
        if child is None:
            pending.append(signum)
        else:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        child = subprocess.Popen(command)
    except OSError as err:
        print(f"rank_launcher: cannot start {command[0]!r}: {err}", file=sys.stderr)
        write_exit_code(exit_file, 127)
        return 127
    for signum in pending:
        child.send_signal(signum)
    code = child.wait()
    write_exit_code(exit_file, code)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
