"""`spotrain gc`, `spotrain release` and `spotrain logs`: commands that look past Temporal at
what jobs leave behind (EC2 instances and placement groups, Karpenter NodeClaims, local rank
processes, checkpoints, and the local runtime's rank logs). The provider and runtime they need are
imported only when they run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rich.table import Table
from temporalio.service import RPCError

from spotrain.workers.cli.support import (
    OK,
    RPC_TIMEOUT,
    USAGE,
    CliError,
    client,
    emit_json,
    job_workflow,
    known,
    out,
    rpc_error,
    runs,
    stuck,
)

if TYPE_CHECKING:
    from spotrain.activities.ec2_ownership import Orphan
    from spotrain.activities.ec2_placement import OrphanGroup
    from spotrain.activities.kube import KubeRuntime

T = TypeVar("T")
RELEASED = "spotrain release: the workflow task kept failing; its nodes were released by tag"


def need_aws() -> None:
    """Fail before anything changes: else a botocore traceback after a half-done command."""
    import boto3

    if boto3.session.Session().get_credentials() is None:
        raise CliError(NO_AWS, USAGE)


def instance_rows(instances: list[Orphan]) -> list[dict[str, str]]:
    return [
        {
            "instance_id": o.instance_id,
            "job": o.job,
            "state": o.state,
            "instance_type": o.instance_type,
            "zone": o.zone,
            "launched": o.launched.isoformat(),
        }
        for o in instances
    ]


def group_rows(groups: list[OrphanGroup]) -> list[dict[str, str]]:
    return [{"name": g.name, "job": g.job, "state": g.state} for g in groups]


def print_groups(rows: list[dict[str, str]]) -> None:
    for r in rows:  # state: the group's (a dry run), "deleted", or "in use" (the next gc)
        out.print(f"placement group {r['name']} of {r['job'] or '(no job)'}: {r['state']}")


def instance_table(rows: list[dict[str, str]], title: str) -> Table:
    table = Table("instance", "job", "state", "type", "zone", "launched", title=title)
    for r in rows:
        table.add_row(*r.values())
    return table


NO_AWS = (
    "spotrain gc and release search EC2 and find no AWS credentials: set AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) and AWS_REGION; against `spotrain dev`, "
    "SPOTRAIN_EC2_ENDPOINT=http://127.0.0.1:5000 (its moto) with any keys"
)


async def cmd_gc(args: argparse.Namespace) -> int:
    """What terminated jobs left: EC2 instances, then placement groups (by their tags; a
    group its instances still shut down in is deleted by the next gc), the local runtime's rank
    processes (by its state dir) and, with the Kubernetes runtime, pods and objects (by their
    labels). A job counts as running unless Temporal says otherwise, and an unreachable
    Temporal stops gc before anything is reaped."""
    from botocore.exceptions import BotoCoreError, ClientError

    from spotrain.activities.ec2 import EC2Provider
    from spotrain.activities.ec2_ownership import reap
    from spotrain.activities.ec2_placement import reap_groups
    from spotrain.activities.local import LocalRuntime
    from spotrain.elastic.job_store import reap_checkpoints
    from spotrain.workers.worker import DEFAULT_STATE_DIR

    need_aws()
    kube = kube_runtime(args)
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
        groups = [
            group
            for region in args.region or [provider.region]
            for group in await asyncio.to_thread(
                reap_groups, provider.client(region), job_running, args.apply
            )
        ]
        processes = await asyncio.to_thread(local.reap, job_running, args.apply)
        pods = claims = None
        if kube is not None:
            pods = await on_kubernetes(kube, kube.reap, job_running, args.apply)
            claims = await reap_node_claims(kube, job_running, args.apply)
        checkpoints = {
            root: await asyncio.to_thread(reap_checkpoints, root, job_known, args.apply)
            for root in args.checkpoints or []
        }
    except RPCError as e:
        raise rpc_error(e, None) from None
    except (BotoCoreError, ClientError) as e:
        raise CliError(f"EC2 at {provider.endpoint_url or 'AWS'}: {e}") from None
    rows = instance_rows(orphans)
    procs = [{"job": job, "pids": pids} for job, pids in processes.items()]
    jobs_pods = None if pods is None else [{"job": j, "pods": names} for j, names in pods.items()]
    if args.json:
        emit_json(
            {
                "applied": args.apply,
                "orphans": rows,
                "placement_groups": group_rows(groups),
                "processes": procs,
                "pods": jobs_pods,
                "nodeclaims": claims,
                "checkpoints": checkpoints,
            }
        )
        return OK
    title = "terminated" if args.apply else "orphans (dry run: --apply to reap)"
    out.print(instance_table(rows, title) if rows else "no orphaned instances")
    print_groups(group_rows(groups))
    for p in procs:
        pids = ", ".join(map(str, p["pids"]))
        out.print(f"{'killed' if args.apply else 'orphaned'} rank processes of {p['job']}: {pids}")
    for job, names in (pods or {}).items():
        what = "released" if args.apply else "orphaned"
        out.print(f"{what} Kubernetes objects of {job}: pods {', '.join(names) or 'none'}")
    if kube is not None and claims is None:
        out.print("NodeClaims not checked: this identity may not list them")
    for job, names in (claims or {}).items():
        what = "deleted" if args.apply else "orphaned"
        out.print(f"{what} NodeClaims of {job}: {', '.join(names)}")
    for root, jobs in checkpoints.items():
        what = "deleted" if args.apply else "checkpoints of jobs Temporal no longer knows"
        out.print(f"{root}: {what}: {', '.join(jobs) or 'none'}")
    return OK


def kube_runtime(args: argparse.Namespace) -> KubeRuntime | None:
    """The Kubernetes runtime the job's worker used (`--runtime`, else SPOTRAIN_RUNTIME), its
    kubeconfig loaded before anything changes; None for the local runtime."""
    if (args.runtime or os.environ.get("SPOTRAIN_RUNTIME", "local")) != "kubernetes":
        return None
    from kubernetes.config import ConfigException

    from spotrain.activities.kube import KubeRuntime

    try:
        return KubeRuntime.from_env()
    except ConfigException as e:
        raise CliError(f"Kubernetes: no cluster configured ({e}): set KUBECONFIG", USAGE) from None


async def reap_node_claims(
    kube: KubeRuntime, is_job_running: Callable[[str], bool], apply: bool
) -> dict[str, list[str]] | None:
    """The Karpenter provider's NodeClaims of jobs that do not run (deleted with `apply`),
    through the same cluster connection; None when the identity may not list NodeClaims (a
    cluster whose worker does not use Karpenter), which the output says."""
    from kubernetes.client.exceptions import ApiException

    from spotrain.activities.karpenter import KarpenterProvider

    try:
        reap = KarpenterProvider(kube.core.api_client).reap
        return await asyncio.to_thread(reap, is_job_running, apply)
    except ApiException as e:
        if e.status == 403:
            return None
        raise CliError(f"Kubernetes at {kube.core.api_client.configuration.host}: {e}") from None


async def on_kubernetes(kube: KubeRuntime, fn: Callable[..., T], *args: Any) -> T:
    """`fn` (a KubeRuntime method) in a thread, its API errors as one line."""
    from kubernetes.client.exceptions import ApiException
    from temporalio.exceptions import ApplicationError
    from urllib3.exceptions import HTTPError

    try:
        return await asyncio.to_thread(fn, *args)
    except ApplicationError as e:  # refused: the kubeconfig's identity lacks a verb
        raise CliError(f"Kubernetes: {e.message}") from None
    except (ApiException, HTTPError) as e:
        raise CliError(f"Kubernetes at {kube.core.api_client.configuration.host}: {e}") from None


async def cmd_release(args: argparse.Namespace) -> int:
    """For a job whose workflow is wedged (it cannot run its own cleanup): terminate the
    workflow, then release what the job owns by its ownership tags, whatever Temporal says.
    Terminating first means a workflow that comes unstuck cannot order nodes again. Safe to
    run again: each step finds what is left and says what it did."""
    from botocore.exceptions import BotoCoreError, ClientError

    from spotrain.activities.ec2 import EC2Provider
    from spotrain.activities.ec2_ownership import reap
    from spotrain.activities.ec2_placement import reap_groups
    from spotrain.activities.local import LocalRuntime
    from spotrain.workers.worker import DEFAULT_STATE_DIR

    need_aws()
    kube = kube_runtime(args)
    c = await client()
    try:
        handle = await job_workflow(c, args.name, running=True)
        if handle is None:
            workflow = "already closed" if await known(c, args.name) else "unknown to Temporal"
        else:
            description = await handle.describe(rpc_timeout=RPC_TIMEOUT)
            if not args.force and await stuck(c, description) is None:
                raise CliError(
                    f"{args.name} is running and not stuck: `spotrain cancel {args.name}` "
                    "stops it with its own cleanup (checkpoint first); --force releases it "
                    "anyway",
                    USAGE,
                )
            await handle.terminate(reason=RELEASED, rpc_timeout=RPC_TIMEOUT)
            workflow = "terminated"
    except RPCError as e:
        raise rpc_error(e, args.name) from None
    provider = EC2Provider.from_env()
    try:  # the workflow is closed now: every live instance tagged with the job goes
        released = [
            instance
            for region in args.region or [provider.region]
            for instance in await asyncio.to_thread(
                reap, provider.client(region), lambda _: False, True, args.name
            )
        ]
        groups = [  # "in use" while its instances shut down: `spotrain gc` deletes it later
            group
            for region in args.region or [provider.region]
            for group in await asyncio.to_thread(
                reap_groups, provider.client(region), lambda _: False, True, args.name
            )
        ]
    except (BotoCoreError, ClientError) as e:
        raise CliError(f"EC2 at {provider.endpoint_url or 'AWS'}: {e}") from None
    local = LocalRuntime(args.state_dir or DEFAULT_STATE_DIR)
    pids = (await asyncio.to_thread(local.reap, lambda job: job != args.name, True)).get(
        args.name, []
    )
    pods = claims = None
    if kube is not None:
        pods = await on_kubernetes(kube, kube.release_job, args.name)
        found = await reap_node_claims(kube, lambda job: job != args.name, True)
        claims = None if found is None else found.get(args.name, [])
    rows = instance_rows(released)
    if args.json:
        body = {"job": args.name, "workflow": workflow, "instances": rows, "pids": pids}
        emit_json(
            body | {"placement_groups": group_rows(groups), "pods": pods, "nodeclaims": claims}
        )
        return OK
    out.print(f"{args.name}: workflow {workflow}")
    out.print(
        instance_table(rows, "terminated") if rows else f"no live instances tagged {args.name}"
    )
    print_groups(group_rows(groups))
    killed = ", ".join(map(str, pids))
    out.print(f"killed rank processes: {killed}" if pids else "no rank processes")
    if kube is not None:
        deleted = ", ".join(pods or [])
        out.print(f"deleted pods: {deleted}" if pods else f"no pods labelled {args.name}")
        if claims is None:
            out.print("NodeClaims not checked: this identity may not list them")
        else:
            deleted = ", ".join(claims)
            out.print(f"deleted NodeClaims: {deleted}" if claims else "no NodeClaims of the job")
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
