"""The `spotrain` CLI as users run it: a real subprocess against the real Temporal dev server,
with a TrainingJob worker (simulated cloud and runtime, seconds instead of minutes) in this
test process, the real reclaim webhook on loopback and moto's EC2 server for `gc`.

The subprocesses run through asyncio so that the worker in this event loop keeps serving."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import pytest_asyncio
import yaml
from rich.console import Console
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.ec2_ownership import MANAGED, TAG_JOB, job_tags
from spotrain.activities.ec2_placement import describe, group_name
from spotrain.activities.local import LocalRuntime
from spotrain.elastic.job_store import JobStore, open_store
from spotrain.workers.cli.views import status_view
from spotrain.workers.webhook.auth import AuthConfig
from spotrain.workers.webhook.server import WebhookConfig, WebhookService
from spotrain.workflows.job.state import JobStatus
from tests.aws import moto_placement
from tests.jobs import Sim, fast_runtime, fast_spec, simulated
from tests.workflows.test_planner_job import T0, node, running, state

pytestmark = pytest.mark.slow

TOKEN = "cli-test-token"


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@dataclass
class Cli:
    env: dict[str, str]
    sim: Sim

    async def __call__(self, *argv: str, **env: str) -> Result:
        proc = await self.start(*argv, **env)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.returncode is not None
        return Result(proc.returncode, out.decode(), err.decode())

    async def start(self, *argv: str, **env: str) -> asyncio.subprocess.Process:
        """`spotrain ARGV...` running, its output piped."""
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "spotrain.workers.cli.main",
            *argv,
            env=self.env | env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )

    async def until(self, name: str, check: Callable[[JobStatus], bool]) -> JobStatus:
        """Wait in-process (a query is cheaper than a CLI run) until the job's status holds."""
        handle = self.sim.client.get_workflow_handle(name)
        deadline = time.monotonic() + 20
        while not check(status := await self.sim.status(handle)):
            assert time.monotonic() < deadline, f"timed out: {status.model_dump_json()[:2000]}"
            await asyncio.sleep(0.1)
        return status


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def cli(dev_env: WorkflowEnvironment, moto_endpoint: str) -> AsyncIterator[Cli]:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        service = WebhookService(
            dev_env.client,
            WebhookConfig(auth=AuthConfig(bearer_token=TOKEN), host="127.0.0.1", port=0),
        )
        port = await service.start()
        env = os.environ | {
            "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host,
            "SPOTRAIN_TASK_QUEUE": sim.task_queue,
            "SPOTRAIN_WEBHOOK_URL": f"http://127.0.0.1:{port}",
            "SPOTRAIN_WEBHOOK_TOKEN": TOKEN,
            "SPOTRAIN_EC2_ENDPOINT": moto_endpoint,
            "COLUMNS": "200",
        }
        yield Cli(env, sim)
        await service.stop()


def write(tmp_path: Path, spec: dict[str, Any], suffix: str = ".yaml") -> Path:
    path = tmp_path / f"{spec.get('name', 'job')}{suffix}"
    path.write_text(json.dumps(spec) if suffix == ".json" else yaml.safe_dump(spec))
    return path


async def exists(dev_env: WorkflowEnvironment, name: str) -> bool:
    try:
        await dev_env.client.get_workflow_handle(name).describe()
    except RPCError as e:
        assert e.status == RPCStatusCode.NOT_FOUND
        return False
    return True


