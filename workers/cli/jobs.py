"""`spotrain` commands that start and steer jobs: submit (with `--resume` and `--wait`), scale,
pause, resume, budget, cancel, and reclaim (a simulated spot notice sent through the webhook,
the path real notices take). Each is a workflow start, update or cancel.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import urllib.error
import urllib.parse
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

from spotrain.elastic.job_store import JobStore
from spotrain.workers.cli.report import print_report
from spotrain.workers.cli.spec_file import SpecFileError, load_data
from spotrain.workers.cli.support import (
    FAILED,
    OK,
    RPC_TIMEOUT,
    USAGE,
    CliError,
    build_report,
    client,
    err,
    execute_update,
    is_running,
    job,
    out,
    query_status,
    runs,
)
from spotrain.workflows.capacity.pool import pool_workflow_id
from spotrain.workflows.contract import Empty, ScaleIn, ScaleOut, SetBudget
from spotrain.workflows.job import attributes
from spotrain.workflows.job.state import JobResult, Phase
from spotrain.workflows.spec import SpecError, parse_spec


def load_spec(path: Path) -> dict[str, Any]:
    """The validated spec as the workflow's JSON input; every bad field named (exit 2)."""
    try:
        data = load_data(path)
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror}", USAGE) from None
    except SpecFileError as e:
        raise CliError(f"{path}: {e}", USAGE) from None
    try:
        spec = parse_spec(data)
    except SpecError as e:
        raise CliError(f"{path}: {e}", USAGE) from None
    return spec.model_dump(mode="json", exclude_unset=True)


async def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec(args.file)
    name = spec["name"]
    c = await client()
    pool = (spec.get("pool") or {}).get("name")
    if pool and not await runs(c, pool_workflow_id(pool)):
        raise CliError(
            f"{args.file}: no capacity pool named {pool!r} runs: `spotrain pool create {pool}`"
        )
    if args.resume:
        reopen(spec)
    try:
        handle = await c.start_workflow(
            "TrainingJob",
            spec,
            id=name,
            # A name is one job: a finished job's name is taken unless the user resumes it.
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE
            if args.resume
            else WorkflowIDReusePolicy.REJECT_DUPLICATE,
            task_queue=args.task_queue,
            result_type=JobResult,
            search_attributes=attributes.at_start(name),
            static_summary=f"training job {name}: {spec['total_steps']} steps",
        )
    except WorkflowAlreadyStartedError:
        if await runs(c, name):
            raise CliError(
                f"a job named {name!r} is already running: choose another name, or "
                f"`spotrain cancel {name}` first"
            ) from None
        raise CliError(
            f"a job named {name!r} already ran (`spotrain report {name}`): a name is one job. "
            f"`spotrain submit {args.file} --resume` continues it from its checkpoints "
            "(raise total_steps to train further); for a fresh run, choose another name"
        ) from None
    err.print(f"submitted {name} on task queue {args.task_queue}")
    if not args.wait:
        err.print(f"watch it: spotrain status {name} --watch")
        return OK
    return await wait_for(handle, args.interval)


def reopen(spec: dict[str, Any]) -> None:
    """`--resume`: a job that finished left its done marker at its checkpoint location; remove
    it so that the new run's ranks train on from the latest checkpoint to `total_steps`."""
    location = spec["checkpoint"]
    try:
        store = JobStore(location)
        latest, done = store.latest_checkpoint(), store.done()
    except Exception as e:  # any store error: say where and why, never a traceback
        raise CliError(f"cannot read the checkpoints at {location}: {e}") from None
    if done is not None and done.get("step", 0) >= spec["total_steps"]:
        raise CliError(
            f"the job at {location} already trained {done['step']} steps: raise total_steps "
            f"(now {spec['total_steps']}) to train further",
            USAGE,
        )
    if done is not None:
        store.reopen()
    step = (latest or {}).get("step")
    err.print(f"resuming from the checkpoint at step {step}" if step else "no checkpoint yet")


