"""The Temporal worker: the TrainingJob, CapacityPool and ReleaseJob workflows, plus one node
provider and one rank runtime.

The workflow calls activities by name and never knows which implementation answers: the
worker picks them when it starts. It holds no state of its own, so it can be killed and
restarted (or redeployed) at any moment; running jobs carry on from Temporal's history.

    python -m spotrain.workers.worker --provider ec2 --runtime local
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.runtime import Runtime
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from spotrain.workers import metrics
from spotrain.workers.connect import TASK_QUEUE, Unreachable, connect, give_up
from spotrain.workflows.capacity.pool import CapacityPool
from spotrain.workflows.release import ReleaseJob
from spotrain.workflows.training_job import TrainingJob

WORKFLOWS = [TrainingJob, CapacityPool, ReleaseJob]
# spotrain's own modules pass through the workflow sandbox, so each class exists once: the
# pydantic models decoded from history (the JobState that continue-as-new carries, with the
# events still queued in it) are then the very classes the workflow `match`es on. With the
# sandbox's re-imported copies, a reclaim notice queued just before continue-as-new matched
# no case in the next run and was dropped. These modules do no I/O and keep no state at import.
WORKFLOW_RUNNER = SandboxedWorkflowRunner(
    restrictions=SandboxRestrictions.default.with_passthrough_modules("spotrain")
)


def workflow_worker(
    client: Client, task_queue: str, activities: list[Any], **options: Any
) -> Worker:
    """A Temporal worker running spotrain's workflows in their sandbox, and `activities`."""
    return Worker(
        client,
        task_queue=task_queue,
        workflows=WORKFLOWS,
        workflow_runner=WORKFLOW_RUNNER,
        activities=activities,
        **options,
    )


PROVIDERS = ("ec2", "karpenter", "simulated")
# Activities one worker runs at once, each on a thread of its own (started as needed). A
# running job's watch holds one for its progress report interval, so past about this many
# running jobs a worker's other activities, a reclaim's stop among them, wait for a watch
# to end: at 64, 100 jobs waited seconds (bench.scale). More jobs: more workers.
ACTIVITY_SLOTS = 512
RUNTIMES = ("local", "kubernetes", "simulated")
DEFAULT_STATE_DIR = Path(os.environ.get("SPOTRAIN_STATE_DIR", Path.home() / ".spotrain"))


def build_activities(provider: str, runtime: str, state_dir: Path) -> list[Callable[..., Any]]:
    """The activity implementations for one cloud and one kind of worker."""
    activities: list[Callable[..., Any]] = []
    if provider == "ec2":
        from spotrain.activities.ec2 import EC2Provider

        activities += EC2Provider.from_env().activities()
    elif provider == "karpenter":
        from spotrain.activities.karpenter import KarpenterProvider

        activities += KarpenterProvider.from_env().activities()
    elif provider == "simulated":
        from spotrain.activities.simulated import SimulatedCloud

        activities += SimulatedCloud().activities()
    else:
        raise ValueError(f"unknown provider {provider!r}: choose from {', '.join(PROVIDERS)}")
    if runtime == "local":
        from spotrain.activities.local import LocalRuntime

        activities += LocalRuntime(state_dir).activities()
    elif runtime == "kubernetes":
        from spotrain.activities.kube import KubeRuntime

        activities += KubeRuntime.from_env().activities()
    elif runtime == "simulated":
        from spotrain.activities.simulated import SimulatedRuntime

        activities += SimulatedRuntime().activities()
    else:
        raise ValueError(f"unknown runtime {runtime!r}: choose from {', '.join(RUNTIMES)}")
    return activities


def freeze_heap() -> None:
    """Take what a worker process holds for good (modules, boto3's service models, moto's
    data in the embedded stack) out of the garbage collector's full passes, which scan every
    object while holding the GIL. Under load one such pass over the demo's 400,000 objects
    took 2.7 s, and a workflow activation waiting on the GIL past 2 s fails as a deadlock
    (TMPRL1101). Called once by a process's entry point, when it is built and before it
    serves; a collection first, so no garbage is kept."""
    gc.collect()
    gc.freeze()