async def test_invalid_specs_name_fields_and_start_nothing(
    cli: Cli, dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    spec = fast_spec(elastic={"min_nodes": 5, "max_nodes": 4}, checkpoint="ftp://nope")
    spec["totl_steps"] = 3
    r = await cli("submit", str(write(tmp_path, spec)))
    assert r.code == 2, r
    assert "elastic: min_nodes (5) > max_nodes (4)" in r.err
    assert "totl_steps: Extra inputs are not permitted" in r.err
    assert "Traceback" not in r.err
    assert not await exists(dev_env, spec["name"])

    broken = tmp_path / "broken.json"
    broken.write_text('{"name": ')
    r = await cli("submit", str(broken))
    assert (r.code, "not valid JSON" in r.err) == (2, True), r
    r = await cli("submit", str(tmp_path / "missing.yaml"))
    assert (r.code, "cannot read" in r.err) == (2, True), r
    r = await cli("scale", "x", "--out", "0")
    assert (r.code, "must be >= 1" in r.err) == (2, True), r


async def test_unreachable_temporal_exits_3_naming_the_address(cli: Cli, tmp_path: Path) -> None:
    for argv in (["list"], ["status", "x"], ["gc"], ["submit", str(write(tmp_path, fast_spec()))]):
        r = await cli(*argv, TEMPORAL_ADDRESS="127.0.0.1:1")
        assert r.code == 3, (argv, r)
        assert "cannot reach Temporal at 127.0.0.1:1" in r.err
        assert "Traceback" not in r.err


async def test_steer_a_running_job(cli: Cli, tmp_path: Path) -> None:
    spec = fast_spec(total_steps=100_000)  # runs until cancelled
    name = spec["name"]
    path = write(tmp_path, spec, ".json")
    r = await cli("submit", str(path))
    assert r.code == 0, r
    r = await cli("submit", str(path))
    assert (r.code, "already running" in r.err) == (1, True), r

    await cli.until(name, lambda s: s.world_size == 4)
    status = (await cli("status", name, "--json")).json()
    assert set(status) >= {"name", "phase", "generation", "world_size", "step", "total_steps"}
    assert {"cost_so_far", "nodes", "timeline", "reclaims"} <= set(status)
    assert (status["phase"], status["world_size"]) == ("Running", 4)
    assert {"node_id", "lifecycle", "state", "rank", "price"} <= set(status["nodes"][0])
    r = await cli("status", name)
    assert r.code == 0 and "world size 4" in r.out and "spot" in r.out, r

    query = f"WorkflowId = '{name}' AND SpotrainWorldSize = 4"
    while not [w async for w in cli.sim.client.list_workflows(query)]:
        await asyncio.sleep(0.1)  # visibility is eventually consistent
    rows = (await cli("list", "--phase", "Running", "--json")).json()
    row = next(x for x in rows if x["name"] == name)
    assert (row["phase"], row["spot_nodes"], row["on_demand_nodes"]) == ("Running", 4, 0)
    assert set(row) == {
        "name",
        "phase",
        "status",
        "world_size",
        "spot_nodes",
        "on_demand_nodes",
        "cost",
        "task_queue",
        "started",
        "stuck",
    }
    assert row["stuck"] is None
    rows = (await cli("list", "--phase", "Paused", "--json")).json()
    assert name not in [x["name"] for x in rows]

    r = await cli("scale", name, "--out", "1")
    assert (r.code, "max_nodes is 4" in r.err) == (1, True), r
    r = await cli("scale", name, "--node", "i-nope")
    assert (r.code, "unknown or gone node(s): i-nope" in r.err) == (1, True), r

    victim = next(n["node_id"] for n in status["nodes"] if n["rank"] == 3)
    r = await cli("reclaim", name, "--node", victim, "--deadline-s", "30")
    assert (r.code, "delivered" in r.out) == (0, True), r
    await cli.until(name, lambda s: s.reclaims == 1 and s.phase == "Running")
    r = await cli("reclaim", name, "--node", victim)
    assert (r.code, "not a live node" in r.err) == (1, True), r
    r = await cli("reclaim", name, "--node", status["nodes"][0]["node_id"],
                  SPOTRAIN_WEBHOOK_URL="http://127.0.0.1:1")  # fmt: skip
    assert (r.code, "webhook unreachable at http://127.0.0.1:1" in r.err) == (1, True), r

    assert (await cli("pause", name)).code == 0
    # The update only queues the pause: the job is Paused once its ranks checkpointed and
    # its nodes are released (found in CI: a second pause sent before that was accepted).
    await cli.until(name, lambda s: s.phase == "Paused")
    r = await cli("pause", name)
    assert (r.code, "already paused" in r.err) == (1, True), r
    assert (await cli("resume", name)).code == 0
    await cli.until(name, lambda s: s.phase == "Running" and s.world_size == 4)
    r = await cli("scale", name, "--in", "1")
    assert (r.code, "scaling in by 1 node(s)" in r.out) == (0, True), r
    await cli.until(name, lambda s: s.phase == "Running" and s.world_size == 3)
    r = await cli("scale", name, "--out", "1")
    assert (r.code, "scaling out by 1 node(s)" in r.out) == (0, True), r

    # watched through a pipe: a line as the job moves, not nothing until it ends
    watch = await cli.start("status", name, "--watch", "--interval", "0.2")
    try:
        assert watch.stdout is not None
        first = await asyncio.wait_for(watch.stdout.readline(), 30)
        assert f"{name} Running generation".encode() in first, first
        assert (await cli("cancel", name)).code == 0
        rest, _ = await asyncio.wait_for(watch.communicate(), 60)
    finally:
        if watch.returncode is None:
            watch.kill()
            await watch.wait()
    assert watch.returncode == 0 and f"{name} Cancelled" in rest.decode().splitlines()[-1]
    await cli.until(name, lambda s: s.phase == "Cancelled")
    r = await cli("status", name, "--watch", "--json", "--interval", "0.2")
    assert r.code == 0 and json.loads(r.out.splitlines()[-1])["phase"] == "Cancelled", r
    report = (await cli("report", name, "--json")).json()
    assert (report["phase"], report["reclaims"]) == ("Cancelled", 1)
    events = [e["event"] for e in report["timeline"]]
    assert "paused" in events and "cancelled" in events
    r = await cli("pause", name)
    assert r.code == 1 and "Traceback" not in r.err, r
    r = await cli("reclaim", name, "--node", victim)
    assert (r.code, f"{name} has ended (Cancelled)" in r.err) == (1, True), r
    r = await cli("cancel", name)
    assert (r.code, f"{name} has ended (canceled): nothing to cancel" in r.err) == (1, True), r


async def test_submit_wait_then_report_a_finished_job(cli: Cli, tmp_path: Path) -> None:
    spec = fast_spec(total_steps=120, checkpoint=(tmp_path / "ckpt").as_uri())
    name = spec["name"]
    r = await cli("submit", str(write(tmp_path, spec)), "--wait")
    assert r.code == 0, r
    assert "Succeeded" in r.out and "savings" in r.out

    report = (await cli("report", name, "--json")).json()
    assert (report["phase"], report["finished"], report["steps_done"]) == ("Succeeded", True, 120)
    assert set(report["cost"]) == {
        "total",
        "spot",
        "on_demand",
        "all_on_demand",
        "savings",
        "budget",
        "transfer",
        "transfer_gb",
    }
    assert report["cost"]["transfer"] == 0  # one zone, and no gradient_bytes to bill
    assert report["cost"]["savings"] > 0.5  # all spot at 0.97 versus 3.06 on demand
    assert report["cost"]["spot"] == pytest.approx(report["cost"]["total"])

    png, page = tmp_path / "job.png", tmp_path / "job.html"
    r = await cli("report", name, "--plot", str(png), "--html", str(page))
    assert r.code == 0, r
    assert "generation started" in r.out
    assert png.stat().st_size > 10_000
    assert name in page.read_text() and "data:image/png;base64," in page.read_text()

    r = await cli("status", f"nope-{uuid.uuid4().hex[:6]}")
    assert (r.code, "no running job named" in r.err) == (1, True), r

    # A name is one job: submitting it again is refused, unless the user resumes it, which
    # removes the done marker its ranks left so that the new run trains on.
    r = await cli("submit", str(write(tmp_path, spec)))
    assert (r.code, "already ran" in r.err, "--resume" in r.err) == (1, True, True), r
    JobStore(spec["checkpoint"]).write_done(120, 0.0)  # as the finished job's ranks did
    # Renamed but on the finished job's location: it fails before buying a node.
    renamed = {**spec, "name": f"{name}-again"}
    r = await cli("submit", str(write(tmp_path, renamed)), "--wait")
    assert (r.code, "Failed" in r.out, "already finished (step 120)" in r.out) == (1, True, True)
    assert "node ready" not in r.out and re.search(r"savings\W+-", r.out), r
    r = await cli("submit", str(write(tmp_path, spec)), "--resume")
    assert (r.code, "raise total_steps" in r.err) == (2, True), r
    r = await cli(
        "submit", str(write(tmp_path, {**spec, "total_steps": 240})), "--resume", "--wait"
    )
    assert r.code == 0 and "Succeeded" in r.out, r
    assert JobStore(spec["checkpoint"]).done() is None


async def test_submit_wait_exits_1_when_the_job_fails(cli: Cli, tmp_path: Path) -> None:
    spec = fast_spec(elastic={"max_restarts": 0})  # the first crashed generation fails it
    submit = asyncio.create_task(cli("submit", str(write(tmp_path, spec)), "--wait"))
    while not submit.done():  # crash whatever generation runs until the job gives up
        cli.sim.runtime.fail(spec["name"], "rank 2 exited with code 137")
        await asyncio.sleep(0.2)
    r = submit.result()
    assert r.code == 1, r
    assert "Failed" in r.out and "code 137" in r.out


async def test_gc_lists_then_terminates_orphans_only(
    cli: Cli, moto_endpoint: str, tmp_path: Path
) -> None:
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_endpoint)
    west = boto3.client("ec2", region_name="us-west-2", endpoint_url=moto_endpoint)
    live_job = fast_spec(total_steps=100_000)
    assert (await cli("submit", str(write(tmp_path, live_job)))).code == 0

    def launch(job: str, client: Any = ec2) -> str:
        tags = [{"Key": MANAGED, "Value": "true"}, {"Key": TAG_JOB, "Value": job}]
        return client.run_instances(
            ImageId="ami-12c6146b",
            MinCount=1,
            MaxCount=1,
            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
        )["Instances"][0]["InstanceId"]

    orphan, kept = launch(f"gone-{uuid.uuid4().hex[:6]}"), launch(live_job["name"])
    west_orphan = launch(f"gone-{uuid.uuid4().hex[:6]}", west)
    r = await cli("gc", "--apply", TEMPORAL_ADDRESS="127.0.0.1:1")
    assert r.code == 3, r
    dry = (await cli("gc", "--json")).json()
    assert dry["applied"] is False
    ids = [o["instance_id"] for o in dry["orphans"]]
    assert orphan in ids and kept not in ids and west_orphan not in ids  # home region only
    both = ["--region", "us-east-1", "--region", "us-west-2"]
    ids = [o["instance_id"] for o in (await cli("gc", "--json", *both)).json()["orphans"]]
    assert {orphan, west_orphan} <= set(ids) and kept not in ids
    assert set(dry["orphans"][0]) == {
        "instance_id",
        "job",
        "state",
        "instance_type",
        "zone",
        "launched",
    }
    assert (await cli("gc", "--apply", *both)).code == 0
    states = {
        i["InstanceId"]: i["State"]["Name"]
        for client, asked in ((ec2, [orphan, kept]), (west, [west_orphan]))
        for res in client.describe_instances(InstanceIds=asked)["Reservations"]
        for i in res["Instances"]
    }
    gone = ("shutting-down", "terminated")
    assert states[orphan] in gone and states[west_orphan] in gone and states[kept] == "running"
    assert (await cli("cancel", live_job["name"])).code == 0


