"""Break each guarded behaviour on purpose, one at a time, and check that the fast unit tests
named for it fail (the list is in tests/breaks/: the planner's effect of every documented spec
field, webhook auth, notice times, EC2 ownership, the live rank hand-over).

Every break is applied to a private copy of the repository in a temporary folder, never to the
working tree, so an interrupted run or a test of another xdist worker never sees broken code.
The copy is imported through a `spotrain` package of links that PYTHONPATH puts before the
editable install, and with no bytecode written (a break and its undo can leave a file of the
same size in the same second). The runs fork from a process per copy that has the heavy
libraries imported (tests/breaks/warm_pytest.py), so each costs its tests, not pytest's start,
and imports spotrain's code afresh. A break counts as caught when a named test FAILS (exit code 1
with a FAILED line): an error, a collection failure or a timeout is not a catch. A control run
of every named test on the unbroken copy must pass, or a catch would mean nothing.

Run alone: `.venv/bin/python -m pytest -q tests/test_breaks.py` (`-k planner` for some); the
terminal summary lists every break caught, with its time and the test that caught it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty, Queue

import pytest

from tests.breaks import BREAKS, Break

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {  # the import name's last part -> the folder (pyproject's package-dir)
    "workflows": "workflows",
    "activities": "activities",
    "workers": "workers",
    "elastic": "workers/elastic",
}
SKIP = shutil.ignore_patterns(
    ".git", ".venv", ".ci", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", ".ruff*"
)
# Two at a time: most named tests are pure and take a second or two.
JOBS = int(os.environ.get("SPOTRAIN_BREAK_JOBS", "2"))
RUN_TIMEOUT_S = 280
STACKS_WAIT_S = 2  # for a run that timed out to write where it waits
TIMED_OUT_TAIL = 12_000  # (the stacks of every thread and task)
# A test here waits for its run, which may wait its turn behind others on a loaded machine.
# The runs' rank processes fork from this process's warm python server (tests/warm_python.py,
# named in the environment the copies inherit): a run that started its own would import
# torch cold, 5 s of CPU or more for each break whose named test starts ranks.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("warm_python_server"),
]
# Plugins no named test needs: a quarter of each run's start-up (the control run would fail
# if one did).
UNUSED_PLUGINS = [f"-pno:{name}" for name in ("cacheprovider", "xdist", "schemathesis", "anyio")]
FAILED = re.compile(r"^FAILED (\S+)", re.M)
SKIPPED = re.compile(r"^SKIPPED \[\d+\] (.+)$", re.M)  # (where and why)


@dataclass(frozen=True)
class Outcome:
    returncode: int
    failed: list[str]
    seconds: float
    tail: str
    skipped: list[str] = field(default_factory=list)


def copy_repo(into: Path) -> Path:
    """The repository's sources and tests, and `_site/spotrain/<pkg>` links into them."""
    root = into / "repo"
    shutil.copytree(REPO, root, ignore=SKIP, symlinks=True)
    site = root / "_site" / "spotrain"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    for name, folder in PACKAGES.items():
        (site / name).symlink_to(root / folder, target_is_directory=True)
    return root


