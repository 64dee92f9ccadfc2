"""The chaos suite's own Temporal dev server (killable, SQLite-backed) and scratch space.
CHAOS_KEEP=1 keeps the scratch space (server and worker logs, step records) for a post-mortem.
Whatever a scenario started is stopped when it ends, passed or failed. A scenario that fails
shows the end of the dev server's log in its report (a CI run's scratch space is gone by the
time anyone reads it)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from tests.chaos.harness import ChaosEnv, TemporalServer, listens
from tests.moto_ec2 import forget_terminated_instances

LOG_TAIL_BYTES = 20_000


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    env = getattr(item, "funcargs", {}).get("chaos_env")
    if report.failed and isinstance(env, ChaosEnv):
        server = env.server
        serving = server.proc is not None and listens(server.proc.pid, server.port)
        with server.log.open("rb") as f:
            f.seek(max(0, server.log.stat().st_size - LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace")
        head = f"{server.address}, pid {server.proc and server.proc.pid}, listening: {serving}"
        report.sections.append(
            (f"chaos dev server log, last {LOG_TAIL_BYTES} bytes", f"{head}\n{tail}")
        )
    return report


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def chaos_session(moto_endpoint: str) -> AsyncIterator[ChaosEnv]:
    root = Path(tempfile.mkdtemp(prefix="spotrain-chaos-"))
    server = TemporalServer(root / "temporal.db", root / "temporal.log")
    server.start()
    env = ChaosEnv(server, await server.client(), moto_endpoint, root)
    try:
        yield env
    finally:
        await env.clean_up()
        server.kill()
        if os.environ.get("CHAOS_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="session")
async def chaos_env(chaos_session: ChaosEnv) -> AsyncIterator[ChaosEnv]:
    """The session's environment for one scenario: what the scenario starts (workers, jobs,
    their ranks) is stopped when it ends, however it ends (a failed `until` never reaches
    `supervise`, which stops the worker). Earlier tests' terminated instances are forgotten, as
    EC2 forgets them, so that a late scenario's moto is as quick as an early one's."""
    forget_terminated_instances()
    mark = chaos_session.mark()
    yield chaos_session
    if stopped := await chaos_session.clean_up(mark):
        logging.getLogger(__name__).warning("stopped what the scenario left: %s", stopped)