async def test_gc_and_release_delete_placement_groups_by_tag(
    cli: Cli, moto_endpoint: str, tmp_path: Path
) -> None:
    """Cluster placement groups of jobs that do not run (moto given the API: it has none):
    `gc` lists them, `release` deletes its job's, `gc --apply` the rest; a running job's stay."""
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_endpoint)
    live_job = fast_spec(total_steps=100_000)
    gone, stuck = (f"{what}-{uuid.uuid4().hex[:6]}" for what in ("gone", "stuck"))
    names = {job: group_name(job, "us-east-1a") for job in (gone, stuck, live_job["name"])}
    with moto_placement.installed():
        assert (await cli("submit", str(write(tmp_path, live_job)))).code == 0
        for job, name in names.items():
            tags = [{"ResourceType": "placement-group", "Tags": job_tags(job)}]
            ec2.create_placement_group(GroupName=name, Strategy="cluster", TagSpecifications=tags)
        dry = (await cli("gc", "--json")).json()
        listed = {g["name"]: g for g in dry["placement_groups"]}
        assert listed[names[gone]] == {"name": names[gone], "job": gone, "state": "available"}
        assert names[stuck] in listed and names[live_job["name"]] not in listed
        released = (await cli("release", stuck, "--json")).json()
        assert released["placement_groups"] == [
            {"name": names[stuck], "job": stuck, "state": "deleted"}
        ]
        assert describe(ec2, names[stuck]) is None and describe(ec2, names[gone]) is not None
        r = await cli("gc", "--apply")
        assert r.code == 0 and f"placement group {names[gone]} of {gone}: deleted" in r.out, r
        assert describe(ec2, names[gone]) is None
        assert describe(ec2, names[live_job["name"]]) is not None
        assert (await cli("cancel", live_job["name"])).code == 0
        ec2.delete_placement_group(GroupName=names[live_job["name"]])


