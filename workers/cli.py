"""`spotrain`: start, watch, steer and explain training jobs from a terminal.

Every job is a `TrainingJob` workflow whose id is the job name, so each command is a thin
Temporal call: start, query `status`, updates, cancel, visibility list. Reads take `--json`
for scripts. Exit codes: 0 ok, 1 the operation failed or was rejected, 2 bad usage or invalid
input, 3 Temporal cannot be reached. Expected errors print one clear message, never a
traceback. The process leaves through `os._exit` after flushing: the Temporal client can
abort the interpreter's shutdown (see DESIGN.md, "Process exit").
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from spotrain.elastic.job_store import JobStore
from spotrain.workers.connect import TASK_QUEUE, Unreachable, connect
from spotrain.workers.report import PlotUnavailable, Report, plot, print_report, to_html
from spotrain.workflows import attributes, budget, deadline
from spotrain.workflows.checkpoints import describe
from spotrain.workflows.contract import Empty, ScaleIn, ScaleOut, SetBudget
from spotrain.workflows.pool import POOL_ID_PREFIX, PoolConfig, PoolStatus, pool_workflow_id
from spotrain.workflows.spec import SpecError, describe_errors, parse_spec
from spotrain.workflows.state import JobResult, JobStatus, Phase, TimelineEntry

OK, FAILED, USAGE, UNREACHABLE = 0, 1, 2, 3
PHASES = [p.value for p in Phase]
JOB_FAILED = "JobFailed"  # the workflow's failure type; details[0] is the JobResult
RPC_TIMEOUT = timedelta(seconds=15)

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
    if e.status == RPCStatusCode.NOT_FOUND and job:
        return CliError(f"no running job named {job!r} ({e.message})")
    hint = ""
    if "search attribute" in e.message.lower():
        hint = "\n  register spotrain's search attributes: see docs/cli.md"
    return CliError(f"Temporal refused: {e.message}{hint}")


async def job(args: argparse.Namespace) -> WorkflowHandle[Any, Any]:
    return (await client()).get_workflow_handle(args.name, result_type=JobResult)


async def query_status(handle: WorkflowHandle[Any, Any]) -> JobStatus:
    try:
        return await handle.query("status", result_type=JobStatus, rpc_timeout=RPC_TIMEOUT)
    except WorkflowQueryFailedError as e:
        raise CliError(f"job {handle.id!r} cannot answer `status`: {e.message}") from None


async def is_running(handle: WorkflowHandle[Any, Any]) -> bool:
    description = await handle.describe(rpc_timeout=RPC_TIMEOUT)
    return description.status == WorkflowExecutionStatus.RUNNING


async def runs(c: Client, workflow_id: str) -> bool:
    """Whether a workflow with this id runs now; False for one Temporal never heard of."""
    try:
        return await is_running(c.get_workflow_handle(workflow_id))
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return False
        raise


async def known(c: Client, workflow_id: str) -> bool:
    """Whether Temporal still has this workflow (running, or finished within retention)."""
    try:
        await c.get_workflow_handle(workflow_id).describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return True


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


# --- rendering -----------------------------------------------------------------------------


def status_view(s: JobStatus) -> Group:
    head = (
        f"[bold]{s.name}[/] {s.phase}   generation {s.generation}   world size {s.world_size} "
        f"(target {s.target_nodes} nodes)   step {s.step}/{s.total_steps} "
        f"(checkpoint {s.checkpoint_step})   cost so far ${s.cost_so_far:,.2f}"
        + (f" (budget ${s.budget_usd:,.2f})" if s.budget_usd is not None else "")
        + f"\nreclaims {s.reclaims}   faults {s.faults}   resizes {s.resizes}   "
        f"steps lost {s.steps_lost}"
        + (f"\n[red]{s.failure}[/]" if s.failure else "")
        + (f"\n[yellow]paused: {s.paused_reason}[/]" if s.paused_reason else "")
    )
    if s.checkpoints:
        head += "\n" + describe(s.checkpoints)
    if s.deadline:
        head += "\n" + deadline.describe(s.deadline)
    for f in s.stragglers:
        kind, since = "hung" if f.hung else "slow", f"{f.since:%H:%M:%S}"
        head += f"\n[yellow]{kind} rank {f.rank} on {f.node_id} since {since}: {f.why}[/]"
    nodes = Table("rank", "node", "lifecycle", "type", "zone", "state", "$/h", "reason")
    for n in sorted(s.nodes, key=lambda n: (n.rank is None, n.rank or 0, n.slot)):
        nodes.add_row(
            "-" if n.rank is None else str(n.rank),
            n.node_id or f"(slot {n.slot})",
            n.lifecycle,
            n.instance_type,
            n.zone or "-",
            n.state,
            f"{n.price:.2f}",
            n.reason or "",
        )
    return Group(head, nodes)


# --- commands ------------------------------------------------------------------------------


def load_spec(path: Path) -> dict[str, Any]:
    """The validated spec as the workflow's JSON input; every bad field named (exit 2)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror}", USAGE) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise CliError(f"{path}: not valid {kind}: {e}", USAGE) from None
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
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(attributes.JOB, name),
                    SearchAttributePair(attributes.PHASE, Phase.PENDING.value),
                ]
            ),
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


