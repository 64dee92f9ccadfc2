"""Zone storm: every node the jobs hold in one zone gets a reclaim notice within minutes.

    .venv/bin/python -m bench.storm --jobs 1000 --notice-s 30 --notice-s 120

Of 2,635 real spot interruptions, over 92% of the co-interruptions in one instance type and
zone came within 3 minutes of each other (issue 48): a zone's reclaims come as a storm, not
at a steady rate. Once every job runs at full size, each node of the zone that holds most of
them gets a notice (the `reclaim` signal a webhook sends) at a uniformly random time within
`--storm-s`, with the row's notice. A notice's reaction runs from its signal to the job's
ranks on that node being told to stop (the start of `stop_generation` for a generation that
holds it), or to the node's release if no ranks ran there. Target: p99 within 10% of a 30 s
notice (3 s). The server, the workflow workers and the simulated cloud and runtime are
bench/scale.py's, and so is what it reports of the workers' CPU and the histories.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client

from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.worker import ACTIVITY_SLOTS
from spotrain.workflows import contract
from spotrain.workflows.contract import ReleaseRequest, StopRequest, StopResult

from .common import REPO, cpu_s, publish, summary, table
from .scale import (
    NotifiedRuntime,
    history_events,
    jobs_at_full_size,
    revision,
    until,
)
from .temporal_server import SERVERS, temporal_server

COLUMNS = [
    "server",
    "jobs",
    "notice_s",
    "zone",
    "notices",
    "skipped",
    "reaction_p50_ms",
    "reaction_p99_ms",
    "reaction_max_ms",
    "cpu_s_per_notice",
    "events_per_notice",
    "load_1m",
]


class Notices:
    """Each notice sent (job, node -> when), and the reactions of those answered."""

    def __init__(self) -> None:
        self.sent: dict[tuple[str, str], float] = {}
        self.reactions: list[float] = []
        self._lock = threading.Lock()

    def send(self, job: str, node: str) -> None:
        with self._lock:
            self.sent[(job, node)] = time.time()

    def answer(self, job: str, nodes: list[str]) -> None:
        """The job's ranks on `nodes` are told to stop (or the nodes are gone)."""
        now = time.time()
        with self._lock:
            for node in nodes:
                if (sent := self.sent.pop((job, node), None)) is not None:
                    self.reactions.append(now - sent)

    def waiting(self) -> list[tuple[str, str]]:
        with self._lock:
            return list(self.sent)


class StormRuntime(NotifiedRuntime):
    """Answers a notice when a generation that holds its node is stopped."""

    def __init__(self, notices: Notices) -> None:
        super().__init__()
        self.notices = notices

    @activity.defn(name=contract.STOP_GENERATION)
    def stop_generation(self, req: StopRequest) -> StopResult:
        with self._lock:
            generation = self._job(req.job).generations.get(req.generation)
            nodes = [m.node_id for m in generation.plan.members] if generation else []
        self.notices.answer(req.job, nodes)
        return super().stop_generation(req)


class StormCloud(SimulatedCloud):
    """Answers a notice when its node is released with no ranks told first (none ran)."""

    def __init__(self, notices: Notices) -> None:
        super().__init__()
        self.notices = notices

    @activity.defn(name=contract.RELEASE_NODES)
    def release_nodes(self, req: ReleaseRequest) -> list[str]:
        released = super().release_nodes(req)
        self.notices.answer(req.job, released)
        return released

    def in_zone(self, names: list[str]) -> tuple[str, list[tuple[str, str]]]:
        """The zone holding most of the jobs' nodes, and those nodes (job, node id)."""
        held = [(n.zone, job, n.node_id) for job in names for n in self.running(job)]
        zone = max(self.zones, key=lambda z: sum(1 for where, _, _ in held if where == z))
        return zone, [(job, node) for where, job, node in held if where == zone]