async def test_logs_of_the_local_runtime(cli: Cli, tmp_path: Path) -> None:
    runtime = LocalRuntime(tmp_path)
    for generation in (1, 2):
        log = runtime.log_path("job-a", 1, generation)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"rank 1 of generation {generation}\n")
    r = await cli("logs", "job-a", "--rank", "1", "--state-dir", str(tmp_path))
    assert (r.code, r.out) == (0, "rank 1 of generation 2\n"), r
    r = await cli("logs", "job-a", "--rank", "1", "--generation", "1", "--state-dir", str(tmp_path))
    assert r.out == "rank 1 of generation 1\n", r
    r = await cli("logs", "job-a", "--rank", "7", "--state-dir", str(tmp_path))
    assert (r.code, "no log for job-a rank 7" in r.err) == (1, True), r


async def test_a_job_paused_at_its_budget_resumes_once_raised(cli: Cli, tmp_path: Path) -> None:
    pricey = {"name": "p3.2xlarge", "gpus": 1, "on_demand_price": 30.6, "spot_price": 9.7}
    spec = fast_spec(budget_usd=0.05, spot={"instance_types": [pricey]})  # ~5 s of 4 nodes
    name = spec["name"]
    assert (await cli("submit", str(write(tmp_path, spec)))).code == 0
    paused = await cli.until(name, lambda s: s.phase == "Paused")
    # Spent: what the nodes cost until released, which takes a checkpoint and a stop after
    # the cap was reached (each second of 4 nodes is a cent here: two in a busy run).
    # Paused, the job spends nothing more: every later figure is this one.
    spent = f"${paused.cost_so_far:.2f}"
    assert 0.05 <= paused.cost_so_far < 0.15, paused.cost_so_far  # (within 10 s of it)
    r = await cli("status", name)
    assert f"cost so far {spent} (budget $0.05)" in r.out, r
    reached = re.search(r"paused: budget reached: \$(\d+\.\d\d) of \$0\.05", r.out)
    assert reached and 0.05 <= float(reached[1]) <= float(spent[1:]), r  # (when noticed)
    r = await cli("resume", name)
    assert (r.code, "of $0.05; raise it first" in r.err) == (1, True), r
    r = await cli("budget", name, "--usd", "0")
    assert (r.code, "positive number of USD" in r.err) == (2, True), r
    r = await cli("budget", name, "--usd", "1")
    assert (r.code, r.out) == (0, f"{name}: budget set: {spent} of $1.00\n"), r
    assert (await cli("resume", name)).code == 0
    done = await cli.until(name, lambda s: s.phase == "Succeeded")
    assert done.step == 600 and done.budget_usd == 1.0 and done.paused_reason is None