async def cmd_list(args: argparse.Namespace) -> int:
    query = "WorkflowType = 'TrainingJob' AND ExecutionStatus != 'ContinuedAsNew'"
    if args.phase:
        query += f" AND SpotrainPhase = '{args.phase}'"
    rows = []
    async for wf in (await client()).list_workflows(query, limit=args.limit):
        sa = wf.typed_search_attributes
        rows.append(
            {
                "name": wf.id,
                "phase": sa.get(attributes.PHASE),
                "status": wf.status.name if wf.status else None,
                "world_size": sa.get(attributes.WORLD_SIZE),
                "spot_nodes": sa.get(attributes.SPOT_NODES),
                "on_demand_nodes": sa.get(attributes.ON_DEMAND_NODES),
                "cost": sa.get(attributes.COST),
                "task_queue": wf.task_queue,
                "started": wf.start_time.isoformat(),
            }
        )
    if args.json:
        emit_json(rows)
        return OK
    table = Table("name", "phase", "world", "spot", "on-demand", "cost", "started")
    for r in rows:
        cost = r["cost"]
        table.add_row(
            r["name"],
            r["phase"] or r["status"] or "-",
            *(str(r[k]) if r[k] is not None else "-" for k in ("world_size", "spot_nodes")),
            str(r["on_demand_nodes"]) if r["on_demand_nodes"] is not None else "-",
            "-" if cost is None else f"${cost:,.2f}",
            r["started"][:19],
        )
    out.print(table if rows else "no jobs" + (f" in phase {args.phase}" if args.phase else ""))
    return OK


async def cmd_status(args: argparse.Namespace) -> int:
    handle = await job(args)
    if not args.watch:
        s = await query_status(handle)
        emit_json(s.model_dump(mode="json")) if args.json else out.print(status_view(s))
        return OK
    if args.json:  # one JSON object per line per poll
        while True:
            s = await query_status(handle)
            sys.stdout.write(s.model_dump_json() + "\n")
            sys.stdout.flush()
            if s.phase.is_final:
                return OK
            await asyncio.sleep(args.interval)
    with Live(console=out, auto_refresh=False) as live:
        while True:
            s = await query_status(handle)
            live.update(status_view(s), refresh=True)
            if s.phase.is_final:
                return OK
            await asyncio.sleep(args.interval)


async def update(args: argparse.Namespace, name: str, payload: Any) -> int:
    handle = await job(args)
    try:
        message = await handle.execute_update(name, payload, result_type=str)
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
    await (await job(args)).cancel(rpc_timeout=RPC_TIMEOUT)
    out.print(f"{args.name}: cancel requested; the job stops its workers and releases its nodes")
    return OK


