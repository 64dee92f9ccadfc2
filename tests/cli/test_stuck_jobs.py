"""A job whose workflow task keeps failing, as users meet it through the CLI against the real
Temporal dev server: `status` and `list` say it is stuck and quote the error, and `release`
terminates it and reaps its instances on moto by their ownership tags, twice without harm."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.client import WorkflowExecutionStatus

from spotrain.activities.ec2_ownership import MANAGED, TAG_JOB
from tests.cli.test_cli import Cli, cli, write  # noqa: F401 (the fixture)
from tests.jobs import fast_spec

ERROR = "Failed decoding arguments"


def launch(ec2: Any, job: str) -> str:
    tags = [{"Key": MANAGED, "Value": "true"}, {"Key": TAG_JOB, "Value": job}]
    return ec2.run_instances(
        ImageId="ami-12c6146b",
        MinCount=1,
        MaxCount=1,
        TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
    )["Instances"][0]["InstanceId"]


def states(ec2: Any, ids: list[str]) -> dict[str, str]:
    reservations = ec2.describe_instances(InstanceIds=ids)["Reservations"]
    return {i["InstanceId"]: i["State"]["Name"] for r in reservations for i in r["Instances"]}


@pytest.mark.slow
async def test_a_stuck_job_is_shown_with_its_error_and_released_by_its_tags(
    cli: Cli,  # noqa: F811
    moto_endpoint: str,
    tmp_path: Path,
) -> None:
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_endpoint)
    spec = fast_spec()
    name = spec["name"]
    # A valid spec, but carried state that is no JobState: the worker cannot decode the
    # workflow's input, so its every workflow task fails and Temporal retries it for ever.
    # (A task timeout long enough that a starved worker's first attempt fails rather than
    # times out: Temporal records no failure after a timeout, and then the CI beside two busy
    # loops saw `status` quote the timeout.)
    handle = await cli.sim.client.start_workflow(
        "TrainingJob",
        args=[spec, "not a JobState"],
        id=name,
        task_queue=cli.sim.task_queue,
        task_timeout=timedelta(seconds=60),
    )
    owned = [launch(ec2, name), launch(ec2, name)]
    other = launch(ec2, f"other-{uuid.uuid4().hex[:6]}")
    deadline = time.monotonic() + 30
    while (await handle.describe()).raw_description.pending_workflow_task.attempt < 2:
        assert time.monotonic() < deadline, "the workflow task never failed"
        await asyncio.sleep(0.2)

    status = (await cli("status", name, "--json")).json()
    assert status["stuck"]["attempt"] >= 2 and ERROR in status["stuck"]["error"], status
    text = await cli("status", name)
    assert text.code == 0 and "is STUCK" in text.out and ERROR in text.out, text
    assert f"spotrain release {name}" in text.out
    rows = {r["name"]: r for r in (await cli("list", "--json")).json()}
    assert ERROR in rows[name]["stuck"]["error"], rows[name]
    listed = await cli("list")
    assert "STUCK" in listed.out and ERROR in listed.out, listed

    healthy = fast_spec(total_steps=100_000)
    assert (await cli("submit", str(write(tmp_path, healthy)))).code == 0
    refused = await cli("release", healthy["name"], "--state-dir", str(tmp_path))
    assert refused.code == 2 and "spotrain cancel" in refused.err, refused
    assert (await cli("cancel", healthy["name"])).code == 0

    released = await cli("release", name, "--state-dir", str(tmp_path), "--json")
    assert released.code == 0, released
    body = released.json()
    assert body["workflow"] == "terminated"
    assert sorted(i["instance_id"] for i in body["instances"]) == sorted(owned)
    assert (await handle.describe()).status == WorkflowExecutionStatus.TERMINATED
    now = states(ec2, [*owned, other])
    assert all(now[i] in ("shutting-down", "terminated") for i in owned), now
    assert now[other] == "running"

    again = await cli("release", name, "--state-dir", str(tmp_path))
    assert again.code == 0, again
    assert "workflow already closed" in again.out and "no live instances" in again.out, again
