"""The activities as the TrainingJob workflow calls them: one typed function each, with its
timeouts and retries, under the name the worker registers (`contract`). Call from workflow
code only.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception
from temporalio.workflow import ActivityCancellationType, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.contract import (
        CHECK_CHECKPOINT,
        CLEANUP_JOB,
        DESCRIBE_NODES,
        FIND_OFFERS,
        LAUNCH_NODE,
        NON_RETRYABLE_ERRORS,
        PREPARE_GENERATION,
        RELEASE_NODES,
        START_GENERATION,
        STOP_GENERATION,
        WATCH_GENERATION,
        CleanupRequest,
        DescribeRequest,
        GenerationPlan,
        LaunchRequest,
        NodeInfo,
        Offer,
        ReleaseRequest,
        StopRequest,
        StopResult,
        WatchRequest,
        WatchResult,
    )
    from spotrain.workflows.spec import SpotPolicy

# A dead worker's attempt is retried when its heartbeat (or a quick call's deadline) lapses:
# these bound how long a controller crash can stall a job. Activities heartbeat every <= 5 s.
HEARTBEAT = timedelta(seconds=20)
QUICK_CALL = timedelta(seconds=30)
QUICK = RetryPolicy(maximum_attempts=5, maximum_interval=timedelta(seconds=10))
PERSISTENT = RetryPolicy(maximum_interval=timedelta(seconds=30))
# Read-only calls that answer at once (no heartbeat): a failure costs one round, nothing more.
QUICK_READ: dict[str, Any] = {"timeout": QUICK_CALL, "retry": QUICK, "heartbeat": None}
LAUNCH_RETRY = RetryPolicy(  # maximum_attempts: the spec's elastic.max_launch_attempts
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=list(NON_RETRYABLE_ERRORS),
)


def error_type(err: ActivityError) -> str | None:
    """The typed error an activity raised (`CAPACITY_ERROR`...), if any."""
    cause = err.cause
    return cause.type if isinstance(cause, ApplicationError) else None


async def _run(
    name: str,
    arg: Any,
    summary: str,
    result_type: Any = None,
    *,
    timeout: timedelta,
    retry: RetryPolicy = PERSISTENT,
    heartbeat: timedelta | None = HEARTBEAT,
) -> Any:
    return await workflow.execute_activity(
        name,
        arg,
        result_type=result_type,
        start_to_close_timeout=timeout,
        heartbeat_timeout=heartbeat,
        retry_policy=retry,
        summary=summary,
    )


async def launch_node(req: LaunchRequest, summary: str, attempts: int) -> NodeInfo:
    long = timedelta(minutes=15)
    retry = dataclasses.replace(LAUNCH_RETRY, maximum_attempts=attempts)
    return await _run(LAUNCH_NODE, req, summary, NodeInfo, timeout=long, retry=retry)


async def release_nodes(req: ReleaseRequest, summary: str) -> list[str]:
    """The ids released (all confirmed gone)."""
    return await _run(RELEASE_NODES, req, summary, list[str], timeout=timedelta(minutes=5))


async def find_offers(spot: SpotPolicy) -> list[Offer]:
    summary = "find spot pools that can serve now"
    return await _run(FIND_OFFERS, spot, summary, list[Offer], **QUICK_READ)


async def describe_nodes(req: DescribeRequest, summary: str) -> list[NodeInfo]:
    return await _run(DESCRIBE_NODES, req, summary, list[NodeInfo], **QUICK_READ)


async def check_checkpoint(uri: str) -> None:
    """Retried while the store is only unreachable (nothing is billed yet); a ConfigError
    (refused, or a finished job's location) is not retried."""
    summary = "check the checkpoint location before buying nodes"
    await _run(CHECK_CHECKPOINT, uri, summary, timeout=QUICK_CALL, heartbeat=None)


async def start_generation(plan: GenerationPlan, summary: str) -> None:
    await _run(START_GENERATION, plan, summary, timeout=timedelta(minutes=15), retry=QUICK)


async def prepare_generation(plan: GenerationPlan, summary: str) -> None:
    """Live resize: the next generation's new ranks start while the running one trains on.
    Only a head start: if it fails, `start_generation` starts them."""
    try:
        await _run(PREPARE_GENERATION, plan, summary, timeout=timedelta(minutes=5), retry=QUICK)
    except ActivityError as err:
        if is_cancelled_exception(err):
            raise
        workflow.logger.warning(f"{plan.job}: generation {plan.generation}, no head start: {err}")


def watch_generation(req: WatchRequest, summary: str) -> ActivityHandle[WatchResult]:
    return workflow.start_activity(
        WATCH_GENERATION,
        req,
        result_type=WatchResult,
        start_to_close_timeout=timedelta(seconds=req.report_after_s + 300),
        heartbeat_timeout=HEARTBEAT,
        retry_policy=PERSISTENT,
        # Read-only: when the generation is stopped the watch is simply left to end.
        cancellation_type=ActivityCancellationType.ABANDON,
        summary=summary,
    )


async def stop_generation(req: StopRequest, summary: str) -> StopResult:
    timeout = timedelta(seconds=req.grace_s + 120)
    return await _run(STOP_GENERATION, req, summary, StopResult, timeout=timeout)


async def cleanup_job(req: CleanupRequest, summary: str) -> None:
    await _run(CLEANUP_JOB, req, summary, timeout=timedelta(minutes=5))