def webhook_request(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST the plain reclaim form, authenticated the way the webhook is configured."""
    from spotrain.workers.webhook_auth import hmac_headers

    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    token = os.environ.get("SPOTRAIN_WEBHOOK_TOKEN")
    if token:
        headers["Authorization"] = f"Bearer {token}"
    secret = os.environ.get("SPOTRAIN_WEBHOOK_HMAC_SECRET")
    if secret:
        headers.update(hmac_headers(secret, data))
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


async def cmd_gc(args: argparse.Namespace) -> int:
    """What terminated jobs left: EC2 instances (by their tags) and the local runtime's rank
    processes (by its state dir). A job counts as running unless Temporal says otherwise, and
    an unreachable Temporal stops gc before anything is reaped."""
    from spotrain.activities.ec2 import EC2Provider
    from spotrain.activities.ec2_ownership import reap
    from spotrain.activities.local import LocalRuntime
    from spotrain.elastic.job_store import reap_checkpoints
    from spotrain.workers.worker import DEFAULT_STATE_DIR

    c = await client()
    loop = asyncio.get_running_loop()

    def job_running(name: str) -> bool:  # asked from the reaper's thread
        return asyncio.run_coroutine_threadsafe(runs(c, name), loop).result(timeout=30)

    def job_known(name: str) -> bool:  # Temporal still has its history (finished or not)
        return asyncio.run_coroutine_threadsafe(known(c, name), loop).result(timeout=30)

    provider = EC2Provider.from_env()
    local = LocalRuntime(args.state_dir or DEFAULT_STATE_DIR)
    try:
        orphans = [
            orphan
            for region in args.region or [provider.region]
            for orphan in await asyncio.to_thread(
                reap, provider.client(region), job_running, args.apply
            )
        ]
        processes = await asyncio.to_thread(local.reap, job_running, args.apply)
        checkpoints = {
            root: await asyncio.to_thread(reap_checkpoints, root, job_known, args.apply)
            for root in args.checkpoints or []
        }
    except RPCError as e:
        raise rpc_error(e, None) from None
    rows = [
        {
            "instance_id": o.instance_id,
            "job": o.job,
            "state": o.state,
            "instance_type": o.instance_type,
            "zone": o.zone,
            "launched": o.launched.isoformat(),
        }
        for o in orphans
    ]
    procs = [{"job": job, "pids": pids} for job, pids in processes.items()]
    if args.json:
        emit_json(
            {"applied": args.apply, "orphans": rows, "processes": procs, "checkpoints": checkpoints}
        )
        return OK
    title = "terminated" if args.apply else "orphans (dry run: --apply to reap)"
    table = Table("instance", "job", "state", "type", "zone", "launched", title=title)
    for r in rows:
        table.add_row(*(str(v) for v in r.values()))
    out.print(table if rows else "no orphaned instances")
    for p in procs:
        pids = ", ".join(map(str, p["pids"]))
        out.print(f"{'killed' if args.apply else 'orphaned'} rank processes of {p['job']}: {pids}")
    for root, jobs in checkpoints.items():
        what = "deleted" if args.apply else "checkpoints of jobs Temporal no longer knows"
        out.print(f"{root}: {what}: {', '.join(jobs) or 'none'}")
    return OK


async def cmd_logs(args: argparse.Namespace) -> int:
    from spotrain.activities.local import LocalRuntime
    from spotrain.workers.worker import DEFAULT_STATE_DIR

    args.state_dir = args.state_dir or DEFAULT_STATE_DIR
    path = LocalRuntime(args.state_dir).log_path(args.name, args.rank, args.generation)
    if not path.exists():
        raise CliError(
            f"no log for {args.name} rank {args.rank} at {path} (local runtime, "
            f"state dir {args.state_dir})"
        )
    with path.open(encoding="utf-8", errors="replace") as f:
        while True:
            sys.stdout.write(f.read())
            sys.stdout.flush()
            if not args.follow:
                return OK
            await asyncio.sleep(0.5)


async def cmd_report(args: argparse.Namespace) -> int:
    report = await build_report(await job(args))
    if args.plot:
        try:
            plot(report, args.plot)
        except PlotUnavailable as e:
            raise CliError(str(e), USAGE) from None
        err.print(f"plot written to {args.plot}")
    if args.html:
        args.html.write_text(to_html(report, args.plot), encoding="utf-8")
        err.print(f"page written to {args.html}")
    if args.json:
        emit_json(report.model_dump(mode="json"))
    else:
        print_report(report, out)
    return OK


# --- capacity pools --------------------------------------------------------------------------

POOL_LIMITS = {
    "max_nodes": int,
    "max_gpus": int,
    "max_on_demand_nodes": int,
    "max_cost_per_hour": float,
}


def pool_config(args: argparse.Namespace, base: dict[str, Any]) -> PoolConfig:
    """`base` (the pool's current settings) with the limits given on the command line."""
    config = dict(base, name=args.name)
    for field in POOL_LIMITS:
        value = getattr(args, field)
        if value is not None:
            config[field] = None if value == "none" else value
    if args.team_budget:
        config["team_budgets"] = {**config.get("team_budgets", {}), **dict(args.team_budget)}
    try:
        return PoolConfig.model_validate(config)
    except ValidationError as e:
        raise CliError(describe_errors(e, "pool settings"), USAGE) from None


async def pool_handle(name: str) -> WorkflowHandle[Any, Any]:
    return (await client()).get_workflow_handle(pool_workflow_id(name))


async def query_pool(handle: WorkflowHandle[Any, Any]) -> PoolStatus:
    name = handle.id.removeprefix(POOL_ID_PREFIX)
    try:
        return await handle.query("status", result_type=PoolStatus, rpc_timeout=RPC_TIMEOUT)
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            raise CliError(
                f"no capacity pool named {name!r}: `spotrain pool create {name}`"
            ) from None
        raise
    except WorkflowQueryFailedError as e:
        raise CliError(f"pool {name!r} cannot answer `status`: {e.message}") from None


async def cmd_pool_create(args: argparse.Namespace) -> int:
    config = pool_config(args, {})
    c = await client()
    try:
        await c.start_workflow(
            "CapacityPool",
            config,
            id=pool_workflow_id(config.name),
            task_queue=args.task_queue,
            static_summary=f"capacity pool {config.name}",
        )
    except WorkflowAlreadyStartedError:
        raise CliError(
            f"a pool named {config.name!r} already runs: change it with `spotrain pool set`"
        ) from None
    out.print(f"pool {config.name} created on task queue {args.task_queue}")
    return OK


async def cmd_pool_set(args: argparse.Namespace) -> int:
    handle = await pool_handle(args.name)
    current = await query_pool(handle)
    config = pool_config(args, current.config.model_dump())
    try:
        message = await handle.execute_update("configure", config, result_type=str)
    except WorkflowUpdateFailedError as e:
        raise CliError(f"configure rejected: {e.cause}") from None
    out.print(message)
    return OK


def pool_view(p: PoolStatus) -> Group:
    c = p.config
    limits = Table("", "in use", "limit", "peak", title=f"pool {c.name}")
    rows = [
        ("nodes", "nodes", c.max_nodes),
        ("GPUs", "gpus", c.max_gpus),
        ("on-demand nodes", "on_demand", c.max_on_demand_nodes),
        ("USD per hour", "cost_per_hour", c.max_cost_per_hour),
    ]
    for label, key, limit in rows:
        limits.add_row(
            label,
            f"{p.usage.get(key, 0):g}",
            "-" if limit is None else f"{limit:g}",
            f"{p.peak.get(key, 0):g}",
        )
    for team, cap in sorted(c.team_budgets.items()):
        limits.add_row(f"team {team} USD/h", "", f"{cap:g}", "")
    jobs = Table("job", "state", "priority", "team", "min..max", "granted", "holding", "progress")
    for j in p.jobs:
        jobs.add_row(
            j.job,
            j.state,
            str(j.priority),
            j.team or "-",
            f"{j.min_nodes}..{j.max_nodes}",
            f"{j.granted} ({j.granted_on_demand} od)",
            f"{j.holding} ({j.holding_on_demand} od)",
            f"{j.progress:.0%}",
        )
    recent = "\n".join(f"{e.time:%H:%M:%S} {e.event:<10} {e.detail}" for e in p.timeline[-8:])
    return Group(limits, jobs if p.jobs else "no jobs", recent)


async def cmd_pool_status(args: argparse.Namespace) -> int:
    p = await query_pool(await pool_handle(args.name))
    emit_json(p.model_dump(mode="json")) if args.json else out.print(pool_view(p))
    return OK


async def cmd_pool_list(args: argparse.Namespace) -> int:
    query = "WorkflowType = 'CapacityPool' AND ExecutionStatus = 'Running'"
    rows = []
    async for wf in (await client()).list_workflows(query):
        rows.append(
            {
                "name": wf.id.removeprefix(POOL_ID_PREFIX),
                "task_queue": wf.task_queue,
                "started": wf.start_time.isoformat(),
            }
        )
    if args.json:
        emit_json(rows)
        return OK
    table = Table("pool", "task queue", "started")
    for r in rows:
        table.add_row(r["name"], r["task_queue"], r["started"][:19])
    out.print(table if rows else "no capacity pools")
    return OK


# --- argument parsing ----------------------------------------------------------------------

Command = Callable[[argparse.Namespace], Awaitable[int]]
DELEGATED = {
    "dev": ("spotrain.workers.stack", "run the local stack: Temporal, moto, worker, webhook"),
    "demo": ("spotrain.workers.demo", "a real elastic training run with reclaims, end to end"),
    "worker": ("spotrain.workers.worker", "run the Temporal worker"),
    "webhook": ("spotrain.workers.webhook", "run the reclaim webhook service"),
}
CONNECTION = (
    "Temporal connection: TEMPORAL_ADDRESS (default localhost:7233), TEMPORAL_NAMESPACE, "
    "TEMPORAL_API_KEY, TLS settings and TEMPORAL_PROFILE, as for the temporal CLI.\n"
    "Exit codes: 0 ok, 1 failed or rejected, 2 bad usage or invalid input, "
    "3 Temporal unreachable."
)


def team_budget(text: str) -> tuple[str, float]:
    team, _, value = text.partition("=")
    try:
        return team, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TEAM=USD_PER_HOUR, got {text!r}") from None


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def usd(text: str) -> float:
    value = float(text)
    if error := budget.set_error(value):
        raise argparse.ArgumentTypeError(error)
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spotrain",
        description="Elastic training on spot capacity, orchestrated by Temporal.",
        epilog="examples:\n  spotrain submit job.yaml --wait\n  spotrain list --phase Running\n"
        "  spotrain status my-job --watch\n\n" + CONNECTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Command, help: str, examples: str) -> argparse.ArgumentParser:
        c = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=f"examples:\n{examples}\n\n{CONNECTION}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.set_defaults(func=func)
        return c

    def named(name: str, func: Command, help: str, examples: str) -> argparse.ArgumentParser:
        c = command(name, func, help, examples)
        c.add_argument("name", help="job name (= workflow id)")
        return c

    c = command(
        "submit",
        cmd_submit,
        "validate a job spec (YAML or JSON) and start it",
        "  spotrain submit job.yaml\n  spotrain submit job.json --wait --task-queue gpu",
    )
    c.add_argument("file", type=Path)
    c.add_argument(
        "--task-queue", default=os.environ.get("SPOTRAIN_TASK_QUEUE", TASK_QUEUE), metavar="Q"
    )
    c.add_argument("--wait", action="store_true", help="show progress until the job ends")
    c.add_argument(
        "--resume",
        action="store_true",
        help="continue a job of this name that ran before, from its checkpoints",
    )
    c.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)

    c = command(
        "list",
        cmd_list,
        "list jobs (visibility query)",
        "  spotrain list\n  spotrain list --phase Running --json",
    )
    c.add_argument("--phase", choices=PHASES)
    c.add_argument("--limit", type=positive, default=100)
    c.add_argument("--json", action="store_true")

    c = named(
        "status",
        cmd_status,
        "a job's nodes, generation, world size, progress and cost so far",
        "  spotrain status my-job\n  spotrain status my-job --watch",
    )
    c.add_argument("--watch", action="store_true", help="refresh until the job ends")
    c.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    c.add_argument("--json", action="store_true", help="with --watch: one object per line")

    c = named(
        "scale",
        cmd_scale,
        "grow or shrink a running job",
        "  spotrain scale my-job --out 2\n  spotrain scale my-job --out 2 --timeout 600\n"
        "  spotrain scale my-job --in 1\n  spotrain scale my-job --node i-0abc i-0def",
    )
    how = c.add_mutually_exclusive_group(required=True)
    how.add_argument("--out", type=positive, metavar="N", help="add N nodes")
    c.add_argument(
        "--timeout",
        type=seconds,
        metavar="S",
        help="with --out: wait for the nodes this long; if they do not come, the target goes "
        "back (exit 1)",
    )
    how.add_argument("--in", dest="in_", type=positive, metavar="N", help="remove N nodes")
    how.add_argument("--node", nargs="+", metavar="ID", help="remove exactly these nodes")

    named("pause", cmd_pause, "checkpoint and release every node", "  spotrain pause my-job")
    named("resume", cmd_resume, "order nodes again and continue", "  spotrain resume my-job")
    c = named(
        "budget",
        cmd_budget,
        "set a job's total spend cap (a job paused at its cap resumes once it is raised)",
        "  spotrain budget my-job --usd 250\n  spotrain budget my-job --usd 400 && "
        "spotrain resume my-job",
    )
    c.add_argument("--usd", type=usd, required=True, metavar="USD", help="the new cap in USD")
    named("cancel", cmd_cancel, "stop a job and release all it owns", "  spotrain cancel my-job")

    c = named(
        "reclaim",
        cmd_reclaim,
        "simulate a spot reclaim notice through the webhook",
        "  spotrain reclaim my-job --node i-0abc\n"
        "  spotrain reclaim my-job --node i-0abc --no-notice\n\n"
        "webhook: SPOTRAIN_WEBHOOK_URL (default http://127.0.0.1:8080), SPOTRAIN_WEBHOOK_TOKEN, "
        "SPOTRAIN_WEBHOOK_HMAC_SECRET",
    )
    c.add_argument("--node", required=True, metavar="ID")
    c.add_argument("--no-notice", action="store_true", help="the node is already gone")
    c.add_argument("--deadline-s", type=float, default=120.0, help="seconds until it is taken")

    c = command(
        "gc",
        cmd_gc,
        "find (and with --apply reap) instances and local rank processes whose job is not running",
        "  spotrain gc\n  spotrain gc --apply --region us-east-1 --region us-west-2",
    )
    c.add_argument("--apply", action="store_true", help="terminate (default: dry run)")
    c.add_argument(
        "--region",
        action="append",
        help="a region to search; repeat for more (default: boto3's, e.g. AWS_REGION)",
    )
    c.add_argument("--state-dir", type=Path, help="local runtime's (default ~/.spotrain)")
    c.add_argument(
        "--checkpoints",
        action="append",
        metavar="URI",
        help="a root holding jobs' stores (<URI>/<job>/...): also reap those of jobs Temporal "
        "no longer knows; repeat for more",
    )
    c.add_argument("--json", action="store_true")

    c = named(
        "logs",
        cmd_logs,
        "a rank's log (local runtime)",
        "  spotrain logs my-job\n  spotrain logs my-job --rank 1 --generation 3 --follow",
    )
    c.add_argument("--rank", type=int, default=0)
    c.add_argument("--generation", type=int, default=None, help="default: the latest")
    c.add_argument("--follow", "-f", action="store_true")
    c.add_argument("--state-dir", type=Path, help="default: the worker's (~/.spotrain)")

    c = named(
        "report",
        cmd_report,
        "timeline and cost of a running or finished job",
        "  spotrain report my-job\n  spotrain report my-job --plot job.png --html job.html",
    )
    c.add_argument("--plot", type=Path, metavar="FILE.png", help="draw it (needs matplotlib)")
    c.add_argument("--html", type=Path, metavar="FILE", help="a shareable page")
    c.add_argument("--json", action="store_true")

    pool = sub.add_parser(
        "pool",
        help="capacity pools: shared quotas, priorities, queueing and budgets",
        description="A pool shares a quota of nodes, GPUs and USD/h among the jobs that name "
        "it in their spec (pool: {name: ...}): higher priority first, FIFO within a priority, "
        "lower-priority elastic jobs shrink gracefully to make room.",
        epilog="examples:\n  spotrain pool create gpus --max-nodes 16 --team-budget vision=20\n"
        "  spotrain pool status gpus\n  spotrain pool set gpus --max-nodes 24\n\n" + CONNECTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pools = pool.add_subparsers(dest="pool_command", required=True, metavar="SUBCOMMAND")

    def pool_command(name: str, func: Command, help: str) -> argparse.ArgumentParser:
        c = pools.add_parser(name, help=help, description=help, epilog=CONNECTION)
        c.set_defaults(func=func)
        return c

    def limits(c: argparse.ArgumentParser) -> None:
        c.add_argument("name", help="pool name (jobs name it in spec.pool.name)")
        for field, kind in POOL_LIMITS.items():
            c.add_argument(
                "--" + field.replace("_", "-"),
                dest=field,
                type=lambda text, kind=kind: text if text == "none" else kind(text),
                metavar="N|none",
                help="'none' lifts the limit",
            )
        c.add_argument(
            "--team-budget",
            action="append",
            type=team_budget,
            metavar="TEAM=USD_PER_HOUR",
            help="cap a team's growth (repeatable)",
        )

    c = pool_command("create", cmd_pool_create, "start a capacity pool with its limits")
    limits(c)
    c.add_argument(
        "--task-queue", default=os.environ.get("SPOTRAIN_TASK_QUEUE", TASK_QUEUE), metavar="Q"
    )
    limits(pool_command("set", cmd_pool_set, "change a pool's limits (others are kept)"))
    c = pool_command("status", cmd_pool_status, "usage against limits, and the pool's jobs")
    c.add_argument("name")
    c.add_argument("--json", action="store_true")
    c = pool_command("list", cmd_pool_list, "running capacity pools")
    c.add_argument("--json", action="store_true")

    for name, (_, help) in DELEGATED.items():
        c = sub.add_parser(name, help=help, add_help=False)
        c.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def delegate(command: str, rest: list[str]) -> int:
    """Hand the remaining arguments (`--help` too) to the command's own module, imported only
    now; its exit status is the command's."""
    try:
        importlib.import_module(DELEGATED[command][0]).main(rest)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (OK if e.code is None else USAGE)
    return OK


def run(argv: list[str]) -> int:
    if argv and argv[0] in DELEGATED:
        return delegate(argv[0], argv[1:])
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0), bad usage (2)
        return e.code if isinstance(e.code, int) else USAGE
    try:
        return asyncio.run(args.func(args))
    except CliError as e:
        err.print(f"error: {e}", markup=False, soft_wrap=True)
        return e.code
    except RPCError as e:
        error = rpc_error(e, getattr(args, "name", None))
        err.print(f"error: {error}", markup=False, soft_wrap=True)
        return error.code
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> None:
    code = run(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
