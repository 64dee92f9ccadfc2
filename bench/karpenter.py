"""Nodes through Karpenter beside nodes through EC2, and Karpenter's notice path beside the
webhook's, in one run.

    .venv/bin/python -m bench.karpenter [--reclaims 20] [--nodes 2] [--launches 20]

Real: the TrainingJob workflow on the Temporal dev server, a Karpenter controller (its kwok
provider, infra/k8s/controlplane/build.sh karpenter) on the test control plane, the worker's
Karpenter notice watch, the reclaim webhook, moto's EC2 server, and real rank processes on the
local runtime (bench/reaction.py's script: steps every 10 ms, checkpoints and exits on the
elastic event). Stood in for: the kubelet and node lifecycle controller of Karpenter's nodes
(tests/kube/karpenter.py). Boot time is zero on both providers (kwok registers a node at
once, moto runs an instance at once) and the benchmark models none: on AWS add the instance's
boot, the same on both.

- notice_to_ranks_karpenter: from deleting a NodeClaim (what Karpenter's interruption
  controller does on a spot notice) to the last rank's elastic event (the library's latch);
- notice_to_ranks_webhook: from POST /v1/reclaims to the same, in the same job, alternating;
- reclaim_cycle_karpenter / reclaim_cycle_webhook / reclaim_cycle_ec2: from the notice to the
  job back at full size with every rank stepping (notice -> resized -> replacement node ->
  training): the Karpenter job by either notice path, and a job on the EC2 provider (notices
  by the webhook);
- launch_to_ready_karpenter / launch_to_ready_ec2: the launch activity alone, from the
  growth decision (the call) to a Ready node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from moto.server import ThreadedMotoServer
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from spotrain.activities.ec2 import EC2Provider
from spotrain.activities.karpenter import KarpenterProvider
from spotrain.activities.local import LocalRuntime
from spotrain.workers.karpenter_notices import KarpenterNotices
from spotrain.workers.webhook.auth import AuthConfig
from spotrain.workers.webhook.server import WebhookConfig, WebhookService
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.contract import CleanupRequest, LaunchRequest, ReleaseRequest
from tests.kube.k8s_cluster import ControlPlane, binaries
from tests.kube.karpenter import NODE_CLASS, NODEPOOL, TYPES, Karpenter, KarpenterNodes

from .common import REPO, dev_server, publish, summary
from .reaction import SCRIPT, TOKEN, job_spec, post_reclaim, script_times, steady

COLUMNS = ["metric", "n", "median", "p99", "min", "max"]
TYPE = "g5.xlarge"
GPUS, SPOT, ON_DEMAND = TYPES[TYPE]
SPOT_POLICY = {
    "instance_types": [{"name": TYPE, "gpus": 0, "on_demand_price": ON_DEMAND, "spot_price": SPOT}],
    "zones": ["us-east-1a"],
}
Notify = Callable[[str], Awaitable[None]]


async def cycles(
    client: Client,
    root: Path,
    activities: list[Any],
    notices: dict[str, Notify],
    reclaims: int,
    nodes: int,
) -> dict[str, list[float]]:
    """`reclaims` notices to one job, taking the paths of `notices` in turn: per path, notice
    -> ranks' event; and notice -> back at full size ("cycle")."""
    name = f"karpenter-bench-{uuid.uuid4().hex[:8]}"
    script, times = root / f"{name}.py", root / name
    script.write_text(SCRIPT)
    times.mkdir()
    runtime = LocalRuntime(root / "runtime", term_grace_s=2)
    out: dict[str, list[float]] = {}
    with ThreadPoolExecutor(16) as pool:
        async with workflow_worker(
            client, name, activities + runtime.activities(), activity_executor=pool
        ):
            spec = job_spec(name, nodes, script, times, root / f"{name}-ckpt") | {
                "spot": SPOT_POLICY
            }
            handle = await client.start_workflow("TrainingJob", spec, id=name, task_queue=name)
            try:
                for i in range(reclaims):
                    path, notify = list(notices.items())[i % len(notices)]
                    status = await steady(handle, times, nodes, 120)
                    victim = next(n.node_id for n in status.nodes if n.rank == nodes - 1)
                    sent = time.time()
                    await notify(victim or "")
                    while not (ranks := script_times(times, status.generation)) or not all(
                        "event_seen" in t for t in ranks
                    ):
                        await asyncio.sleep(0.005)
                    out.setdefault(f"notice_to_ranks_{path}", []).append(
                        max(t["event_seen"] for t in ranks) - sent
                    )
                    await steady(handle, times, nodes, 120)
                    out.setdefault(f"reclaim_cycle_{path}", []).append(time.time() - sent)
            finally:
                await handle.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(handle.result(), timeout=60)
                runtime.cleanup_job(CleanupRequest(job=name))
    return out


