"""A pytest runner for tests/test_breaks.py that pays for the heavy imports once per copy.

Run as a script inside a copy of the repository: it imports the third-party libraries the
tests use (torch, temporalio, boto3, moto, ...: about 6 s of CPU, most of a fresh pytest's
start), then for each request on stdin forks a child that runs pytest there. The child imports
spotrain's code and the tests afresh from the copy, so it sees the break applied just before;
the parent never imports them. Requests and answers are JSON lines:
  in:  {"args": [...pytest arguments...], "log": "/path/for/the/output"}
  out: {"pid": <child>}  then  {"returncode": <pytest's exit code, or -signal>}
The child leads a session of its own, so the caller can kill it and whatever it started.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

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


def run(args: list[str], log: str) -> None:
    """In the forked child: pytest's output to `log`, then exit with its code."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
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
