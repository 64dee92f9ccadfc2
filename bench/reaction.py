"""Reaction and resize overhead with real processes, on every notice path, in one run.

    .venv/bin/python -m bench.reaction [--reclaims 200] [--nodes 2] [--imds-samples 20]
        [--sigterm-samples 50]

Local runtime, whole path: the real TrainingJob workflow on the Temporal dev server, the
reclaim webhook (WebhookService, in this process, on loopback), and a worker with the local
runtime starting real training processes (a cheap loop using `spotrain.elastic`);
nodes come from the simulated cloud (always capacity). Each reclaim is a POST to
/v1/reclaims.

- notice_to_ranks_local: from sending the POST to the last rank of the generation having its
  elastic event (the library's latch time, through the control channel);
- notice_to_control_file_local: from the POST to the runtime's fallback control file
  appearing (stat-polled every 1 ms by the benchmark);
- resize_overhead_local: from that event to the next generation running (every rank at its
  first step), minus what the script itself spent (checkpointing after the event, and its
  own start-up from its first line to its first step): what spotrain adds.

Then, with the same script, as many reclaims on the Kubernetes runtime and samples of the
other notice paths (bench/reaction_paths.py): stop_to_ranks_kube (the stop activity's start
to every rank's event), imds_notice_to_rank, sigterm_to_ack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import tempfile
import textwrap
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
from temporalio.client import Client, WorkflowHandle

from spotrain.activities.local import LocalRuntime
from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.webhook.auth import AuthConfig
from spotrain.workers.webhook.server import WebhookConfig, WebhookService
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.contract import CleanupRequest
from spotrain.workflows.job.state import JobStatus
from tests.aws import imds_mock

from . import reaction_paths as paths
from .common import REPO, dev_server, publish, summary

TOKEN = "bench-token-not-a-secret"
NOTICE_S = 120.0  # what AWS gives; the target is well under 1% of it
COLUMNS = ["metric", "n", "median", "p99", "min", "max", "median_pct_of_notice"]

# Steps every 10 ms; on the elastic event: checkpoint marker, ack, exit 0. Records its own
# timings (first line, first step, event seen, acked) for the overhead arithmetic.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    first_line = time.time()
    from spotrain import elastic

    s = elastic.wait_for_gang()
    tag = os.environ.get("BENCH_TAG") or os.environ.get("BENCH_PREFIX", "") + str(s.generation)
    out = os.path.join(os.environ["BENCH_TIMES"], f"{tag}-{s.rank}.json")
    times = {"first_line": first_line}

    def record(**marks):
        times.update(marks)
        with open(out + ".tmp", "w") as f:
            json.dump(times, f)
        os.replace(out + ".tmp", out)

    latest = elastic.latest_checkpoint()
    step = latest["step"] if latest else 0
    record(first_step=time.time())
    while True:
        time.sleep(0.01)
        step += 1
        elastic.report_progress(step)
        if elastic.elastic_event_detected():
            seen = elastic.elastic_event()["seen"]  # when the library's channel latched it
            elastic.mark_checkpoint(step, f"ckpt-{step}")
            elastic.ack_checkpoint(step)
            record(event_seen=seen, acked=time.time())
            sys.exit(0)
    """
)


class ControlWatch:
    """Stat-polls the control file of generation 1, 2, ... in turn every 1 ms in a thread;
    notes when each one first appears (every resize, for shrinks and grows alike)."""

    def __init__(self, runtime: LocalRuntime, job: str) -> None:
        self.runtime, self.job = runtime, job
        self.generation = 1
        self.seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            if self.runtime.control_file(self.job, self.generation).exists():
                self.seen[self.generation] = time.time()
                self.generation += 1
            time.sleep(0.001)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def job_spec(name: str, nodes: int, script: Path, times: Path, checkpoint: Path) -> dict[str, Any]:
    return {
        "name": name,
        "type": "pytorch",
        "command": [sys.executable, str(script)],
        "env": {"BENCH_TIMES": str(times)},
        "total_steps": 10**9,
        "checkpoint": f"file://{checkpoint}",
        "elastic": {
            "min_nodes": 1,
            "max_nodes": nodes,
            "graceful_shutdown_timeout_s": 10,
            "scaling_timeout_s": 0.2,
            "faulty_scale_down_timeout_s": 3,
            "capacity_check_interval_s": 1,
            "progress_report_interval_s": 0.5,
            "stall_timeout_s": 60,
        },
        "spot": {
            "instance_types": [
                {"name": "p3.2xlarge", "gpus": 1, "on_demand_price": 3.06, "spot_price": 0.97}
            ],
            "zones": ["us-east-1a"],
        },
    }


def script_times(times: Path, generation: int) -> list[dict[str, float]]:
    return [json.loads(p.read_text()) for p in times.glob(f"{generation}-*.json")]