def launches(provider: Any, job: str, count: int) -> list[float]:
    """The launch activity from call to Ready node, `count` times (each released after)."""
    env, seconds = ActivityEnvironment(), []
    for slot in range(count):
        req = LaunchRequest(
            job=job, slot=slot, attempt=0, generation=1, lifecycle="spot", instance_type=TYPE
        ).model_copy(update={"zone": "us-east-1a"})
        start = time.perf_counter()
        node = env.run(provider.launch_node, req)
        seconds.append(time.perf_counter() - start)
        env.run(provider.release_nodes, ReleaseRequest(job=job, node_ids=[node.node_id]))
    return seconds


@asynccontextmanager
async def stack(root: Path) -> AsyncIterator[tuple[Client, ControlPlane, Karpenter, str]]:
    """Temporal, the control plane with Karpenter and its node stand-ins, and moto's EC2."""
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    for key, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench")):
        os.environ.setdefault(key, value)
    try:
        with ControlPlane.running(binaries()) as plane:
            karpenter = Karpenter(plane, root)
            karpenter.install()
            karpenter.start()
            try:
                with KarpenterNodes(plane).serving():
                    async with dev_server() as env:
                        yield env.client, plane, karpenter, f"http://{host}:{port}"
            finally:
                karpenter.stop()
    finally:
        moto.stop()


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="spotrain-karpenter-") as tmp:
        root = Path(tmp)
        async with stack(root) as (client, plane, karpenter, moto_url):
            nodeclaims = KarpenterProvider(plane.admin, node_class=NODE_CLASS, nodepool=NODEPOOL)
            ec2 = EC2Provider(endpoint_url=moto_url)
            webhook = WebhookService(
                client, WebhookConfig(auth=AuthConfig(bearer_token=TOKEN), host="127.0.0.1", port=0)
            )
            url = f"http://127.0.0.1:{await webhook.start()}"
            stop = asyncio.Event()
            watch = asyncio.create_task(KarpenterNotices(client, plane.admin).run(stop))
            try:
                async with aiohttp.ClientSession() as http:

                    async def by_webhook(node: str) -> None:
                        while not await post_reclaim(http, url, node):
                            await asyncio.sleep(0.05)

                    async def by_karpenter(node: str) -> None:
                        await asyncio.to_thread(
                            karpenter.custom.delete_cluster_custom_object,
                            "karpenter.sh",
                            "v1",
                            "nodeclaims",
                            node,
                        )

                    out = await cycles(
                        client,
                        root,
                        nodeclaims.activities(),
                        {"karpenter": by_karpenter, "webhook": by_webhook},
                        2 * args.reclaims,
                        args.nodes,
                    )
                    ec2_out = await cycles(
                        client,
                        root,
                        ec2.activities(),
                        {"ec2": by_webhook},
                        args.reclaims,
                        args.nodes,
                    )
                    out["reclaim_cycle_ec2"] = ec2_out["reclaim_cycle_ec2"]
            finally:
                stop.set()
                await watch
                await webhook.stop()
            out["launch_to_ready_karpenter"] = await asyncio.to_thread(
                launches, nodeclaims, "bench-launch", args.launches
            )
            out["launch_to_ready_ec2"] = await asyncio.to_thread(
                launches, ec2, "bench-launch", args.launches
            )
        return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.karpenter", description=__doc__.split("\n\n")[0])
    p.add_argument("--reclaims", type=int, default=20, help="per notice path")
    p.add_argument("--nodes", type=int, default=2, help="one rank per node")
    p.add_argument("--launches", type=int, default=20, help="per provider")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    logging.getLogger("spotrain").setLevel(logging.WARNING)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # (moto's request log)
    samples = asyncio.run(run(args))
    rows = [
        {"metric": metric.removesuffix("_s") + "_ms", **summary([1000 * v for v in values])}
        for metric, values in samples.items()
    ]
    setup = {k: getattr(args, k) for k in ("reclaims", "nodes", "launches")}
    setup |= {
        "model": "none: each rank steps a 10 ms loop (bench/reaction.py's script), 1 per node",
        "load": os.environ.get("SPOTRAIN_BENCH_LOAD", "not stated"),
        "cpus": os.cpu_count(),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    report = {"setup": setup, "rows": rows, "samples_s": samples}
    publish(report, rows, COLUMNS, args.out / "karpenter.json")
    return report


if __name__ == "__main__":
    main()