async def run_worker(
    client: Client,
    activities: list[Callable[..., Any]],
    task_queue: str = TASK_QUEUE,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve until `stop` is set (or forever); in-flight activity attempts are abandoned to
    Temporal's retries, which every activity is written to survive."""
    with ThreadPoolExecutor(max_workers=ACTIVITY_SLOTS, thread_name_prefix="activity") as pool:
        worker = workflow_worker(
            client,
            task_queue,
            activities,
            activity_executor=pool,
            max_concurrent_activities=ACTIVITY_SLOTS,
            graceful_shutdown_timeout=timedelta(seconds=5),
        )
        async with worker:
            await (stop or asyncio.Event()).wait()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spotrain worker",
        description="Run the Temporal worker that drives TrainingJob workflows.",
        epilog="examples:\n"
        "  spotrain worker --provider karpenter --runtime kubernetes --metrics 0.0.0.0:9464\n"
        "  spotrain worker --provider ec2 --runtime kubernetes\n"
        "  spotrain worker --provider simulated --runtime simulated --task-queue try-it\n\n"
        "Temporal connection: TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, "
        "TEMPORAL_TLS_* (mutual TLS), TEMPORAL_PROFILE (the SDK's standard settings; "
        "docs/security.md). EC2: boto3's standard credential "
        "chain plus SPOTRAIN_EC2_ENDPOINT, SPOTRAIN_AMI, SPOTRAIN_LAUNCH_TEMPLATE, "
        "SPOTRAIN_SUBNETS, SPOTRAIN_EC2_LAUNCH (instances | fleet). Karpenter: "
        "SPOTRAIN_KARPENTER_NODECLASS (group/kind/name), SPOTRAIN_KARPENTER_NODEPOOL, "
        "SPOTRAIN_KARPENTER_LAUNCH_TIMEOUT_S.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--task-queue",
        default=os.environ.get("SPOTRAIN_TASK_QUEUE", TASK_QUEUE),
        help="the task queue to serve (default: SPOTRAIN_TASK_QUEUE, else spotrain)",
    )
    p.add_argument(
        "--provider",
        choices=PROVIDERS,
        default=os.environ.get("SPOTRAIN_PROVIDER", "ec2"),
        help="where nodes come from (default: SPOTRAIN_PROVIDER, else ec2)",
    )
    p.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default=os.environ.get("SPOTRAIN_RUNTIME", "local"),
        help="where ranks run: local processes or Kubernetes pods (default: SPOTRAIN_RUNTIME, "
        "else local)",
    )
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="local runtime state")
    p.add_argument(
        "--metrics",
        default=os.environ.get("SPOTRAIN_METRICS_ADDRESS"),
        metavar="HOST:PORT",
        help="serve Prometheus metrics (the SDK's and spotrain's) here",
    )
    p.add_argument(
        "--metrics-interval-s",
        type=float,
        default=15.0,
        metavar="S",
        help="how often spotrain's job metrics are refreshed from the jobs (default 15)",
    )
    p.add_argument(
        "--json-logs",
        action="store_true",
        default=os.environ.get("SPOTRAIN_JSON_LOGS", "") not in ("", "0", "false"),
        help="one JSON object per log line",
    )
    return p


async def serve(args: argparse.Namespace, runtime: Runtime) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    activities = build_activities(args.provider, args.runtime, args.state_dir)
    client = await connect()
    collector = (
        asyncio.create_task(
            metrics.collect(
                client,
                metrics.JobMetrics(runtime.metric_meter),
                args.task_queue,
                args.metrics_interval_s,
            )
        )
        if args.metrics
        else None
    )
    logging.info(
        "spotrain worker on task queue %r (provider %s, runtime %s)",
        args.task_queue,
        args.provider,
        args.runtime,
    )
    notices = None
    if args.provider == "karpenter":  # its disruptions of the jobs' nodes: their notices
        from spotrain.activities.kube_api import default_api_client
        from spotrain.workers.karpenter_notices import KarpenterNotices

        notices = asyncio.create_task(KarpenterNotices(client, default_api_client()).run(stop))
    freeze_heap()
    try:
        await run_worker(client, activities, args.task_queue, stop)
    finally:
        for task in (collector, notices):
            if task:
                task.cancel()


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    if args.provider == "karpenter" and args.runtime != "kubernetes":
        p.error("--provider karpenter makes Kubernetes nodes: use it with --runtime kubernetes")
    runtime = metrics.setup(args.metrics, args.json_logs)  # before any client connects
    try:
        asyncio.run(serve(args, runtime))
    except Unreachable as e:
        give_up(f"spotrain worker: {e}")


if __name__ == "__main__":
    main()