async def send_storm(
    client: Client,
    cloud: StormCloud,
    notices: Notices,
    targets: list[tuple[str, str]],
    over_s: float,
    notice_s: float,
) -> tuple[int, int]:
    """A notice for each target at a random time within `over_s`; (sent, skipped: the node
    was gone by its time)."""
    began = time.monotonic()
    plan = sorted((random.uniform(0, over_s), job, node) for job, node in targets)
    sent = skipped = 0
    signals = []
    for at, job, node in plan:
        await asyncio.sleep(max(0.0, began + at - time.monotonic()))
        if node not in {n.node_id for n in cloud.running(job)}:
            skipped += 1
            continue
        deadline = datetime.now(UTC) + timedelta(seconds=notice_s)
        notice = {"node_id": node, "deadline": deadline.isoformat(), "event_id": f"storm-{node}"}
        notices.send(job, node)
        signals.append(
            asyncio.create_task(client.get_workflow_handle(job).signal("reclaim", notice))
        )
        sent += 1
    await asyncio.gather(*signals)
    return sent, skipped


async def one_storm(
    server: str, jobs: int, workers: int, notice_s: float, over_s: float, progress_s: float
) -> dict[str, Any]:
    async with temporal_server(server, {}) as running:
        client = running.client
        notices = Notices()
        runtime, cloud = StormRuntime(notices), StormCloud(notices)
        queue = uuid.uuid4().hex
        names = [f"storm-{queue[:6]}-{i}" for i in range(jobs)]
        async with jobs_at_full_size(
            client, cloud, runtime, names, queue, workers, ACTIVITY_SLOTS, progress_s
        ) as pids:
            zone, targets = cloud.in_zone(names)
            events_before = sum(await history_events(client, names))
            worker_before = [cpu_s(pid) for pid in pids]
            sent, skipped = await send_storm(client, cloud, notices, targets, over_s, notice_s)
            try:
                await until(lambda: not notices.waiting(), 60 + jobs * 0.3, "every answer")
            except TimeoutError as e:
                raise TimeoutError(f"{e}: unanswered {notices.waiting()[:10]}") from None
            worker_cpu = sum(cpu_s(pid) - b for pid, b in zip(pids, worker_before, strict=True))
            load_1m = os.getloadavg()[0]
            events = sum(await history_events(client, names)) - events_before
            runtime.closing = True
            await asyncio.sleep(1)
            await asyncio.gather(*(client.get_workflow_handle(n).terminate() for n in names))
    stats = summary([1000 * r for r in notices.reactions])
    return {
        "server": server,
        "jobs": jobs,
        "workers": workers,
        "notice_s": notice_s,
        "storm_s": over_s,
        "zone": zone,
        "notices": sent,
        "skipped": skipped,
        "reaction_ms": stats,
        "reaction_p50_ms": stats.get("median"),
        "reaction_p99_ms": stats.get("p99"),
        "reaction_max_ms": stats.get("max"),
        "worker_cpu_s": worker_cpu,
        "cpu_s_per_notice": worker_cpu / max(1, sent),
        "events_per_notice": events / max(1, sent),
        "load_1m": load_1m,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.storm", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, action="append", help="repeat (1000 by default)")
    p.add_argument("--notice-s", type=float, action="append", help="repeat (30 and 120)")
    p.add_argument("--storm-s", type=float, default=180.0, help="the notices come within this")
    p.add_argument("--workers", type=int, default=1, help="workflow worker processes")
    p.add_argument("--progress-s", type=float, default=10.0, help="each job's report interval")
    p.add_argument("--server", choices=SERVERS, default="dev")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--name", default="storm", help="the result file's name, without .json")
    args = p.parse_args(argv)
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    rows: list[dict[str, Any]] = []
    for jobs in args.jobs or [1000]:
        for notice_s in args.notice_s or [30.0, 120.0]:
            size = (args.server, jobs, args.workers, notice_s, args.storm_s, args.progress_s)
            try:
                rows.append(asyncio.run(one_storm(*size)))
            except TimeoutError as err:  # the row says so; the others still run
                rows.append({"server": args.server, "jobs": jobs, "notice_s": notice_s})
                rows[-1]["failed"] = str(err)
                print(f"jobs {jobs}, notice {notice_s:g} s: {err}", file=sys.stderr)
            print(table(rows[-1:], COLUMNS), file=sys.stderr, flush=True)  # progress
    report = {
        "setup": vars(args) | {"out": str(args.out)},
        "revision": revision(),
        "load_average": os.getloadavg(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    publish(report, rows, COLUMNS, args.out / f"{args.name}.json")
    return report


if __name__ == "__main__":
    main()