async def test_help_everywhere_has_examples(cli: Cli) -> None:
    for command in ("submit", "scale", "report"):  # one parser builds them all
        r = await cli(command, "--help")
        assert r.code == 0 and "examples:" in r.out and "Exit codes" in r.out, (command, r)
    for command in ("dev", "demo", "worker", "webhook", "pool"):  # their own parsers
        r = await cli(command, "--help")
        assert r.code == 0 and "usage:" in r.out and "examples:" in r.out, (command, r)
    r = await cli("frobnicate")
    assert r.code == 2, r


async def test_pool_create_status_set_and_a_pooled_job(cli: Cli, tmp_path: Path) -> None:
    pool = f"pool-{uuid.uuid4().hex[:6]}"
    r = await cli("pool", "create", pool, "--max-nodes", "3", "--team-budget", "vision=9.5")
    assert r.code == 0, r
    assert (await cli("pool", "create", pool)).code == 1  # one pool per name
    r = await cli("pool", "set", pool, "--max-nodes", "x")
    assert r.code == 2 and "invalid" in r.err, r
    r = await cli("pool", "set", pool, "--max-gpus", "-1")
    assert r.code == 2 and "max_gpus" in r.err and "Traceback" not in r.err, r

    missing = fast_spec(pool={"name": "nowhere"})
    r = await cli("submit", str(write(tmp_path, missing)))
    assert r.code == 1 and "no capacity pool named 'nowhere'" in r.err, r

    spec = fast_spec(total_steps=20_000, pool={"name": pool, "team": "vision"})
    assert (await cli("submit", str(write(tmp_path, spec)))).code == 0
    await cli.until(spec["name"], lambda s: s.phase == "Running" and s.world_size == 3)
    r = await cli("pool", "status", pool, "--json")
    status = r.json()
    assert status["usage"]["nodes"] == 3 and status["config"]["max_nodes"] == 3, status
    (job,) = status["jobs"]
    assert (job["job"], job["granted"], job["state"]) == (spec["name"], 3, "running")

    r = await cli("pool", "set", pool, "--max-nodes", "2")  # the job gives one back
    assert r.code == 0 and "max nodes 2" in r.out, r
    await cli.until(spec["name"], lambda s: s.phase == "Running" and s.world_size == 2)
    r = await cli("pool", "status", pool)
    assert r.code == 0 and spec["name"] in r.out and "team vision" in r.out, r
    r = await cli("pool", "list", "--json")
    assert pool in [p["name"] for p in r.json()], r
    assert (await cli("cancel", spec["name"])).code == 0
    assert (await cli("pool", "status", "nowhere")).code == 1


