"""A job driven only with the real `temporal` binary, as the docs tell users to: start from the
same JSON the YAML maps to, signal, update, query, list by search attribute, cancel.

The worker (simulated cloud and runtime) runs in this test process; the CLI runs through
asyncio so that it keeps serving."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.testing import WorkflowEnvironment

from spotrain.workers.embedded.binaries import temporal_cli
from tests.jobs import fast_runtime, fast_spec, simulated


async def temporal(address: str, *argv: str) -> Any:
    proc = await asyncio.create_subprocess_exec(
        temporal_cli(),
        *argv,
        "--address",
        address,
        "--output",
        "json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
    assert proc.returncode == 0, (argv, err.decode())
    text = out.decode().strip()
    return json.loads(text) if text.startswith(("{", "[")) else text


async def test_drive_a_job_with_the_temporal_cli(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    address = dev_env.client.service_client.config.target_host
    spec = fast_spec(total_steps=100_000)
    name = spec["name"]
    job_json = tmp_path / "job.json"
    job_json.write_text(json.dumps(spec))

    async def status() -> dict[str, Any]:
        answer = await temporal(address, "workflow", "query", "-w", name, "--type", "status")
        return answer["queryResult"][0]

    async def until(check: Any) -> dict[str, Any]:
        for _ in range(100):
            s = await status()
            if check(s):
                return s
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out: {s}")

    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        start = ["workflow", "start", "--type", "TrainingJob", "--task-queue", sim.task_queue]
        await temporal(address, *start, "--workflow-id", name, "--input-file", str(job_json))
        s = await until(lambda s: s["world_size"] == 4)

        query = f"SpotrainPhase='Running' AND WorkflowId='{name}'"
        for _ in range(50):  # visibility is eventually consistent
            listed = await temporal(address, "workflow", "list", "--query", query)
            if listed:
                break
            await asyncio.sleep(0.2)
        assert [w["execution"]["workflowId"] for w in listed] == [name]

        answer = await temporal(
            address, "workflow", "update", "execute", "-w", name, "--name", "scale_in",
            "--input", json.dumps({"count": 1}),
        )  # fmt: skip
        assert "scaling in by 1" in json.dumps(answer)
        s = await until(lambda s: s["world_size"] == 3 and s["phase"] == "Running")

        victim = next(n["node_id"] for n in s["nodes"] if n["rank"] == 0)
        deadline = (datetime.now(UTC) + timedelta(seconds=30)).isoformat()
        notice = {"node_id": victim, "deadline": deadline, "event_id": "temporal-cli-1"}
        await temporal(
            address, "workflow", "signal", "-w", name, "--name", "reclaim",
            "--input", json.dumps(notice),
        )  # fmt: skip
        s = await until(lambda s: s["reclaims"] == 1 and s["phase"] == "Running")
        assert victim not in [n["node_id"] for n in s["nodes"] if n["rank"] is not None]

        await temporal(address, "workflow", "cancel", "-w", name)
        s = await until(lambda s: s["phase"] == "Cancelled")
        assert sim.cloud.running() == []