async def wait_for(handle: WorkflowHandle[Any, Any], interval: float) -> int:
    """Live progress until the job ends; 0 if it succeeded."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    with Progress(*columns, TimeElapsedColumn(), console=err) as progress:
        bar = progress.add_task(handle.id, total=None)
        while await is_running(handle):
            try:
                s = await query_status(handle)
            except CliError:  # no worker has picked it up yet
                s = None
            if s is not None:
                progress.update(
                    bar,
                    total=s.total_steps,
                    completed=s.step,
                    description=f"{s.name} {s.phase} gen {s.generation} world {s.world_size} "
                    f"${s.cost_so_far:,.2f}",
                )
            await asyncio.sleep(interval)
    report = await build_report(handle)
    print_report(report, out)
    return OK if report.phase == Phase.SUCCEEDED else FAILED


async def update(args: argparse.Namespace, name: str, payload: Any) -> int:
    handle = await job(args)
    try:
        message = await execute_update(handle, name, payload)
    except WorkflowUpdateFailedError as e:
        reason = e.cause.message if isinstance(e.cause, ApplicationError) else str(e.cause)
        raise CliError(f"{name} rejected: {reason}") from None
    out.print(f"{args.name}: {message}")
    return FAILED if message.startswith("timed out") else OK


async def cmd_scale(args: argparse.Namespace) -> int:
    if args.timeout is not None and args.out is None:
        raise CliError("--timeout goes with --out", USAGE)
    if args.out is not None:
        if args.timeout is not None:
            err.print(f"waiting up to {args.timeout:g} s for {args.out} more node(s)...")
        return await update(args, "scale_out", ScaleOut(count=args.out, timeout_s=args.timeout))
    if args.in_ is not None:
        return await update(args, "scale_in", ScaleIn(count=args.in_))
    return await update(args, "scale_in", ScaleIn(node_ids=args.node))


async def cmd_pause(args: argparse.Namespace) -> int:
    return await update(args, "pause", Empty())


async def cmd_resume(args: argparse.Namespace) -> int:
    return await update(args, "resume", Empty())


async def cmd_budget(args: argparse.Namespace) -> int:
    return await update(args, "set_budget", SetBudget(usd=args.usd))


async def cmd_cancel(args: argparse.Namespace) -> int:
    handle = await job(args)
    ended = (await handle.describe(rpc_timeout=RPC_TIMEOUT)).status
    if ended != WorkflowExecutionStatus.RUNNING:  # (Temporal would accept the request)
        name = ended.name.lower() if ended else "ended"
        raise CliError(f"{args.name} has ended ({name}): nothing to cancel")
    await handle.cancel(rpc_timeout=RPC_TIMEOUT)
    out.print(f"{args.name}: cancel requested; the job stops its workers and releases its nodes")
    return OK


def webhook_request(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST the plain reclaim form, authenticated the way the webhook is configured."""
    from spotrain.workers.webhook.auth import hmac_headers

    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    token = os.environ.get("SPOTRAIN_WEBHOOK_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    secret = os.environ.get("SPOTRAIN_WEBHOOK_HMAC_SECRET")
    if secret:
        headers.update(hmac_headers(secret, data, "POST", urllib.parse.urlsplit(url).path))
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CliError(
            f"webhook unreachable at {url}: {reason}\n"
            "  start it with `spotrain webhook` (or `spotrain dev`), or set SPOTRAIN_WEBHOOK_URL"
        ) from None


async def cmd_reclaim(args: argparse.Namespace) -> int:
    """A simulated cloud notice through the same path real ones take: the webhook."""
    s = await query_status(await job(args))
    if s.phase.is_final:
        raise CliError(f"{args.name} has ended ({s.phase}): it holds no node to reclaim")
    alive = {n.node_id for n in s.nodes if n.state.is_alive}
    if args.node not in alive:
        raise CliError(
            f"{args.node} is not a live node of {args.name}; its nodes: "
            + (", ".join(sorted(n for n in alive if n)) or "none")
        )
    body: dict[str, Any] = {"instance_id": args.node, "event_id": f"cli-{uuid.uuid4()}"}
    if args.no_notice:
        body["lost"] = True
    else:
        body["deadline"] = (datetime.now(UTC) + timedelta(seconds=args.deadline_s)).isoformat()
    url = os.environ.get("SPOTRAIN_WEBHOOK_URL", "http://127.0.0.1:8080").rstrip("/")
    status, answer = webhook_request(url + "/v1/reclaims", body)
    if status == 200 and args.name in answer.get("workflow_ids", []):
        what = "node lost" if args.no_notice else f"reclaim notice ({args.deadline_s:g}s)"
        out.print(f"{args.name}: {what} for {args.node} delivered (event {body['event_id']})")
        return OK
    if status == 401:
        raise CliError("the webhook rejected the request: set SPOTRAIN_WEBHOOK_TOKEN")
    raise CliError(f"the webhook did not deliver the notice to {args.name}: {status} {answer}")
