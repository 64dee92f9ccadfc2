"""`spotrain gc` and `spotrain logs`: commands that look past Temporal at what jobs leave
behind (EC2 instances, local rank processes, checkpoints, and the local runtime's rank logs).
The provider and runtime they need are imported only when they run.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from rich.table import Table
from temporalio.service import RPCError

from spotrain.workers.cli_support import (
    OK,
    USAGE,
    CliError,
    client,
    emit_json,
    known,
    out,
    rpc_error,
    runs,
)

NO_AWS = (
    "spotrain gc searches EC2 and finds no AWS credentials: set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and AWS_REGION; against `spotrain dev`, "
    "SPOTRAIN_EC2_ENDPOINT=http://127.0.0.1:5000 (its moto) with any keys"
)


async def cmd_gc(args: argparse.Namespace) -> int:
    """What terminated jobs left: EC2 instances (by their tags) and the local runtime's rank
    processes (by its state dir). A job counts as running unless Temporal says otherwise, and
    an unreachable Temporal stops gc before anything is reaped."""
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    from spotrain.activities.ec2 import EC2Provider
    from spotrain.activities.ec2_ownership import reap
    from spotrain.activities.local import LocalRuntime
    from spotrain.elastic.job_store import reap_checkpoints
    from spotrain.workers.worker import DEFAULT_STATE_DIR

    if boto3.session.Session().get_credentials() is None:  # else a botocore traceback
        raise CliError(NO_AWS, USAGE)
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
    except (BotoCoreError, ClientError) as e:
        raise CliError(f"EC2 at {provider.endpoint_url or 'AWS'}: {e}") from None
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
