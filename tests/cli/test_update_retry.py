"""A CLI update (`pause`, `scale`, `budget`, ...) while the job's workflow task fails for a
moment: Temporal aborts the update unapplied ("unexpected workflow task failure"), and the
CLI tries it again with the same id until it is applied, once. Seen in CI beside busy loops,
where the SDK failed a task that ran over its 2 s deadlock check on a starved worker. The
`status` query (the CLI's and the demo's) is asked again when that check failed it.

Stood in for: the job. A workflow of this module takes the `pause` update, and its tasks fail
until the test has seen the CLI say it tries again (a cause outside the workflow's state, as a
starved worker is); another fails `status` with the SDK's deadlock message a set number of
times (holding its thread past the check for real left the SDK's eviction of the run waiting
and the test's worker unable to shut down).
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from temporalio import workflow
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from spotrain.workers.cli.support import (
    FAILED,
    STARVED,
    STARVED_TRIES,
    UNREACHABLE,
    CliError,
    query_status,
    rpc_error,
)
from spotrain.workflows.job.state import JobStatus
from tests.workflows.test_placement import state_with

ON_THE_SESSION_LOOP = pytest.mark.asyncio(loop_scope="session")

FAILING = {"now": True}


@workflow.defn(name="FlakyTaskJob", sandboxed=False)
class FlakyTaskJob:
    def __init__(self) -> None:
        self.paused = 0

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.update(name="pause")
    async def pause(self, _: Any) -> str:
        if FAILING["now"]:
            raise RuntimeError("this workflow task fails")  # (not an ApplicationError)
        self.paused += 1
        return "paused"

    @workflow.query
    def times_paused(self) -> int:
        return self.paused


@ON_THE_SESSION_LOOP
@pytest.mark.slow
async def test_an_update_aborted_by_a_failed_workflow_task_is_tried_again(
    dev_env: WorkflowEnvironment,
) -> None:
    queue = name = f"flaky-{uuid.uuid4().hex[:8]}"
    async with Worker(dev_env.client, task_queue=queue, workflows=[FlakyTaskJob]):
        handle = await dev_env.client.start_workflow(
            "FlakyTaskJob", id=name, task_queue=queue, run_timeout=timedelta(minutes=5)
        )
        env = os.environ | {"TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "spotrain.workers.cli.main",
            "pause",
            name,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stderr is not None
            said = (await asyncio.wait_for(proc.stderr.readline(), timeout=90)).decode()
            assert said == f"{name}: its workflow task failed; trying pause again...\n", said
            FAILING["now"] = False
            out, err = await asyncio.wait_for(proc.communicate(), timeout=90)
            told = (proc.returncode, out.decode(), err.decode())
            assert proc.returncode == 0 and f"{name}: paused" in told[1], told
            assert await handle.query("times_paused", result_type=int) == 1
        finally:
            if proc.returncode is None:  # (a failed assertion above: the CLI still retries)
                proc.kill()
                await proc.wait()
            FAILING["now"] = True
            await handle.terminate()


HELD = {"queries": 0}


@workflow.defn(name="StarvedQueryJob", sandboxed=False)
class StarvedQueryJob:
    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: False)

    @workflow.query(name="status")
    def status(self) -> JobStatus:
        HELD["queries"] -= 1
        if HELD["queries"] >= 0:  # (as the SDK words it)
            raise RuntimeError(f"[{STARVED}] Potential deadlock detected: workflow didn't yield")
        return state_with(["us-east-1a"]).status(datetime(2026, 1, 1, tzinfo=UTC))


@ON_THE_SESSION_LOOP
@pytest.mark.slow
async def test_a_status_query_failed_by_a_starved_worker_is_asked_again(
    dev_env: WorkflowEnvironment,
) -> None:
    """Failed twice with "[TMPRL1101] Potential deadlock detected" (a demo run at load 20
    ended in that traceback), the query is asked again and the third answers. Failed every
    time, it gives up after STARVED_TRIES with the CLI's message."""
    queue = name = f"starved-{uuid.uuid4().hex[:8]}"
    async with Worker(dev_env.client, task_queue=queue, workflows=[StarvedQueryJob]):
        handle = await dev_env.client.start_workflow(
            "StarvedQueryJob", id=name, task_queue=queue, run_timeout=timedelta(minutes=5)
        )
        try:
            HELD["queries"] = 2
            status = await query_status(handle)
            assert status.name.startswith("job-") and HELD["queries"] == -1
            HELD["queries"] = STARVED_TRIES
            with pytest.raises(CliError, match=r"cannot answer `status`: .*TMPRL1101"):
                await query_status(handle)
            assert HELD["queries"] == 0
        finally:
            await handle.terminate()


def test_a_call_that_timed_out_says_so_and_exits_3() -> None:
    """A starved worker or server answers too late, and the client gives up with CANCELLED
    "Timeout expired" (a CI run's `spotrain status` said "Temporal refused: Timeout expired",
    which no server had said): that is "did not answer in time", exit 3, as for a server that
    cannot be reached. Any other CANCELLED is still the server's answer."""
    late = rpc_error(RPCError("Timeout expired", RPCStatusCode.CANCELLED, b""), "my-job")
    assert late.code == UNREACHABLE
    assert str(late).startswith("Temporal did not answer in time (Timeout expired)"), late
    other = rpc_error(RPCError("operation was canceled", RPCStatusCode.CANCELLED, b""), None)
    assert (other.code, str(other)) == (FAILED, "Temporal refused: operation was canceled")