async def steady(
    handle: WorkflowHandle[Any, Any], times: Path, nodes: int, timeout_s: float = 60
) -> JobStatus:
    """Wait for a generation at full size whose every rank is stepping."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = await handle.query("status", result_type=JobStatus)
        ranks = script_times(times, status.generation)
        if status.phase == "Running" and status.world_size == nodes and len(ranks) == nodes:
            return status
        await asyncio.sleep(0.02)
    raise TimeoutError("the job did not get back to full size")


async def post_reclaim(http: aiohttp.ClientSession, url: str, node_id: str) -> bool:
    """True once the webhook signalled the job (visibility may lag a fresh node id)."""
    deadline = datetime.now(UTC) + timedelta(seconds=NOTICE_S)
    body = {"instance_id": node_id, "event_id": uuid.uuid4().hex, "deadline": deadline.isoformat()}
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with http.post(f"{url}/v1/reclaims", json=body, headers=headers) as resp:
        return (await resp.json()).get("status") == "signalled"


def overheads(watch: ControlWatch, times: Path) -> list[float]:
    """Per resize: event -> next generation running, less the script's checkpoint and
    start-up time."""
    out = []
    for g, event in sorted(watch.seen.items()):
        stopping, starting = script_times(times, g), script_times(times, g + 1)
        if not starting or not stopping or not all("acked" in t for t in stopping):
            continue  # (a generation stopped before its ranks began, under load: no sample)
        running = max(t["first_step"] for t in starting)
        checkpoint = max(t["acked"] - t["event_seen"] for t in stopping)
        startup = max(t["first_step"] - t["first_line"] for t in starting)
        out.append(running - event - checkpoint - startup)
    return out


async def measure(client: Client, root: Path, reclaims: int, nodes: int) -> dict[str, Any]:
    script, times = root / "train.py", root / "times"
    script.write_text(SCRIPT)
    times.mkdir()
    runtime = LocalRuntime(root / "runtime", term_grace_s=2)
    cloud = SimulatedCloud(zones=["us-east-1a"])
    webhook = WebhookService(
        client, WebhookConfig(auth=AuthConfig(bearer_token=TOKEN), host="127.0.0.1", port=0)
    )
    url = f"http://127.0.0.1:{await webhook.start()}"
    queue, name = uuid.uuid4().hex, f"reaction-{uuid.uuid4().hex[:8]}"
    notices: list[float] = []
    sent_at: dict[int, float] = {}  # generation stopped -> when its reclaim was sent
    with ThreadPoolExecutor(max_workers=16) as pool:
        async with (
            workflow_worker(
                client,
                queue,
                cloud.activities() + runtime.activities(),
                activity_executor=pool,
            ),
            aiohttp.ClientSession() as http,
        ):
            spec = job_spec(name, nodes, script, times, root / "checkpoints")
            handle = await client.start_workflow("TrainingJob", spec, id=name, task_queue=queue)
            watch = ControlWatch(runtime, name)
            try:
                for _ in range(reclaims):
                    status = await steady(handle, times, nodes)
                    victim = next(n.node_id for n in status.nodes if n.rank == nodes - 1)
                    sent = time.time()
                    while not await post_reclaim(http, url, victim or ""):
                        await asyncio.sleep(0.05)
                        sent = time.time()
                    while status.generation not in watch.seen:
                        await asyncio.sleep(0.001)
                    notices.append(watch.seen[status.generation] - sent)
                    sent_at[status.generation] = sent
                    await steady(handle, times, nodes)  # shrunk, then grown back
            finally:
                watch.stop()
                await handle.cancel()
                with contextlib.suppress(Exception):  # teardown stops every rank: let it run
                    await asyncio.wait_for(handle.result(), timeout=60)
                runtime.cleanup_job(CleanupRequest(job=name))  # and if it could not, we do
                await webhook.stop()
    ranks = [
        max(t["event_seen"] for t in script_times(times, g)) - sent for g, sent in sent_at.items()
    ]
    return {
        "notice_to_ranks_local_s": ranks,
        "notice_to_control_file_local_s": notices,
        "resize_overhead_local_s": overheads(watch, times),
    }


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="spotrain-reaction-") as tmp:
        root = Path(tmp)
        async with dev_server() as env:
            out = await measure(env.client, root, args.reclaims, args.nodes)
        script, times = root / "train.py", root / "times"
        out["stop_to_ranks_kube_s"] = paths.kube_reclaims(
            root, script, times, args.reclaims, args.nodes
        )
        if imds_mock.binary() is not None:
            out["imds_notice_to_rank_s"] = paths.samples(
                paths.imds_sample, root, script, times, args.imds_samples, "imds"
            )
        out["sigterm_to_ack_s"] = paths.samples(
            paths.sigterm_sample, root, script, times, args.sigterm_samples, "term"
        )
        return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="bench.reaction", description=__doc__.split("\n\n")[0])
    p.add_argument("--reclaims", type=int, default=200)
    p.add_argument("--nodes", type=int, default=2, help="one rank per node")
    p.add_argument("--imds-samples", type=int, default=20)
    p.add_argument("--sigterm-samples", type=int, default=50)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    logging.getLogger("temporalio").setLevel(logging.ERROR)
    logging.getLogger("spotrain").setLevel(logging.WARNING)
    samples = asyncio.run(run(args))
    rows = []
    for metric, values in samples.items():
        stats = summary([1000 * v for v in values])  # milliseconds
        pct = stats.get("median", 0) / (10 * NOTICE_S)  # ms / (120 s * 1000) * 100
        metric_ms = metric.removesuffix("_s") + "_ms"
        rows.append({"metric": metric_ms, **stats, "median_pct_of_notice": pct})
    setup = {k: getattr(args, k) for k in ("reclaims", "nodes", "imds_samples", "sigterm_samples")}
    report = {"setup": setup, "rows": rows}
    report["samples_s"] = samples
    publish(report, rows, COLUMNS, args.out / "reaction.json")
    return report


if __name__ == "__main__":
    main()
