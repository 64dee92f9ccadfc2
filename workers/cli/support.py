"""What every `spotrain` command shares: exit codes, the two consoles, `CliError`, and the
Temporal calls (connect, ask a job for its status, tell a running workflow from a finished or
unknown one, build a report). The command modules import these and never each other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from rich.console import Console
from temporalio.api.enums.v1 import EventType
from temporalio.api.failure.v1 import Failure
from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest
from temporalio.client import (
    Client,
    WorkflowExecutionDescription,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
)
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from spotrain.workers.cli.report import Report
from spotrain.workers.connect import Unreachable, connect
from spotrain.workflows.job import attributes
from spotrain.workflows.job.state import JobResult, JobStatus, TimelineEntry
from spotrain.workflows.spec import NAME_PATTERN

OK, FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3
JOB_FAILED = "JobFailed"  # the workflow's failure type; details[0] is the JobResult
RPC_TIMEOUT = timedelta(seconds=15)
STUCK_ATTEMPT = 2  # the workflow task failed (or timed out) at least once and is retried
UPDATE_RETRY_S = 60.0  # how long an update aborted by a failed workflow task is tried again

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class CliError(Exception):
    """An expected failure: printed as one message, the process exits with `code`."""

    def __init__(self, message: str, code: int = FAILED) -> None:
        super().__init__(message)
        self.code = code


def emit_json(value: Any) -> None:
    """Plain JSON on stdout (no colours, no wrapping) for scripts."""
    sys.stdout.write(json.dumps(value, indent=2, default=str) + "\n")


# --- Temporal ------------------------------------------------------------------------------


def unreachable(error: Unreachable) -> CliError:
    return CliError(f"{error}\n  or start a local stack with `spotrain dev`", UNREACHABLE)


async def client() -> Client:
    try:
        return await connect()
    except Unreachable as e:
        raise unreachable(e) from None


def rpc_error(e: RPCError, job: str | None) -> CliError:
    if e.status in (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED):
        return unreachable(Unreachable(e.message))
    if e.status == RPCStatusCode.CANCELLED and "Timeout expired" in e.message:
        # The client's own timeout, not a refusal (a query waits for a worker to answer it).
        return CliError(
            f"Temporal did not answer in time ({e.message}): the server, or the worker that "
            "runs the job, is down or overloaded; try again",
            UNREACHABLE,
        )
    if e.status == RPCStatusCode.NOT_FOUND and job:
        return CliError(f"no running job named {job!r} ({e.message})")
    hint = ""
    if "search attribute" in e.message.lower():
        hint = "\n  register spotrain's search attributes: see docs/cli.md"
    return CliError(f"Temporal refused: {e.message}{hint}")


async def execute_update(handle: WorkflowHandle[Any, Any], name: str, payload: Any) -> str:
    """The update's answer. A workflow task can fail for a moment (the SDK fails one that
    runs over 2 s, as on a starved worker), and Temporal then aborts any update it carried,
    unapplied: tried again, with the same update id, for `UPDATE_RETRY_S`."""
    update_id = f"cli-{name}-{uuid.uuid4().hex}"
    deadline = time.monotonic() + UPDATE_RETRY_S
    while True:
        try:
            return await handle.execute_update(name, payload, id=update_id, result_type=str)
        except RPCError as e:
            if not task_failed(e) or time.monotonic() > deadline:
                raise
            err.print(f"{handle.id}: its workflow task failed; trying {name} again...")
            await asyncio.sleep(1)


def task_failed(e: RPCError) -> bool:
    """Whether Temporal refused an update because the workflow's task failed (the server's
    two wordings: the task failed with the update, or was failing when it came)."""
    message = e.message.lower()
    return "workflow task failure" in message or "workflow task in failed state" in message


async def job(args: argparse.Namespace) -> WorkflowHandle[Any, Any]:
    return (await client()).get_workflow_handle(args.name, result_type=JobResult)


# The SDK fails a query whose workflow code did not yield within 2 s of wall time
# ("[TMPRL1101] Potential deadlock detected"): on a starved machine that is the worker's
# thread waiting for a core, not the job. Such a query is asked again, a few times.
STARVED = "TMPRL1101"
STARVED_TRIES = 5


async def query_status(
    handle: WorkflowHandle[Any, Any], timeout: timedelta = RPC_TIMEOUT
) -> JobStatus:
    tries = STARVED_TRIES
    while True:
        try:
            return await handle.query("status", result_type=JobStatus, rpc_timeout=timeout)
        except WorkflowQueryFailedError as e:
            tries -= 1
            if STARVED not in e.message or tries == 0:
                raise CliError(f"job {handle.id!r} cannot answer `status`: {e.message}") from None
        await asyncio.sleep(1)


async def is_running(handle: WorkflowHandle[Any, Any]) -> bool:
    description = await handle.describe(rpc_timeout=RPC_TIMEOUT)
    return description.status == WorkflowExecutionStatus.RUNNING


async def job_workflow(c: Client, job: str, running: bool) -> WorkflowHandle[Any, Any] | None:
    """The job's workflow (running, or any Temporal still has): by id, as `spotrain submit`
    names it, else the newest that carries the job's name as SpotrainJob, as the operator's
    `k8s/<namespace>/<name>/<uid>` ids do (its jobs' tags and labels hold the name, not the
    id). None for a job Temporal never heard of."""
    handle = c.get_workflow_handle(job)
    try:
        description = await handle.describe(rpc_timeout=RPC_TIMEOUT)
        if not running or description.status == WorkflowExecutionStatus.RUNNING:
            return handle
    except RPCError as e:
        if e.status != RPCStatusCode.NOT_FOUND:
            raise
    if not re.fullmatch(NAME_PATTERN, job):  # (a tag no job wrote: nothing to ask)
        return None
    query = f"{attributes.JOB.name} = '{job}'"
    query += " AND ExecutionStatus = 'Running'" if running else ""
    async for wf in c.list_workflows(query, limit=1, rpc_timeout=RPC_TIMEOUT):
        return c.get_workflow_handle(wf.id)
    return None


async def runs(c: Client, job: str) -> bool:
    """Whether the job (or pool: its workflow id) runs now."""
    return await job_workflow(c, job, running=True) is not None


async def known(c: Client, job: str) -> bool:
    """Whether Temporal still has the job's workflow (running, or finished within retention)."""
    return await job_workflow(c, job, running=False) is not None


