"""A burst of reclaim notices through the real webhook process: latency and non-2xx answers.

    .venv/bin/python -m bench.webhook_burst [--notices 2000] [--concurrency 50] [--jobs 20]
        [--nodes 4] [--visibility-rps N] [--modes before query_per_notice after]

The Temporal dev server allowing `--visibility-rps` (40) visibility calls a second (where the
webhook as it was before issue 27 answered a few percent of this burst 503), `python -m
spotrain.workers.webhook.server` as a process of its own, and N running jobs: a stand-in workflow
that upserts `SpotrainNodeIds` as TrainingJob does and keeps the event ids it is signalled
(the real workflow would shrink on each notice; what is measured here is the webhook). The
notices (`POST /v1/reclaims`, kind `rebalance`, one event id each, round robin over every
job's nodes) go out `--concurrency` at a time, each batch once the previous one is answered,
as the issue's burst did. Per mode, on fresh jobs:

- `before`: SPOTRAIN_WEBHOOK_OWNER_CACHE_TTL_S=0 and SPOTRAIN_WEBHOOK_BUSY_RETRY_S=0.75: a
  visibility query per notice and the 0.75 s retry budget the webhook had before issue 27;
- `query_per_notice`: the query per notice with today's retry budget (4 s);
- `after`: the defaults (the owner index, 4 s).

Reported: request latency (sent to answered, client side) p50/p99/max, non-2xx answers,
notices lost (answered, but their event never reached the job: what the node termination
handler, which does not retry, would lose), the webhook's own visibility-call and retry
counters, and the machine's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from spotrain.workflows.contract import ReclaimNotice
from spotrain.workflows.job import attributes

from .common import REPO, dev_server, publish, summary

TOKEN = "bench-token-not-a-secret"
MODES: dict[str, dict[str, str]] = {
    "before": {"SPOTRAIN_WEBHOOK_OWNER_CACHE_TTL_S": "0", "SPOTRAIN_WEBHOOK_BUSY_RETRY_S": "0.75"},
    "query_per_notice": {"SPOTRAIN_WEBHOOK_OWNER_CACHE_TTL_S": "0"},
    "after": {},
}
COLUMNS = [
    "mode",
    "notices",
    "non_2xx",
    "http_503",
    "lost",
    "p50_ms",
    "p99_ms",
    "max_ms",
    "visibility_calls",
    "retries",
    "seconds",
]


@workflow.defn(name="BurstJob")
class BurstJob:
    """Owns its nodes (as TrainingJob's search attribute says) and keeps what it is told."""

    def __init__(self) -> None:
        self.events: set[str] = set()

    @workflow.run
    async def run(self, node_ids: list[str]) -> None:
        workflow.upsert_search_attributes([attributes.NODE_IDS.value_set(node_ids)])
        await workflow.wait_condition(lambda: False)

    @workflow.signal(name="reclaim")
    def reclaim(self, notice: ReclaimNotice) -> None:
        self.events.add(notice.event_id)

    @workflow.query
    def received(self) -> int:
        return len(self.events)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def webhook_process(address: str, settings: dict[str, str]) -> AsyncIterator[str]:
    """The webhook as it runs in production, on a free loopback port, once it is ready; its
    output goes to a file (a pipe nobody reads would stall it)."""
    port = _free_port()
    env = os.environ | {
        "TEMPORAL_ADDRESS": address,
        "SPOTRAIN_WEBHOOK_HOST": "127.0.0.1",
        "SPOTRAIN_WEBHOOK_PORT": str(port),
        "SPOTRAIN_WEBHOOK_TOKEN": TOKEN,
        **settings,
    }
    with tempfile.TemporaryFile() as log:
        cmd = [sys.executable, "-m", "spotrain.workers.webhook.server"]
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as http:
                for _ in range(600):
                    with contextlib.suppress(aiohttp.ClientError):
                        async with http.get(url + "/readyz") as resp:
                            if resp.status == 200:
                                break
                    await asyncio.sleep(0.05)
                else:
                    raise RuntimeError("the webhook did not become ready in 30 s")
            yield url
        finally:
            proc.terminate()
            proc.wait(30)


async def start_jobs(
    client: Client, task_queue: str, jobs: int, nodes: int
) -> dict[str, WorkflowHandle[Any, Any]]:
    """node id -> its job, once the visibility store shows every job."""
    run = uuid.uuid4().hex[:6]
    owners: dict[str, WorkflowHandle[Any, Any]] = {}
    for j in range(jobs):
        node_ids = [f"i-0{run}{j:03d}{n:02d}" for n in range(nodes)]
        handle = await client.start_workflow(
            "BurstJob", node_ids, id=f"burst-{run}-{j}", task_queue=task_queue
        )
        owners |= {node: handle for node in node_ids}
    query = f"WorkflowId STARTS_WITH 'burst-{run}-' AND SpotrainNodeIds IS NOT NULL"
    while True:
        try:
            if (await client.count_workflows(query)).count == jobs:
                break
        except RPCError as e:
            if e.status != RPCStatusCode.RESOURCE_EXHAUSTED:
                raise
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.5)  # a rate-limited namespace refills before the burst
    return owners


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> int:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(name))  # fmt: skip


