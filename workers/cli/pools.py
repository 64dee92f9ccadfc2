"""`spotrain pool` commands: create, set, status and list capacity pools (one `CapacityPool`
workflow per pool). `POOL_LIMITS` are also the options the parser (workers/cli/main.py) gives
`pool create` and `pool set`.
"""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import ValidationError
from rich.console import Group
from rich.table import Table
from temporalio.client import WorkflowHandle, WorkflowQueryFailedError, WorkflowUpdateFailedError
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from spotrain.workers.cli.support import (
    OK,
    RPC_TIMEOUT,
    USAGE,
    CliError,
    client,
    emit_json,
    execute_update,
    out,
)
from spotrain.workflows.capacity.pool import (
    POOL_ID_PREFIX,
    PoolConfig,
    PoolStatus,
    pool_workflow_id,
)
from spotrain.workflows.spec import describe_errors

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
        message = await execute_update(handle, "configure", config)
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