async def build_report(handle: WorkflowHandle[Any, Any]) -> Report:
    """Running: the `status` query. Finished: the result (a failed job carries it in its
    failure's details). Cancelled or terminated: the query, answered by replaying history."""
    if await is_running(handle):
        return Report.from_status(await full_status(handle))
    try:
        return Report.from_result(await handle.result())
    except WorkflowFailureError as e:
        cause = e.cause
        if isinstance(cause, ApplicationError) and cause.type == JOB_FAILED and cause.details:
            return Report.from_result(JobResult.model_validate(cause.details[0]))
    return Report.from_status(await full_status(handle))


async def full_status(handle: WorkflowHandle[Any, Any]) -> JobStatus:
    """`status` with the whole timeline kept, not only its last 20 events."""
    status = await query_status(handle)
    timeline = await handle.query(
        "timeline", result_type=list[TimelineEntry], rpc_timeout=RPC_TIMEOUT
    )
    return status.model_copy(update={"timeline": timeline})


# --- stuck jobs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Stuck:
    """A running job whose workflow task keeps failing: the workflow cannot move, answer
    queries or run its own cleanup, while it may still hold nodes."""

    attempt: int
    since: datetime | None
    error: str

    def line(self, name: str) -> str:
        since = f" since {self.since:%Y-%m-%d %H:%M:%S} UTC" if self.since else ""
        return (
            f"{name} is STUCK: its workflow task fails and is retried (attempt {self.attempt}"
            f"{since}): {self.error}\n  `spotrain release {name}` terminates it and releases "
            "its nodes"
        )

    def as_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "since": self.since, "error": self.error}


def failure_text(failure: Failure) -> str:
    """The failure's message and its causes' on one line (no stack traces)."""
    parts = []
    while failure.message and len(parts) < 4:
        parts.append(failure.message.splitlines()[0])
        if not failure.HasField("cause"):
            break
        failure = failure.cause
    return ": ".join(parts)[:500] or "no message"


async def stuck(c: Client, description: WorkflowExecutionDescription) -> Stuck | None:
    """Temporal's pending workflow task info says how often the task was tried; the failure is
    the last workflow task failure recorded (retries after the first are not written to the
    history, so the newest page of it, read backwards, holds it)."""
    task = description.raw_description.pending_workflow_task
    if description.status != WorkflowExecutionStatus.RUNNING or task.attempt < STUCK_ATTEMPT:
        return None
    page = await c.workflow_service.get_workflow_execution_history_reverse(
        GetWorkflowExecutionHistoryReverseRequest(
            namespace=c.namespace,
            execution=description.raw_description.workflow_execution_info.execution,
            maximum_page_size=50,
        ),
        timeout=RPC_TIMEOUT,
    )
    error = "the workflow task timed out"
    for event in page.history.events:
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            error = failure_text(event.workflow_task_failed_event_attributes.failure)
            break
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT:
            break
    since = task.original_scheduled_time
    return Stuck(task.attempt, since.ToDatetime() if since.seconds else None, error)
