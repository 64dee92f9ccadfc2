"""The activities as the TrainingJob workflow calls them: one typed function each, with its
timeouts and retries, under the name the worker registers (`contract`). Call from workflow
code only.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType, ActivityHandle

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows import contract
    from spotrain.workflows.contract import (
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
LAUNCH_RETRY = RetryPolicy(
    maximum_attempts=20,
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=list(contract.NON_RETRYABLE_ERRORS),
)


def error_type(err: ActivityError) -> str | None:
    """The typed error an activity raised (`contract.CAPACITY_ERROR`...), if any."""
    cause = err.cause
    return cause.type if isinstance(cause, ApplicationError) else None


async def launch_node(req: LaunchRequest, summary: str) -> NodeInfo:
    return await workflow.execute_activity(
        contract.LAUNCH_NODE,
        req,
        result_type=NodeInfo,
        start_to_close_timeout=timedelta(minutes=15),
        heartbeat_timeout=HEARTBEAT,
        retry_policy=LAUNCH_RETRY,
        summary=summary,
    )


async def release_nodes(req: ReleaseRequest, summary: str) -> None:
    await workflow.execute_activity(
        contract.RELEASE_NODES,
        req,
        start_to_close_timeout=timedelta(minutes=5),
        heartbeat_timeout=HEARTBEAT,
        retry_policy=PERSISTENT,
        summary=summary,
    )


async def find_offers(spot: SpotPolicy) -> list[Offer]:
    return await workflow.execute_activity(
        contract.FIND_OFFERS,
        spot,
        result_type=list[Offer],
        start_to_close_timeout=QUICK_CALL,
        retry_policy=QUICK,
        summary="find spot pools that can serve now",
    )


async def describe_nodes(req: DescribeRequest, summary: str) -> list[NodeInfo]:
    return await workflow.execute_activity(
        contract.DESCRIBE_NODES,
        req,
        result_type=list[NodeInfo],
        start_to_close_timeout=QUICK_CALL,
        retry_policy=QUICK,
        summary=summary,
    )


async def start_generation(plan: GenerationPlan, summary: str) -> None:
    await workflow.execute_activity(
        contract.START_GENERATION,
        plan,
        start_to_close_timeout=timedelta(minutes=15),
        heartbeat_timeout=HEARTBEAT,
        retry_policy=QUICK,
        summary=summary,
    )


def watch_generation(req: WatchRequest, summary: str) -> ActivityHandle[WatchResult]:
    return workflow.start_activity(
        contract.WATCH_GENERATION,
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
    return await workflow.execute_activity(
        contract.STOP_GENERATION,
        req,
        result_type=StopResult,
        start_to_close_timeout=timedelta(seconds=req.grace_s + 120),
        heartbeat_timeout=HEARTBEAT,
        retry_policy=PERSISTENT,
        summary=summary,
    )


async def cleanup_job(req: CleanupRequest, summary: str) -> None:
    await workflow.execute_activity(
        contract.CLEANUP_JOB,
        req,
        start_to_close_timeout=timedelta(minutes=5),
        heartbeat_timeout=HEARTBEAT,
        retry_policy=PERSISTENT,
        summary=summary,
    )