async def test_gc_reaps_checkpoints_of_jobs_temporal_no_longer_knows(
    cli: Cli, moto_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    live_job = fast_spec(total_steps=100_000)
    assert (await cli("submit", str(write(tmp_path, live_job)))).code == 0
    bucket = f"gc-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    roots = [f"file://{tmp_path}/ckpts", f"s3://{bucket}/jobs"]
    gone = f"gone-{uuid.uuid4().hex[:6]}"
    env = {"AWS_ENDPOINT_URL_S3": moto_endpoint}
    for root in roots:
        for job in (live_job["name"], gone):
            store = JobStore(f"{root}/{job}")
            store.mark_started(1, 0.0)
            store.record_checkpoint({"step": 10, "kind": "periodic"})
        open_store(root).put_json("notes/readme.json", {"not": "a job"})
    args = [a for root in roots for a in ("--checkpoints", root)]
    dry = (await cli("gc", "--json", *args, **env)).json()
    assert dry["checkpoints"] == {root: [gone] for root in roots}
    assert (await cli("gc", "--apply", *args, **env)).code == 0
    for root in roots:
        keys = open_store(root).list_keys("")
        assert not any(k.startswith(f"{gone}/") for k in keys)
        assert f"{live_job['name']}/ckpt/complete/0000010.json" in keys
        assert "notes/readme.json" in keys
    assert (await cli("cancel", live_job["name"])).code == 0


def test_status_shows_whole_instance_ids_at_80_columns() -> None:
    """`spotrain status` on an 80-column terminal: the node column never wraps or cuts an id
    (the one thing a user copies from it, to `spotrain reclaim --node`)."""
    s = running(state(), [0, 1])
    s.nodes = [node(0), node(1, "on-demand", itype="g4dn.12xlarge", zone="ap-southeast-2c")]
    for n, long_id in zip(s.nodes, ("i-0123456789abcdef0", "i-0fedcba9876543210"), strict=True):
        n.node_id, n.reason = long_id, "a replacement for a node reclaimed with notice"
    console = Console(width=80, record=True)
    console.print(status_view(s.status(T0)))
    text = console.export_text()
    assert "i-0123456789abcdef0" in text and "i-0fedcba9876543210" in text, text
