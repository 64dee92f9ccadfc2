"""Read-only `spotrain` commands: list (a visibility query), status (the `status` query, once or
watched) and report (timeline and cost, running or finished, as text, JSON, a plot or a
page). They only read from Temporal and render; none changes a job.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from datetime import datetime, timedelta
from typing import Any

from rich.console import Group
from rich.live import Live
from rich.table import Table
from rich.text import Text
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError

from spotrain.workers.cli.report import PlotUnavailable, plot, print_report, to_html
from spotrain.workers.cli.support import (
    OK,
    RPC_TIMEOUT,
    USAGE,
    CliError,
    Stuck,
    build_report,
    client,
    emit_json,
    err,
    job,
    out,
    query_status,
    stuck,
)
from spotrain.workflows.job import attributes
from spotrain.workflows.job.checkpoints import describe
from spotrain.workflows.job.state import JobStatus
from spotrain.workflows.policies import deadline

STUCK_QUERY_TIMEOUT = timedelta(seconds=5)  # a stuck workflow may not answer at all
LIST_DESCRIBES = 8  # describe calls in flight at once


def status_view(s: JobStatus) -> Group:
    head = (
        f"[bold]{s.name}[/] {s.phase}   generation {s.generation}   world size {s.world_size} "
        f"(target {s.target_nodes} nodes)   step {s.step}/{s.total_steps} "
        f"(checkpoint {s.checkpoint_step})   cost so far ${s.cost_so_far:,.2f}"
        + (f" (budget ${s.budget_usd:,.2f})" if s.budget_usd is not None else "")
        + (
            f" (of it ${s.transfer.cost:,.2f} for {s.transfer.zone_gb:,.1f} GB across zones)"
            if s.transfer.zone_gb
            else ""
        )
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
    nodes = Table("rank")
    nodes.add_column("node", no_wrap=True, min_width=19)  # a whole instance id, at 80 columns too
    for header in ("lifecycle", "type", "zone", "state", "$/h", "reason"):
        nodes.add_column(header)
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


async def cmd_list(args: argparse.Namespace) -> int:
    query = "WorkflowType = 'TrainingJob' AND ExecutionStatus != 'ContinuedAsNew'"
    if args.phase:
        query += f" AND SpotrainPhase = '{args.phase}'"
    c = await client()
    rows, running = [], {}
    async for wf in c.list_workflows(query, limit=args.limit):
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
                "stuck": None,
            }
        )
        if wf.status == WorkflowExecutionStatus.RUNNING:
            running[len(rows) - 1] = c.get_workflow_handle(wf.id, run_id=wf.run_id)
    gate = asyncio.Semaphore(LIST_DESCRIBES)

    async def check(handle: WorkflowHandle[Any, Any]) -> Stuck | None:
        async with gate:
            return await stuck(c, await handle.describe(rpc_timeout=RPC_TIMEOUT))

    found = await asyncio.gather(*map(check, running.values()))
    for i, blocked in zip(running, found, strict=True):
        rows[i]["stuck"] = blocked
    if args.json:
        emit_json([r | {"stuck": r["stuck"] and r["stuck"].as_json()} for r in rows])
        return OK
    table = Table("name", "phase", "world", "spot", "on-demand", "cost", "started")
    for r in rows:
        cost = r["cost"]
        table.add_row(
            r["name"],
            "[red]STUCK[/]" if r["stuck"] else r["phase"] or r["status"] or "-",
            *(str(r[k]) if r[k] is not None else "-" for k in ("world_size", "spot_nodes")),
            str(r["on_demand_nodes"]) if r["on_demand_nodes"] is not None else "-",
            "-" if cost is None else f"${cost:,.2f}",
            r["started"][:19],
        )
    out.print(table if rows else "no jobs" + (f" in phase {args.phase}" if args.phase else ""))
    for r in rows:
        if r["stuck"]:
            out.print(Text(r["stuck"].line(r["name"]), style="red"))
    return OK


async def snapshot(
    c: Client, handle: WorkflowHandle[Any, Any]
) -> tuple[JobStatus | None, Stuck | None]:
    """The `status` query and whether the job is stuck; a stuck job may not answer the query,
    and then its stuck line is all there is to show."""
    blocked = await stuck(c, await handle.describe(rpc_timeout=RPC_TIMEOUT))
    if blocked is None:
        return await query_status(handle), None
    try:
        return await query_status(handle, STUCK_QUERY_TIMEOUT), blocked
    except (CliError, RPCError):
        return None, blocked


def snapshot_view(name: str, s: JobStatus | None, blocked: Stuck | None) -> Group:
    stuck_line = [Text(blocked.line(name), style="bold red")] if blocked else []
    return Group(*stuck_line, *([status_view(s)] if s else []))


def snapshot_json(name: str, s: JobStatus | None, blocked: Stuck | None) -> dict[str, Any]:
    body = s.model_dump(mode="json") if s else {"name": name}
    return body | {"stuck": blocked and blocked.as_json()}


async def cmd_status(args: argparse.Namespace) -> int:
    c = await client()
    handle = c.get_workflow_handle(args.name)
    if not args.watch:
        s, blocked = await snapshot(c, handle)
        if args.json:
            emit_json(snapshot_json(args.name, s, blocked))
        else:
            out.print(snapshot_view(args.name, s, blocked))
        return OK
    # A terminal gets the view redrawn in place; a pipe or a file (rich's Live would write
    # nothing until the job ends) a line each time the job moves; --json an object a poll.
    live = Live(console=out, auto_refresh=False) if out.is_terminal and not args.json else None
    last = ""
    with live or contextlib.nullcontext():
        while True:
            s, blocked = await snapshot(c, handle)
            if args.json:
                sys.stdout.write(json.dumps(snapshot_json(args.name, s, blocked), default=str))
                sys.stdout.write("\n")
                sys.stdout.flush()
            elif live is not None:
                live.update(snapshot_view(args.name, s, blocked), refresh=True)
            elif (line := watch_line(args.name, s, blocked)) != last:
                out.print(f"{datetime.now():%H:%M:%S} {line}", markup=False, soft_wrap=True)
                out.file.flush()
                last = line
            if s and s.phase.is_final:
                return OK
            await asyncio.sleep(args.interval)


def watch_line(name: str, s: JobStatus | None, blocked: Stuck | None) -> str:
    """The job in one line, for `status --watch` to a pipe."""
    if blocked is not None:
        return blocked.line(name)
    assert s is not None  # (only a stuck job may leave the query unanswered)
    return (
        f"{s.name} {s.phase} generation {s.generation} world size {s.world_size} "
        f"step {s.step}/{s.total_steps} cost ${s.cost_so_far:,.2f}"
        + (f": {s.failure}" if s.failure else "")
    )


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
