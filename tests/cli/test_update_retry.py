"""A CLI update (`pause`, `scale`, `budget`, ...) while the job's workflow task fails for a
moment: Temporal aborts the update unapplied ("unexpected workflow task failure"), and the
CLI tries it again with the same id until it is applied, once. Seen in CI beside busy loops,
where the SDK failed a task that ran over its 2 s deadlock check on a starved worker.

Stood in for: the job. A workflow of this module takes the `pause` update, and its tasks fail
until the test has seen the CLI say it tries again (a cause outside the workflow's state, as a
starved worker is).
"""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from datetime import timedelta
from typing import Any

import pytest
from temporalio import workflow
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

pytestmark = pytest.mark.asyncio(loop_scope="session")

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
