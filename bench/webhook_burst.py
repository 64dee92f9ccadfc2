"""A burst of reclaim notices through the real webhook process: latency and non-2xx answers.

    .venv/bin/python -m bench.webhook_burst [--notices 2000] [--concurrency 50] [--jobs 20]
        [--visibility-rps N] [--modes before query_per_notice after]

The Temporal dev server allowing `--visibility-rps` (40) visibility calls a second (where the
webhook as it was before issue 27 answered a few percent of this burst 503), `python -m
spotrain.workers.webhook.server` as a process of its own, and N running TrainingJobs (the
real workflow in a spotrain worker, on the simulated cloud and runtime: no processes) at
full size, which upsert `SpotrainNodeIds` as they do anywhere. The notices (`POST
/v1/reclaims`, kind `rebalance`, one event id each, round robin over every job's nodes) go
out `--concurrency` at a time, each batch once the previous one is answered, as the issue's
burst did; a job without make-before-break notes each recommendation and trains on, so the
jobs keep their nodes through the burst. Per mode, on fresh jobs:

- `before`: SPOTRAIN_WEBHOOK_OWNER_CACHE_TTL_S=0 and SPOTRAIN_WEBHOOK_BUSY_RETRY_S=0.75: a
  visibility query per notice and the 0.75 s retry budget the webhook had before issue 27;
- `query_per_notice`: the query per notice with today's retry budget (4 s);
- `after`: the defaults (the owner index, 4 s).

Reported: request latency (sent to answered, client side) p50/p99/max, non-2xx answers,
notices lost (sent, but their event id is in no job's history as a `reclaim` signal: what
the node termination handler, which does not retry, would lose), the webhook's own
visibility-call and retry counters, and the machine's load average.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.job.signal_input import RECLAIM

from .common import REPO, dev_server, publish, summary
from .scale import NotifiedRuntime, job_spec, until

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
    client: Client, task_queue: str, runtime: NotifiedRuntime, jobs: int
) -> dict[str, WorkflowHandle[Any, Any]]:
    """node id -> its job, once every job runs at full size and the visibility store shows
    each with its nodes."""
    run = uuid.uuid4().hex[:6]
    names = [f"burst-{run}-{j}" for j in range(jobs)]
    handles = [
        await client.start_workflow("TrainingJob", job_spec(n, 30), id=n, task_queue=task_queue)
        for n in names
    ]
    await until(lambda: all(runtime.full_generation(n) for n in names), 60 + jobs, "full size")
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
    return {node: h for h in handles for node in runtime.full_generation(h.id) or []}


async def signalled(handle: WorkflowHandle[Any, Any]) -> set[str]:
    """The event ids of the `reclaim` signals in the job's history (every run of it)."""
    ids: set[str] = set()
    async for event in handle.fetch_history_events():
        if event.HasField("workflow_execution_signaled_event_attributes"):
            attrs = event.workflow_execution_signaled_event_attributes
            if attrs.signal_name == RECLAIM.name:
                ids.add(json.loads(attrs.input.payloads[0].data)["event_id"])
    return ids


async def metric(http: aiohttp.ClientSession, url: str, name: str) -> int:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(name))  # fmt: skip


async def burst(
    client: Client, task_queue: str, runtime: NotifiedRuntime, mode: str, args: argparse.Namespace
) -> dict:
    owners = await start_jobs(client, task_queue, runtime, args.jobs)
    nodes = sorted(owners)
    address = client.service_client.config.target_host
    statuses: Counter[int] = Counter()
    latencies: list[float] = []
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

        started = time.perf_counter()
        for at in range(0, args.notices, args.concurrency):
            await asyncio.gather(
                *(send(i) for i in range(at, min(at + args.concurrency, args.notices)))
            )
        seconds = time.perf_counter() - started
        calls = await metric(http, url, "spotrain_webhook_visibility_calls_total")
        retries = await metric(http, url, "spotrain_webhook_temporal_retries_total")
    jobs = list({h.id: h for h in owners.values()}.values())
    delivered = set().union(*await asyncio.gather(*(signalled(h) for h in jobs)))
    await asyncio.gather(*(h.terminate() for h in jobs))
    stats = summary(latencies)
    return {
        "mode": mode,
        "settings": MODES[mode],
        "notices": args.notices,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "non_2xx": sum(v for k, v in statuses.items() if not 200 <= k < 300),
        "http_503": statuses[503],
        "lost": len({f"{mode}-{i}" for i in range(args.notices)} - delivered),
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
    runtime, cloud = NotifiedRuntime(), SimulatedCloud()
    async with dev_server(*limits) as env:
        task_queue = f"burst-{uuid.uuid4()}"
        with ThreadPoolExecutor(max_workers=16) as pool:
            async with workflow_worker(
                env.client, task_queue, cloud.activities() + runtime.activities(),
                activity_executor=pool,
            ):  # fmt: skip
                for mode in args.modes:
                    rows.append(await burst(env.client, task_queue, runtime, mode, args))
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.webhook_burst", description=__doc__.split("\n\n")[0])
    p.add_argument("--notices", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=50, help="notices in flight at once")
    p.add_argument("--jobs", type=int, default=20)
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