async def burst(client: Client, task_queue: str, mode: str, args: argparse.Namespace) -> dict:
    owners = await start_jobs(client, task_queue, args.jobs, args.nodes)
    nodes = sorted(owners)
    address = client.service_client.config.target_host
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
    accepted: Counter[str] = Counter()  # job id -> notices answered 200 for it
    async with (
        webhook_process(address, MODES[mode]) as url,
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http,
    ):

        async def send(i: int) -> None:
            node = nodes[i % len(nodes)]
            body = {"instance_id": node, "event_id": f"{mode}-{i}", "kind": "rebalance"}
            sent = time.perf_counter()
            async with http.post(url + "/v1/reclaims", json=body) as resp:
                await resp.read()
            latencies.append(time.perf_counter() - sent)
            statuses[resp.status] += 1
            if resp.status == 200:
                accepted[owners[node].id] += 1

        started = time.perf_counter()
        for at in range(0, args.notices, args.concurrency):
            await asyncio.gather(
                *(send(i) for i in range(at, min(at + args.concurrency, args.notices)))
            )
        seconds = time.perf_counter() - started
        calls = await metric(http, url, "spotrain_webhook_visibility_calls_total")
        retries = await metric(http, url, "spotrain_webhook_temporal_retries_total")
    delivered = 0
    for handle in {h.id: h for h in owners.values()}.values():
        for _ in range(100):  # signals accepted are in the history; the query may lag a moment
            got = await handle.query("received")
            if got >= accepted[handle.id]:
                break
            await asyncio.sleep(0.1)
        delivered += got
        await handle.terminate()
    stats = summary(latencies)
    return {
        "mode": mode,
        "settings": MODES[mode],
        "notices": args.notices,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "non_2xx": sum(v for k, v in statuses.items() if not 200 <= k < 300),
        "http_503": statuses[503],
        "lost": args.notices - delivered,
        "p50_ms": stats["median"] * 1000,
        "p99_ms": stats["p99"] * 1000,
        "max_ms": stats["max"] * 1000,
        "visibility_calls": calls,
        "retries": retries,
        "seconds": seconds,
    }


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    limits = (
        [f"frontend.namespaceRPS.visibility={args.visibility_rps}"] if args.visibility_rps else []
    )
    rows = []
    async with dev_server(*limits) as env:
        task_queue = f"burst-{uuid.uuid4()}"
        async with Worker(
            env.client,
            task_queue=task_queue,
            workflows=[BurstJob],
            workflow_runner=UnsandboxedWorkflowRunner(),  # a stand-in, no sandbox needed
        ):
            for mode in args.modes:
                rows.append(await burst(env.client, task_queue, mode, args))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.webhook_burst", description=__doc__.split("\n\n")[0])
    p.add_argument("--notices", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=50, help="notices in flight at once")
    p.add_argument("--jobs", type=int, default=20)
    p.add_argument("--nodes", type=int, default=4, help="per job")
    p.add_argument(
        "--visibility-rps",
        type=int,
        default=40,
        help="the namespace's visibility calls a second (0: the dev server's own, ~100 here)",
    )
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    rows = asyncio.run(run(args))
    report = {
        "benchmark": "webhook_burst",
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "load_average": os.getloadavg(),
        "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        "cpus": os.cpu_count(),
        "rows": rows,
    }
    publish(report, rows, COLUMNS, args.out / "webhook_burst.json")
    return report


if __name__ == "__main__":
    main()
