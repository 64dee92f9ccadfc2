"""A pytest runner for tests/test_breaks.py that pays for the heavy imports once per copy.

Run as a script inside a copy of the repository: it imports the third-party libraries the
tests use (torch, temporalio, boto3, moto, ...: about 6 s of CPU, most of a fresh pytest's
start), then for each request on stdin forks a child that runs pytest there. The child imports
spotrain's code and the tests afresh from the copy, so it sees the break applied just before;
the parent never imports them. Requests and answers are JSON lines:
  in:  {"args": [...pytest arguments...], "log": "/path/for/the/output"}
  out: {"pid": <child>}  then  {"returncode": <pytest's exit code, or -signal>}
The child leads a session of its own, so the caller can kill it and whatever it started.
Before it does, on a timeout, SIGUSR1 makes the child write where it waits (`dump_stacks`).
"""

from __future__ import annotations

import asyncio
import faulthandler
import importlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TextIO

PRELOAD = (
    "torch",
    "numpy",
    "temporalio.client",
    "temporalio.worker",
    "temporalio.testing",
    "temporalio.contrib.pydantic",
    "pydantic",
    "boto3",
    "botocore.client",
    "moto.server",
    "moto.ec2.models",  # tests/conftest.py's EC2 double: 2 s of each run's start otherwise
    "moto.ec2.responses.instances",
    "hypothesis",
    "aiohttp",
    "kubernetes.client",
    "yaml",
    "pytest",
)


def dump_stacks(log: TextIO) -> Callable[[int, FrameType | None], None]:
    """A signal handler writing to `log` every thread's stack, and every asyncio task's: an
    async test that hangs waits in the event loop, whose thread's stack shows only its select.
    (To the log itself: pytest captures the test's stderr, and the caller kills the child.)"""

    def dump(signum: int, _: FrameType | None) -> None:
        print(f"\n--- stacks on signal {signum} ---", file=log, flush=True)
        faulthandler.dump_traceback(log, all_threads=True)
        try:
            tasks = asyncio.all_tasks(asyncio.get_running_loop())
        except RuntimeError:  # (no loop running in this thread: not an async test)
            tasks = set()
        for task in tasks:
            print(f"{task.get_name()} awaits (outermost first):", file=log)
            for frame in awaited(task.get_coro()):
                code = frame.f_code
                print(
                    f'  File "{code.co_filename}", line {frame.f_lineno}, in {code.co_name}',
                    file=log,
                )
        log.flush()

    return dump


def awaited(coro: object) -> Iterator[FrameType]:
    """The frames of a suspended coroutine and of each one it awaits, down the chain (a
    task's own stack holds only the outermost)."""
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            yield frame
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)


def run(args: list[str], log: str) -> None:
    """In the forked child: pytest's output to `log`, then exit with its code."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    signal.signal(signal.SIGUSR1, dump_stacks(os.fdopen(os.dup(fd), "w")))
    code = 3
    try:
        import pytest

        code = int(pytest.main(args))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    sys.path[0] = os.getcwd()  # as `python -m pytest` has it, not this script's folder
    for name in PRELOAD:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run(request["args"], request["log"])
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    main()
