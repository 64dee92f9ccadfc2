"""The worker's Prometheus endpoint and JSON logs, as deployed: `spotrain worker --metrics
--json-logs` as a real subprocess against the real Temporal dev server, running a job of real
rank processes (tests/chaos/train.py, local runtime) through a reclaim notice. The endpoint
serves the Temporal SDK's own metrics beside spotrain's, including how long the notice took to
reach the ranks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.local import LocalRuntime
from spotrain.workers.embedded.stack import free_port
from spotrain.workflows.contract import CleanupRequest
from spotrain.workflows.job.state import JobStatus
from tests.jobs import FAST_ELASTIC, leftover_processes, merge

TRAIN = Path(__file__).parents[1] / "chaos" / "train.py"
REPO = Path(__file__).resolve().parents[2]


def scrape(address: str) -> dict[str, float]:
    """Metric name -> value summed over label sets (lines that failed to parse are skipped)."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match:
            totals[match[1]] = totals.get(match[1], 0.0) + float(match[3])
    return totals


async def test_worker_serves_sdk_and_job_metrics_and_json_logs(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    queue, address = f"metrics-{uuid.uuid4().hex[:6]}", f"127.0.0.1:{free_port()}"
    env = os.environ | {"TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host}
    command = [
        sys.executable,
        "-m",
        "spotrain.workers.cli.main",
        "worker",
        "--provider",
        "simulated",
    ]
    command += ["--runtime", "local", "--task-queue", queue, "--state-dir", str(tmp_path)]
    command += ["--metrics", address, "--metrics-interval-s", "1", "--json-logs"]
    logs = tmp_path / "worker.log"
    with logs.open("w") as out:
        worker = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    name = f"metrics-{uuid.uuid4().hex[:6]}"
    spec = merge(
        {
            "name": name,
            "type": "pytorch",
            "command": [sys.executable, str(TRAIN)],
            "env": {"CHAOS_RECORD_DIR": str(tmp_path), "CHAOS_HOLD_AT": "50"},
            "total_steps": 400,
            "checkpoint": f"file://{tmp_path}/ckpt",
            "spot": {"instance_types": [{"name": "m5.large", "on_demand_price": 0.1}]},
        },
        {"elastic": {"min_nodes": 1, "max_nodes": 2} | FAST_ELASTIC | {"stall_timeout_s": 60}},
    )
    handle = await dev_env.client.start_workflow("TrainingJob", spec, id=name, task_queue=queue)
    try:
        deadline = time.monotonic() + 180  # generous: CI runs two test processes at once
        while True:
            status = await handle.query("status", result_type=JobStatus)
            if status.phase == "Running" and status.step >= 20:
                break
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.2)
        member = next(n.node_id for n in status.nodes if n.rank == 1)
        notice = (datetime.now(UTC) + timedelta(seconds=60)).isoformat()
        await handle.signal("reclaim", {"node_id": member, "deadline": notice, "event_id": "m1"})
        while True:  # the collector refreshes every second
            values = scrape(address)
            if values.get("spotrain_reclaims", 0) >= 1:
                break
            assert time.monotonic() < deadline + 60, values
            await asyncio.sleep(0.3)
    finally:
        await handle.cancel()
        with contextlib.suppress(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), 60)  # the worker tears the job down
        worker.terminate()
        worker.wait(timeout=30)
        LocalRuntime(tmp_path).cleanup_job(CleanupRequest(job=name, keep=True))  # if it did not
    assert not (left := leftover_processes(name)), left
    assert values["spotrain_notice_to_ranks_seconds_count"] == 1
    assert 0 <= values["spotrain_notice_to_ranks_seconds_sum"] < 10
    assert values["spotrain_resizes"] >= 1
    assert any(k.startswith("temporal_") for k in values), sorted(values)[:20]  # the SDK's own
    lines = [line for line in logs.read_text().splitlines() if line.startswith("{")]
    entries = [json.loads(line) for line in lines]
    assert any("spotrain worker on task queue" in e["message"] for e in entries)
    assert all({"time", "level", "logger", "message"} <= set(e) for e in entries)
