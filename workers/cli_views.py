"""Read-only `spotrain` commands: list (a visibility query), status (the `status` query, once or
watched) and report (timeline and cost, running or finished, as text, JSON, a plot or a
page). They only read from Temporal and render; none changes a job.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from rich.console import Group
from rich.live import Live
from rich.table import Table

from spotrain.workers.cli_support import (
    OK,
    USAGE,
    CliError,
    build_report,
    client,
    emit_json,
    err,
    job,
    out,
    query_status,
)
from spotrain.workers.report import PlotUnavailable, plot, print_report, to_html
from spotrain.workflows import attributes, deadline
from spotrain.workflows.checkpoints import describe
from spotrain.workflows.state import JobStatus


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
