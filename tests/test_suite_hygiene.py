"""The suite's own settings (tests/conftest.py): hypothesis keeps no wall-clock deadline, a
failing `==` on a long list explains itself in a few lines, no shared fixture outlives
the tests that use it, and a long wait on the time-skipping server is not cut off."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from temporalio.api.testservice.v1 import LockTimeSkippingRequest, SleepRequest
from temporalio.client import Client
from temporalio.service import KeepAliveConfig, RPCError
from temporalio.testing import WorkflowEnvironment

from tests.assert_diff import MAX_RUNS
from tests.durations import durations, timeline
from tests.jobs import unpinged_client


@settings(max_examples=2)
@given(st.just(0))  # (nothing to shrink: a deadline fails it at once)
def test_a_slow_example_is_not_a_failure(n: int) -> None:
    """An example slower than hypothesis' default 200 ms deadline, as a loaded machine makes
    any: it must not fail the test (SPOTRAIN_HYPOTHESIS_PROFILE=timed makes it fail)."""
    time.sleep(0.25)


def failure_of(left: object, right: object) -> str:
    with pytest.raises(AssertionError) as caught:
        assert left == right
    return str(caught.value)


def test_a_long_list_that_differs_says_where_in_a_few_lines() -> None:
    consumed = [f"sample-{i:04d}" for i in range(2000)]
    expected = list(consumed)
    del consumed[1700:1717]  # one rank's share of one step never consumed
    consumed[40] = "sample-9999"
    message = failure_of(consumed, expected)
    assert len(message.splitlines()) <= 8 and "truncated" not in message, message
    assert "list of 1983 items == list of 2000 items" in message
    assert "0 only on the left, 17 only on the right, 1 changed" in message
    assert "left[40] ['sample-9999'] != right[40] ['sample-0040']" in message
    assert "right[1700:1717] not on the left: ['sample-1700'," in message
    assert "... 13 more]" in message


def test_many_runs_are_cut_and_short_lists_keep_pytests_own() -> None:
    left = list(range(100))
    right = [x + 1 if x % 10 == 0 else x for x in left]
    message = failure_of(left, right)
    assert f"... {10 - MAX_RUNS} more runs" in message and "truncated" not in message
    assert "At index 1 diff" in failure_of([0, 1, 2], [0, 2, 2])


def session_fixtures_outside_conftest() -> list[str]:
    """Session-scoped fixtures defined in a module that tests import them from. pytest makes
    each importing module a fixture of its own, run once per module and kept to the end of the
    run: the Kubernetes tests' control plane lived on ten times over in one CI process."""
    found = []
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        if path.name == "conftest.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                for deco in node.decorator_list:
                    scopes = [
                        k.value.value
                        for k in getattr(deco, "keywords", [])
                        if k.arg == "scope" and isinstance(k.value, ast.Constant)
                    ]
                    if scopes == ["session"]:
                        found.append(f"{path.name}:{node.name}")
    return found


def test_session_fixtures_live_in_conftest_files() -> None:
    assert session_fixtures_outside_conftest() == []


async def test_a_long_silent_call_to_the_time_skipping_server_survives(
    ts_env: WorkflowEnvironment,
) -> None:
    """tests/jobs.py's `skip` waits in one silent call. The test server closes a connection
    whose client pings more often than every 5 minutes during a call (the third ping), so a
    client pinging every 0.5 s fails within seconds, as the SDK's 30 s pings failed a skip
    that lasted 90 s; the client `skip` uses sends none."""
    await ts_env.client.test_service.lock_time_skipping(LockTimeSkippingRequest())
    wait = SleepRequest()
    wait.duration.FromTimedelta(timedelta(seconds=4))  # in real time: skipping is locked
    target = ts_env.client.service_client.config.target_host
    pinging = await Client.connect(target, keep_alive_config=KeepAliveConfig(500, 10_000))
    with pytest.raises(RPCError):
        await pinging.test_service.sleep(wait, timeout=timedelta(seconds=30))
    quiet = await unpinged_client(ts_env)
    assert quiet.service_client.config.keep_alive_config is None  # (90 s to show it fails)
    started = time.monotonic()
    await quiet.test_service.sleep(wait, timeout=timedelta(seconds=30))
    assert time.monotonic() - started >= 3.9


REAPS_AT_THE_END = """
import subprocess, sys

import pytest

from tests.conftest import pytest_runtest_setup, pytest_runtest_teardown


@pytest.fixture(scope="session")
def server():
    yield
    subprocess.run([sys.executable, "-c", "sum(range(60_000_000))"], check=True)
"""


def test_the_cpu_reaped_at_a_test_process_end_is_no_tests(tmp_path: Path) -> None:
    """The last test's teardown ends the shared servers and reaps a whole run's CPU: that is
    recorded apart (`session_end_cpu_s`), not as the last test's `cpu_s`. And the run's
    timeline: one test process, its tests' time (a 0.3 s sleep in one) within its span."""
    (tmp_path / "conftest.py").write_text(REAPS_AT_THE_END)
    tests = "import time\n\n\ndef test_a(server):\n    pass\n\n\n"
    tests += "def test_b():\n    time.sleep(0.3)\n"
    (tmp_path / "test_two.py").write_text(tests)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "--junitxml=report.xml"],
        cwd=tmp_path,
        # (not an xdist worker, though it runs in one: no PYTEST_XDIST_WORKER to inherit)
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
        | {"PYTHONPATH": str(Path(__file__).resolve().parents[1])},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    cpu = durations(tmp_path / "report.xml", "cpu_s")
    ends = durations(tmp_path / "report.xml", "session_end_cpu_s")
    assert len(cpu) == 2 and max(cpu.values()) < 0.3 < sum(ends.values()), (cpu, ends)
    ((worker, (first, last, busy)),) = timeline(tmp_path / "report.xml").items()
    assert worker == "main" and first == 0 and 0.3 <= busy <= last + 0.02, (first, last, busy)