class WarmPytest:
    """tests/breaks/warm_pytest.py serving the copy at `root`: each run forks a child of a
    process that has the heavy libraries imported, so a break costs its tests, not pytest's
    start (about 6 s of CPU). The child leads a session of its own: on a timeout it goes with
    whatever it started (a test's gloo ranks, say)."""

    def __init__(self, root: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(root / "_site"), "PYTHONDONTWRITEBYTECODE": "1"}
        env.pop("PYTEST_XDIST_WORKER", None)
        self.root = root
        self.server = subprocess.Popen(
            [sys.executable, str(root / "tests" / "breaks" / "warm_pytest.py")],
            cwd=root,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.answers: Queue[dict[str, int]] = Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.server.stdout is not None
        for line in self.server.stdout:
            self.answers.put(json.loads(line))
        self.answers.put({})  # the server has gone

    def _answer(self, key: str, timeout_s: float = RUN_TIMEOUT_S) -> int:
        answer = self.answers.get(timeout=timeout_s)
        if key not in answer:
            raise RuntimeError(f"the warm pytest server exited ({self.server.poll()})")
        return answer[key]

    def run(self, tests: list[str], timeout_s: float = RUN_TIMEOUT_S) -> Outcome:
        """The named tests, as `python -m pytest -x -q` in the copy would run them. A run that
        times out first writes where it waits (warm_pytest.dump_stacks) into its tail."""
        log = self.root / "pytest.log"
        args = ["-x", "-q", *UNUSED_PLUGINS, *tests]  # (pyproject's -ra lists FAILED and SKIPPED)
        assert self.server.stdin is not None
        started = time.monotonic()
        self.server.stdin.write(json.dumps({"args": args, "log": str(log)}) + "\n")
        self.server.stdin.flush()
        pid = self._answer("pid")
        try:
            returncode = self._answer("returncode", timeout_s)
        except Empty:
            with contextlib.suppress(ProcessLookupError):  # (it ended just now)
                os.kill(pid, signal.SIGUSR1)
                time.sleep(STACKS_WAIT_S)
            os.killpg(pid, signal.SIGKILL)
            self._answer("returncode")
            tail = log.read_text(errors="replace")[-TIMED_OUT_TAIL:]
            return Outcome(-1, [], time.monotonic() - started, f"timed out\n{tail}")
        finally:
            with contextlib.suppress(ProcessLookupError):  # (anything it left behind)
                os.killpg(pid, signal.SIGKILL)
        out = log.read_text(errors="replace")
        seconds = time.monotonic() - started
        return Outcome(returncode, FAILED.findall(out), seconds, out[-1500:], SKIPPED.findall(out))

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()


def apply_and_run(warm: WarmPytest, brk: Break) -> Outcome:
    """`brk` applied to the copy `warm` serves, its named tests run, the file restored."""
    path = warm.root / brk.path
    original = path.read_text()
    broken = original
    for old, new in brk.edits:
        assert broken.count(old) == 1, f"{brk.name}: {old!r} not found once in {brk.path}"
        broken = broken.replace(old, new)
    path.write_text(broken)
    try:
        return warm.run(list(brk.tests))
    finally:
        path.write_text(original)


def is_caught(brk: Break, outcome: Outcome) -> bool:
    """A named test failed (not an error, not a timeout)."""
    return outcome.returncode == 1 and any(
        f == t or f.startswith(t + "[") or f.startswith(t + "::")
        for f in outcome.failed
        for t in brk.tests
    )


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[Outcome]]]:
    """Runs the selected breaks (and the control run) in JOBS private copies at once."""
    selected = {
        item.callspec.params["brk"].name
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    todo = [b for b in BREAKS if b.name in selected and b.matches(REPO)]
    servers = [WarmPytest(copy_repo(tmp_path_factory.mktemp(f"breaks-{n}"))) for n in range(JOBS)]
    copies: Queue[WarmPytest] = Queue()
    for warm in servers:
        copies.put(warm)

    def in_a_copy(brk: Break | list[str]) -> Outcome:
        warm = copies.get()
        try:
            return warm.run(brk) if isinstance(brk, list) else apply_and_run(warm, brk)
        finally:
            copies.put(warm)

    by_file: dict[str, set[str]] = {}  # the control runs: a file's named tests at a time
    for t in (t for b in todo for t in b.tests):
        by_file.setdefault(t.split("::")[0], set()).add(t)
    with ThreadPoolExecutor(JOBS) as pool:
        futures = {f"control {f}": pool.submit(in_a_copy, sorted(ts)) for f, ts in by_file.items()}
        futures |= {b.name: pool.submit(in_a_copy, b) for b in todo}
        try:
            yield futures
        finally:
            for future in futures.values():
                future.cancel()
            for warm in servers:
                warm.close()


def test_every_break_matches_todays_code() -> None:
    """A break whose text is no longer in its file tests nothing: fix the break."""
    stale = [f"{b.name} ({b.path})" for b in BREAKS if not b.matches(REPO)]
    assert not stale, f"breaks that no longer match the code: {stale}"


PROBE = """
from pathlib import Path

import spotrain.elastic as e
import spotrain.workflows.job.job_planner as m


def test_spotrain_comes_from_this_copy_as_it_is_now():
    here = Path.cwd().resolve()
    assert Path(m.__file__).resolve().is_relative_to(here)
    assert Path(e.__file__).resolve().is_relative_to(here)
    assert m.PROBE_MARK == {mark}
"""


def test_each_run_imports_the_copys_code_as_it_is_then(tmp_path: Path) -> None:
    """Else every break would run against the working tree's unbroken code, or the first
    break's code would stay for the next."""
    warm = WarmPytest(copy_repo(tmp_path))
    planner = warm.root / "workflows" / "job" / "job_planner.py"
    original = planner.read_text()
    try:
        for mark in (1, 2):
            planner.write_text(f"{original}\nPROBE_MARK = {mark}\n")
            (warm.root / "tests" / "test_probe.py").write_text(PROBE.format(mark=mark))
            outcome = warm.run(["tests/test_probe.py"])
            assert outcome.returncode == 0, outcome.tail
    finally:
        warm.close()


SKIPS = """
import pytest


def test_skips():
    pytest.skip("no control plane here")
"""


def test_a_named_test_that_skips_is_told_from_one_that_passes(tmp_path: Path) -> None:
    """Both exit 0; only the skip can never catch a break (the control run fails on it)."""
    warm = WarmPytest(copy_repo(tmp_path))
    try:
        (warm.root / "tests" / "test_skips.py").write_text(SKIPS)
        outcome = warm.run(["tests/test_skips.py"])
    finally:
        warm.close()
    assert outcome.returncode == 0, outcome.tail
    assert len(outcome.skipped) == 1 and "no control plane here" in outcome.skipped[0], outcome


HANG = """
import asyncio


async def waits_for_ever():
    await asyncio.Event().wait()


async def test_hangs():
    await waits_for_ever()
"""


def test_a_run_that_times_out_says_where_its_test_waits(tmp_path: Path) -> None:
    """A named test that hangs in CI leaves no other trace: its run's tail must show the
    coroutine it waits in, not only the event loop's select."""
    warm = WarmPytest(copy_repo(tmp_path))
    try:
        (warm.root / "tests" / "test_hang.py").write_text(HANG)
        # (forked from the warm server, the run is in the hang within a second or two)
        outcome = warm.run(["tests/test_hang.py"], timeout_s=10)
    finally:
        warm.close()
    assert outcome.returncode == -1, outcome.tail
    assert "in waits_for_ever" in outcome.tail and "in test_hangs" in outcome.tail, outcome.tail


def test_the_named_tests_pass_on_the_unbroken_copy(
    outcomes: dict[str, Future[Outcome]],
) -> None:
    """Pass, not skip: a break whose named test skips (no control plane, say) can never be
    caught, so a skip here fails the harness rather than hiding among the passes."""
    failed = {
        name: outcome.tail if outcome.returncode else f"skipped: {outcome.skipped}"
        for name, future in outcomes.items()
        if name.startswith("control ")
        and ((outcome := future.result()).returncode != 0 or outcome.skipped)
    }
    assert not failed, failed


@pytest.mark.parametrize("brk", BREAKS, ids=[b.name for b in BREAKS])
def test_the_break_is_caught(
    brk: Break, outcomes: dict[str, Future[Outcome]], record_property: pytest.RecordProperty
) -> None:
    if not brk.matches(REPO):
        pytest.fail(f"{brk.name}: its text is not in {brk.path} (see the test above)")
    outcome = outcomes[brk.name].result()
    assert is_caught(brk, outcome), (
        f"{brk.name}: {'SURVIVED' if outcome.returncode == 0 else 'not a clean catch'} "
        f"(exit {outcome.returncode})\n{outcome.tail}"
    )
    line = f"caught  {brk.name:48s} {outcome.seconds:5.1f}s  {outcome.failed[0]}"
    record_property("break_report", line)
