"""Scale: N concurrent TrainingJobs on W workflow worker processes, each job reclaimed at a
steady rate.

    .venv/bin/python -m bench.scale --jobs 100 --jobs 300 [--workers 2] [--server postgres] ...

A real Temporal server (`--server`: the dev server, or temporal-server on PostgreSQL; both
started by bench/temporal_server.py, side by side per size) and the real workflow; the
simulated cloud and runtime (no rank processes), so what is measured is orchestration. The
workflows run in `--workers` worker processes of their own (`bench/scale_worker.py`, no
activities); this process, the driver, sends the reclaims and runs the activities on the
simulated cloud and runtime, whose watch long-polls as the real runtimes' does (a watch a
report interval, no timer). Reported per (server, jobs, workers): reaction from the `reclaim`
signal being sent to the worker-notify activity (`stop_generation`, which raises the elastic
event) starting, each worker process's CPU (per reclaim cycle, and its share of a core) and
peak RSS, the driver's and the server's CPU (PostgreSQL's included) apart, the 1-minute load
average at the row's end, history events per reclaim cycle (shrink, replacement, grow back, and
the progress watches in between), and whether continue-as-new keeps every run under Temporal's
history limits.

`--profile` samples each worker with py-spy while it reclaims and names where its CPU goes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import random
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker

from spotrain.activities.simulated import SimulatedCloud, SimulatedRuntime
from spotrain.workers.worker import ACTIVITY_SLOTS
from spotrain.workflows import contract
from spotrain.workflows.contract import StopRequest, StopResult, WatchRequest, WatchResult
from spotrain.workflows.history import HISTORY_EVENTS_BEFORE_CONTINUE

from .common import REPO, cpu_s, publish, stop, summary, table
from .scale_profile import sampled
from .temporal_server import SERVERS, temporal_server

HISTORY_LIMIT = 51_200  # Temporal's hard limit on events per run
NODES = 4
WATCH_POLL_S = 0.25  # as activities/local.py polls its ranks
COLUMNS = [
    "server",
    "jobs",
    "workers",
    "activity_slots",
    "reclaims",
    "reaction_p50_ms",
    "reaction_p99_ms",
    "cpu_s_per_reclaim",
    "worker_cpu_share_max",
    "driver_cpu_s_per_reclaim",
    "server_cpu_s_per_reclaim",
    "load_1m",
    "peak_rss_mb",
    "events_per_cycle",
    "max_run_events",
    "continued_as_new",
    "under_limits",
]


class NotifiedRuntime(SimulatedRuntime):
    """The simulated runtime (10 steps/s per node), noting when each job is told to stop."""

    def __init__(self) -> None:
        super().__init__(
            steps_per_hour=lambda world: 36_000.0 * world, checkpoint_every=20, restart_cost_s=0.5
        )
        self.signalled: dict[str, float] = {}  # job -> time.time() the reclaim was sent
        self.reactions: list[float] = []
        self.closing = False  # watches answer at once: none is left polling a closed run

    @activity.defn(name=contract.STOP_GENERATION)
    def stop_generation(self, req: StopRequest) -> StopResult:
        sent = self.signalled.pop(req.job, None)
        if sent is not None:
            self.reactions.append(time.time() - sent)
        return super().stop_generation(req)

    @activity.defn(name=contract.WATCH_GENERATION)
    async def watch_generation(self, req: WatchRequest) -> WatchResult:
        """Answers as the real runtimes do (activities/local.py, kube.py): at once on a
        failure, a completion or a stopped generation, else with progress after
        `report_after_s`. (The simulated runtime answers at once, for the time-skipping
        tests, and the workflow paces it with a timer: five events a watch more than a
        user's job pays.)"""
        deadline = time.monotonic() + req.report_after_s
        while True:
            result = SimulatedRuntime.watch_generation(self, req)
            if result.outcome != "progress" or self.closing or time.monotonic() >= deadline:
                return result
            activity.heartbeat()
            await asyncio.sleep(WATCH_POLL_S)

    def full_generation(self, job: str) -> list[str] | None:
        """The running generation's node ids if it holds every node (nothing in flight)."""
        with self._lock:
            running = [g for g in self._job(job).generations.values() if not g.stopped]
        if len(running) == 1 and running[0].plan.world_size == NODES:
            return [m.node_id for m in running[0].plan.members]
        return None


def job_spec(name: str, progress_s: float) -> dict[str, Any]:
    return {
        "name": name,
        "command": ["simulated"],
        "total_steps": 10**9,
        "checkpoint": "file:///tmp/spotrain-bench",
        "elastic": {
            "min_nodes": 2,
            "max_nodes": NODES,
            "graceful_shutdown_timeout_s": 5,
            "scaling_timeout_s": 1,
            "faulty_scale_down_timeout_s": 3,
            "capacity_check_interval_s": max(30.0, progress_s),
            "progress_report_interval_s": progress_s,
            "stall_timeout_s": 120,
        },
        "spot": {
            "instance_types": [
                {"name": "p3.2xlarge", "gpus": 1, "on_demand_price": 3.06, "spot_price": 0.97}
            ],
            "zones": ["us-east-1a", "us-east-1b"],
        },
    }


async def history_events(client: Client, names: list[str]) -> list[int]:
    """Events in every run of the jobs: finished (continued-as-new) runs and current ones."""
    closed = [
        wf.history_length
        async for wf in client.list_workflows('WorkflowType="TrainingJob"')
        if wf.close_time is not None
    ]
    described = await asyncio.gather(*(client.get_workflow_handle(n).describe() for n in names))
    return closed + [d.raw_description.workflow_execution_info.history_length for d in described]


async def until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def jobs_at_full_size(
    client: Client,
    cloud: SimulatedCloud,
    runtime: NotifiedRuntime,
    names: list[str],
    queue: str,
    workers: int,
    slots: int,
    progress_s: float,
) -> AsyncIterator[list[int]]:
    """The jobs running on all their nodes: their workflows in `workers` processes of their
    own (their pids), the activities in this process on `slots`. Stopped on the way out."""
    address = client.service_client.config.target_host
    with ThreadPoolExecutor(max_workers=slots) as pool:
        async with (
            workflow_workers(address, queue, workers, len(names) + 100) as pids,
            Worker(
                client,
                task_queue=queue,
                activities=cloud.activities() + runtime.activities(),
                activity_executor=pool,
                max_concurrent_activities=slots,
            ),
        ):
            await start_at_full_size(client, runtime, names, queue, progress_s)
            yield pids


async def start_at_full_size(
    client: Client, runtime: NotifiedRuntime, names: list[str], queue: str, progress_s: float
) -> None:
    """Start the jobs, 50 at a time, and wait until each runs on all its nodes."""
    for start in range(0, len(names), 50):
        await asyncio.gather(
            *(
                client.start_workflow(
                    "TrainingJob", job_spec(n, progress_s), id=n, task_queue=queue
                )
                for n in names[start : start + 50]
            )
        )
    await until(
        lambda: all(runtime.full_generation(n) for n in names),
        60 + len(names) * 0.5,
        "every job running at full size",
    )


async def post_mortem(client: Client, runtime: NotifiedRuntime) -> str:
    """What each job still waiting for its reaction last did, for a failure message."""
    lines = []
    for name, sent in runtime.signalled.items():
        timeline = await client.get_workflow_handle(name).query("timeline")
        recent = [
            f"{e['time']} g{e['generation']} {e['event']} {e['detail']}" for e in timeline[-12:]
        ]
        lines.append(f"{name} (reclaim sent at {sent:.1f}): " + " | ".join(recent))
    return "\n".join(lines)


@contextlib.asynccontextmanager
async def workflow_workers(
    address: str, queue: str, n: int, cached: int
) -> AsyncIterator[list[int]]:
    """`n` workflow worker processes on `queue`, once each polls; their pids. Stopped (and
    waited for) on the way out, however it is left."""
    command = [sys.executable, "-m", "bench.scale_worker", queue, str(cached)]
    env = os.environ | {"TEMPORAL_ADDRESS": address}
    procs: list[subprocess.Popen[str]] = []
    try:
        for _ in range(n):
            procs.append(
                subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
            )
        for proc in procs:
            line = await asyncio.to_thread(proc.stdout.readline)  # type: ignore[union-attr]
            if line.strip() != "ready":
                raise RuntimeError(f"a workflow worker did not start (exit {proc.poll()})")
        yield [p.pid for p in procs]
    finally:
        stop(procs)


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident set (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one_size(
    server: str,
    jobs: int,
    workers: int,
    slots: int,
    duration_s: float,
    reclaim_every_s: float,
    suggest_can: int,
    progress_s: float,
    profile: Path | None,
) -> dict[str, Any]:
    dynamic = {"limit.historyCount.suggestContinueAsNew": suggest_can}
    async with temporal_server(server, dynamic) as running:
        client = running.client
        runtime = NotifiedRuntime()
        cloud = SimulatedCloud()
        queue = uuid.uuid4().hex
        names = [f"scale-{queue[:6]}-{i}" for i in range(jobs)]
        async with jobs_at_full_size(
            client, cloud, runtime, names, queue, workers, slots, progress_s
        ) as pids:
            events_before = sum(await history_events(client, names))
            worker_before = [cpu_s(pid) for pid in pids]
            server_before = {pid: cpu_s(pid) for pid in running.pids()}
            driver_before, began = time.process_time(), time.monotonic()
            async with sampled(pids, duration_s, profile) as profiles:
                reclaims = await reclaim_steadily(
                    client, runtime, names, duration_s, reclaim_every_s
                )
            try:
                await until(lambda: not runtime.signalled, 60 + jobs * 0.3, "the last reactions")
            except TimeoutError as e:
                raise TimeoutError(f"{e}: {await post_mortem(client, runtime)}") from None
            worker_cpu = [cpu_s(pid) - b for pid, b in zip(pids, worker_before, strict=True)]
            driver_cpu = time.process_time() - driver_before
            server_cpu = sum(cpu_s(p) - server_before.get(p, 0.0) for p in running.pids())
            load_1m = os.getloadavg()[0]
            elapsed = time.monotonic() - began
            rss = max(peak_rss_mb(pid) for pid in pids)
            runs = await history_events(client, names)
            runtime.closing = True
            await asyncio.sleep(1)
            await asyncio.gather(*(client.get_workflow_handle(n).terminate() for n in names))
    reactions_ms = [1000 * r for r in runtime.reactions]
    stats = summary(reactions_ms)
    return {
        "server": server,
        "jobs": jobs,
        "workers": workers,
        "activity_slots": slots,
        "reclaims": reclaims,
        "reclaims_per_s": reclaims / elapsed,
        "reaction_ms": stats,
        "reaction_p50_ms": stats.get("median"),
        "reaction_p99_ms": stats.get("p99"),
        "worker_cpu_s": worker_cpu,
        "cpu_s_per_reclaim": sum(worker_cpu) / max(1, reclaims),  # the workflows' CPU
        "worker_cpu_share": [c / elapsed for c in worker_cpu],
        "worker_cpu_share_max": max(worker_cpu) / elapsed,
        "driver_cpu_s_per_reclaim": driver_cpu / max(1, reclaims),  # activities, signals
        "server_cpu_s_per_reclaim": server_cpu / max(1, reclaims),
        "load_1m": load_1m,
        "peak_rss_mb": rss,
        "events_per_cycle": (sum(runs) - events_before) / max(1, reclaims),
        "max_run_events": max(runs),
        "continued_as_new": len(runs) - jobs,
        "under_limits": max(runs) < min(HISTORY_LIMIT, HISTORY_EVENTS_BEFORE_CONTINUE + 1000),
        "elapsed_s": elapsed,
    } | ({"profile": profiles} if profile else {})


async def reclaim_steadily(
    client: Client,
    runtime: NotifiedRuntime,
    names: list[str],
    duration_s: float,
    every_s: float,
) -> int:
    """Reclaim one node of each job every `every_s` (random phase) while it is at full
    size, for `duration_s`; returns how many reclaims were sent."""
    now = time.monotonic()
    due = {n: now + random.uniform(0, every_s) for n in names}
    end, sent, pending = now + duration_s, 0, set()
    while time.monotonic() < end:
        for name, at in due.items():
            nodes = runtime.full_generation(name) if time.monotonic() >= at else None
            if nodes is None or name in runtime.signalled:
                continue
            deadline = datetime.now(UTC) + timedelta(seconds=120)
            notice = {"node_id": nodes[-1], "deadline": deadline.isoformat(), "event_id": None}
            runtime.signalled[name] = time.time()
            task = asyncio.create_task(client.get_workflow_handle(name).signal("reclaim", notice))
            pending.add(task)
            task.add_done_callback(pending.discard)
            due[name] = at + every_s
            sent += 1
        await asyncio.sleep(0.02)
    await asyncio.gather(*pending)
    return sent


def revision() -> str:
    """The commit measured, `-dirty` if the tree differs from it (the workflows may)."""
    done = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty", "--abbrev=12"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, action="append", help="repeat: 100 and 1000 by default")
    p.add_argument(
        "--workers",
        type=int,
        action="append",
        help="workflow worker processes; repeat (1 by default)",
    )
    p.add_argument(
        "--activity-slots",
        type=int,
        action="append",
        help=f"activities the driver runs at once; repeat ({ACTIVITY_SLOTS}, as spotrain worker)",
    )
    p.add_argument("--duration-s", type=float, default=120.0, help="reclaiming this long")
    p.add_argument("--reclaim-every-s", type=float, default=30.0, help="per job")
    p.add_argument("--suggest-can", type=int, default=500, help="server's continue-as-new hint")
    p.add_argument(
        "--progress-s", type=float, default=10.0, help="each job's progress report interval"
    )
    p.add_argument(
        "--server",
        action="append",
        choices=SERVERS,
        help="repeat: each size on each, side by side (dev by default)",
    )
    p.add_argument("--profile", type=Path, help="py-spy each worker's reclaims into this folder")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="scale", help="the result file's name, without .json")
    args = p.parse_args(argv)
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    rows: list[dict[str, Any]] = []
    for slots in args.activity_slots or [ACTIVITY_SLOTS]:
        for jobs in args.jobs or [100, 1000]:
            for workers, server in itertools.product(args.workers or [1], args.server or ["dev"]):
                size = (server, jobs, workers, slots, args.duration_s, args.reclaim_every_s)
                extra = (args.suggest_can, args.progress_s, args.profile)
                try:
                    rows.append(asyncio.run(one_size(*size, *extra)))
                except TimeoutError as err:  # the row says so; the others still run
                    rows.append({"server": server, "jobs": jobs, "workers": workers})
                    rows[-1] |= {"activity_slots": slots, "failed": str(err)}
                    print(f"{server}, jobs {jobs}, workers {workers}: {err}", file=sys.stderr)
                print(table(rows[-1:], COLUMNS), file=sys.stderr, flush=True)  # progress
    report = {
        "setup": vars(args) | {"out": str(args.out), "profile": str(args.profile)},
        "revision": revision(),
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    publish(report, rows, COLUMNS, args.out / f"{args.name}.json")
    return report


if __name__ == "__main__":
    main()
