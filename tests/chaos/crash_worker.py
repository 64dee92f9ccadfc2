"""The spotrain Temporal worker with crash points: it SIGKILLs itself at one chosen point.

    CHAOS_CRASH=before:launch_node python -m tests.chaos.crash_worker --provider ec2 ...

Points (CHAOS_CRASH):
    before:<activity> / after:<activity>   an activity boundary: before the activity runs, or
                                           after it returned but before Temporal heard of it
    api:<Operation>                        an EC2 call returned (e.g. api:RunInstances), the
                                           activity has not completed
    some-ranks-started                     rank 0 of a generation started, the others not yet
    elastic-event-raised                   the control file is written, no rank acked yet

It fires once, only after the file CHAOS_ARM exists (so a test can aim at one phase of a job),
and writes the point to CHAOS_FIRED first so the test knows the crash happened there. The
hooks live here, not in production code; the worker otherwise is the real one.
"""

from __future__ import annotations

import asyncio
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import botocore.client
from temporalio import activity
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
)

from spotrain.activities import local
from spotrain.workers.connect import connect
from spotrain.workers.worker import build_activities, parser, workflow_worker

POINT = os.environ.get("CHAOS_CRASH", "")


def crash_at(point: str) -> None:
    """SIGKILL this process if `point` is the chosen one and the test armed it."""
    arm = os.environ.get("CHAOS_ARM")
    if point != POINT or not arm or not Path(arm).exists():
        return
    Path(os.environ["CHAOS_FIRED"]).write_text(point)
    os.kill(os.getpid(), signal.SIGKILL)


class _Activities(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        name = activity.info().activity_type
        crash_at(f"before:{name}")
        result = await self.next.execute_activity(input)
        crash_at(f"after:{name}")
        return result


class CrashInterceptor(Interceptor):
    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Activities(next)


def _install_mid_activity_hooks() -> None:
    """Wrap the three places a mid-activity crash is aimed at (this process only)."""
    api_call = botocore.client.BaseClient._make_api_call

    def make_api_call(self: Any, operation: str, params: Any) -> Any:
        response = api_call(self, operation, params)
        crash_at(f"api:{operation}")
        return response

    launch = local.LocalRuntime._launch

    def launch_rank(self: Any, r: local.Rank, *args: Any) -> None:
        launch(self, r, *args)
        if r.rank == 0:
            crash_at("some-ranks-started")

    write_atomic = local._write_atomic

    def write(path: Path, text: str) -> None:
        write_atomic(path, text)
        if path.name == "control":
            crash_at("elastic-event-raised")

    botocore.client.BaseClient._make_api_call = make_api_call  # type: ignore[method-assign]
    local.LocalRuntime._launch = launch_rank  # type: ignore[method-assign]
    local._write_atomic = write


async def main() -> None:
    args = parser().parse_args()
    _install_mid_activity_hooks()
    activities = build_activities(args.provider, args.runtime, args.state_dir)
    client = await connect()
    with ThreadPoolExecutor(max_workers=64) as pool:
        async with workflow_worker(
            client,
            args.task_queue,
            activities,
            activity_executor=pool,
            interceptors=[CrashInterceptor()],
        ):
            await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
