"""The control channel with real rank processes using the training library: the control
record in a file store and in S3 (moto's server), the control file fallback, a channel that
cannot be reached, SIGTERM, and EC2 instance metadata from AWS's own mock (tests/aws/imds_mock.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.local import LocalRuntime
from spotrain.activities.notice import raise_elastic_event
from spotrain.activities.simulated import SimulatedCloud
from spotrain.elastic import control, environment
from spotrain.elastic.job_store import JobStore
from spotrain.workers.embedded.stack import free_port
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.contract import CleanupRequest, GenerationPlan, Member, StopRequest
from spotrain.workflows.job.state import JobStatus
from tests.aws import imds_mock
from tests.jobs import process_spec, sizes

# Steps every 10 ms until the elastic event, counting steps in OUT.steps; then acks (unless
# ACK=0) and writes what raised the event to OUT. It never touches the store while training,
# so a store it cannot reach stops nothing but the channel.
RANK = textwrap.dedent(
    """
    import json, os, sys, time
    from spotrain import elastic

    out = sys.argv[1]
    if os.environ.get("GANG", "1") == "1":
        elastic.wait_for_gang()
    step = 0
    while not elastic.elastic_event_detected():
        time.sleep(0.01)
        step += 1
        if step % 10 == 0:
            with open(out + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(out + ".tmp", out + ".steps")
    if os.environ.get("ACK", "1") == "1":
        elastic.ack_checkpoint(step)
    with open(out, "w") as f:
        json.dump(elastic.elastic_event(), f)
    """
)


class Rank:
    """One rank process (rank 1 of a 2-node generation 4, on node i-b)."""

    def __init__(self, tmp_path: Path, checkpoint: str, **env: str) -> None:
        self.out = tmp_path / "event.json"
        self.control_file = tmp_path / "control"
        self.log = tmp_path / "rank.log"
        self.plan = GenerationPlan(
            job="chan",
            generation=4,
            members=[Member(node_id=n, address="127.0.0.1") for n in ("i-a", "i-b")],
            command=["train"],
            checkpoint=checkpoint,
            total_steps=10**6,
        )
        script = tmp_path / "rank.py"
        script.write_text(RANK)
        rank_env = environment.rank_env(
            self.plan, 1, 0, master_port=29500, control_file=str(self.control_file)
        )
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), str(self.out)],
                env={**os.environ, "SPOTRAIN_CONTROL_POLL_S": "0.1", **rank_env, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def steps(self) -> int:
        try:
            return int((self.out.parent / "event.json.steps").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def wait_training(self, steps: int = 1) -> None:
        deadline = time.monotonic() + 30
        while self.steps() < steps:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.02)

    def event(self, timeout_s: float = 30) -> dict[str, Any]:
        """Wait for a clean exit; what raised its elastic event."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the rank never heard its elastic event:\n{self.log.read_text()}")
        assert code == 0, self.log.read_text()
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def ranks() -> Iterator[Callable[..., Rank]]:
    started: list[Rank] = []

    def start(tmp_path: Path, checkpoint: str, **env: str) -> Rank:
        JobStore(checkpoint).mark_started(4, time.time())
        started.append(Rank(tmp_path, checkpoint, **env))
        return started[-1]

    yield start
    for rank in started:
        rank.stop()


def stop(checkpoint: str) -> float:
    """What a runtime's stop_generation does first: the control record; when it was written."""
    req = StopRequest(
        job="chan", generation=4, world_size=2, checkpoint=checkpoint, graceful=True, grace_s=10
    )
    raise_elastic_event(req)
    return time.time()


def test_control_record_in_a_file_store_reaches_the_rank(
    tmp_path: Path, ranks: Callable[..., Rank]
) -> None:
    ckpt = f"file://{tmp_path}/store"
    rank = ranks(tmp_path, ckpt)
    rank.wait_training(20)
    written = stop(ckpt)
    event = rank.event()
    assert event["source"].startswith("control record") and event["kind"] == "stop"
    assert event["event_id"] == "stop-chan-4"
    assert event["seen"] - written < 5  # polled every 0.1 s here; the figures are in bench/
    assert not rank.control_file.exists()  # the store alone carried it
    assert JobStore(ckpt).acked_ranks(4) == [1]


def test_control_record_in_s3_reaches_the_rank(
    tmp_path: Path, ranks: Callable[..., Rank], moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket="chan")
    ckpt = "s3://chan/jobs/chan"
    rank = ranks(tmp_path, ckpt)
    rank.wait_training(20)  # polling with If-None-Match: 404 (no record), then 304s
    written = stop(ckpt)
    event = rank.event()
    assert event["source"] == "control record s3://chan/jobs/chan/gen-00004/control.json"
    assert event["seen"] - written < 5
    assert JobStore(ckpt).acked_ranks(4) == [1]
    assert "cannot reach" not in rank.log.read_text()


def test_a_rank_that_cannot_reach_the_channel_trains_on_and_says_so_once(
    tmp_path: Path, moto_endpoint: str
) -> None:
    """The store's S3 endpoint refuses connections: the rank keeps stepping, logs the outage
    once (not per poll), and still hears the fallback control file."""
    dead = f"http://127.0.0.1:{free_port()}"
    rank = Rank(tmp_path, "s3://chan/jobs/chan", AWS_ENDPOINT_URL_S3=dead, GANG="0", ACK="0")
    try:
        rank.wait_training(10)
        before = rank.steps()
        time.sleep(2)  # about 20 polls at 0.1 s
        assert rank.steps() > before and rank.proc.poll() is None
        rank.control_file.write_text("checkpoint-and-stop\n")
        event = rank.event()
    finally:
        rank.stop()
    assert event["source"] == "control file"
    assert rank.log.read_text().count("cannot reach the control record") == 1


def test_sigterm_is_an_elastic_event(tmp_path: Path, ranks: Callable[..., Rank]) -> None:
    ckpt = f"file://{tmp_path}/store"
    rank = ranks(tmp_path, ckpt)
    rank.wait_training(10)
    rank.proc.send_signal(signal.SIGTERM)
    event = rank.event()
    assert event["source"] == "SIGTERM"
    assert JobStore(ckpt).acked_ranks(4) == [1]  # checkpointed before leaving


def test_sigterm_handling_can_be_turned_off(tmp_path: Path, ranks: Callable[..., Rank]) -> None:
    rank = ranks(tmp_path, f"file://{tmp_path}/store", SPOTRAIN_SIGTERM="0")
    rank.wait_training(10)
    rank.proc.send_signal(signal.SIGTERM)
    assert rank.proc.wait(30) == -signal.SIGTERM


@pytest.fixture(scope="module")
def aemm() -> Path:
    path = imds_mock.binary()
    if path is None:
        pytest.skip("ec2-metadata-mock not built and no Go toolchain to build it")
    return path


def test_imds_interruption_raises_the_event_and_reports_the_notice(
    tmp_path: Path, ranks: Callable[..., Rank], aemm: Path
) -> None:
    """AWS's mock: a rebalance recommendation at once (reported, training goes on), then a
    spot interruption notice after 3 s (the rank stops itself and reports it)."""
    ckpt = f"file://{tmp_path}/store"
    store = JobStore(ckpt)
    with imds_mock.serve("spot", "-d", "3") as url:
        rank = ranks(tmp_path, ckpt, SPOTRAIN_IMDS_ENDPOINT=url, SPOTRAIN_IMDS_POLL_S="0.2")
        rank.wait_training(1)
        deadline = time.monotonic() + 30
        while not store.notices(4):
            assert time.monotonic() < deadline, rank.log.read_text()
            time.sleep(0.05)
        assert [n["kind"] for n in store.notices(4)] == ["rebalance"]
        assert rank.proc.poll() is None  # a recommendation is the workflow's to act on
        event = rank.event()
    assert event["source"] == "EC2 instance metadata"
    assert event["detail"]["action"] == "terminate"
    notices = {n["kind"]: n for n in store.notices(4)}
    interruption = notices["interruption"]
    assert interruption["node_id"] == "i-b" and interruption["deadline"]
    assert interruption["event_id"] == event["event_id"]
    assert interruption["event_id"] == f"imds-i-b-terminate-{interruption['deadline']}"


# A training loop for the workflow test: the node named by a file in IMDS_DIR hears its EC2
# metadata (the runtime gives one environment to every node; real nodes have their own IMDS).
JOB_RANK = textwrap.dedent(
    """
    import os, sys, time
    imds = os.path.join(os.environ["IMDS_DIR"], os.environ["SPOTRAIN_NODE_ID"])
    if os.path.exists(imds):
        os.environ["SPOTRAIN_IMDS_ENDPOINT"] = open(imds).read()
        os.environ["SPOTRAIN_IMDS_POLL_S"] = "0.2"
    from spotrain import elastic

    elastic.wait_for_gang()
    latest = elastic.latest_checkpoint()
    step = latest["step"] if latest else 0
    while True:
        time.sleep(0.02)
        step += 1
        elastic.report_progress(step)
        if elastic.elastic_event_detected():
            elastic.mark_checkpoint(step, f"ckpt-{step}")
            elastic.ack_checkpoint(step)
            sys.exit(0)
    """
)


async def test_an_imds_notice_reaches_the_workflow_without_a_webhook(
    dev_env: WorkflowEnvironment, tmp_path: Path, aemm: Path
) -> None:
    """The real TrainingJob, local runtime, simulated cloud; no webhook and no signal. Node
    sim-00002's metadata posts a spot interruption: its rank stops itself and reports it, the
    runtime's watch hands it over, and the workflow shrinks once (one reclaim, one effect,
    though the rank reports it on every poll and the watch may see it more than once), then
    grows back on a replacement."""
    script, imds_dir = tmp_path / "train.py", tmp_path / "imds"
    script.write_text(JOB_RANK)
    imds_dir.mkdir()
    port = free_port()
    (imds_dir / "sim-00002").write_text(f"http://127.0.0.1:{port}")
    runtime = LocalRuntime(tmp_path / "rt", term_grace_s=2)
    queue = name = f"imds-{uuid.uuid4().hex[:8]}"
    elastic = {
        "min_nodes": 1,
        "max_nodes": 2,
        "graceful_shutdown_timeout_s": 20,
        "scaling_timeout_s": 60,
        "capacity_check_interval_s": 1,
        "progress_report_interval_s": 0.5,
        "stall_timeout_s": 60,
        "reclaim_policy": "drop",
    }
    spec = process_spec(
        name,
        [sys.executable, str(script)],
        f"file://{tmp_path / 'ckpt'}",
        elastic,
        env={"IMDS_DIR": str(imds_dir)},
        total_steps=10**9,
    )
    with ThreadPoolExecutor(8) as pool:
        async with workflow_worker(
            dev_env.client,
            queue,
            SimulatedCloud(zones=["us-east-1a"]).activities() + runtime.activities(),
            activity_executor=pool,
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob", spec, id=name, task_queue=queue
            )
            try:
                status = await wait_status(handle, lambda s: s.generation == 1 and s.step > 5)
                ranks = {n.node_id: n.rank for n in status.nodes}
                assert ranks.keys() == {"sim-00001", "sim-00002"}
                with imds_mock.serve("spot", port=port):  # the notice, now
                    # shrunk to 1, then grown back on a replacement (it joins at once)
                    status = await wait_status(
                        handle, lambda s: sizes(s)[-2:] == [1, 2] and s.step > 0
                    )
                    await asyncio.sleep(2)  # the notice stays up: no second effect
                    status = await handle.query("status", result_type=JobStatus)
                log = runtime.log_path(name, rank=ranks["sim-00002"] or 0, generation=1)
                assert "elastic event from EC2 instance metadata" in log.read_text()
            finally:
                await handle.cancel()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(handle.result(), 60)
                runtime.cleanup_job(CleanupRequest(job=name))
    assert (sizes(status), status.reclaims) == ([2, 1, 2], 1), status
    # From the timeline, not status.nodes: a job this chatty (checks every second) may have
    # continued as new, which folds ended nodes into the totals.
    gone = [e.detail for e in status.timeline if e.event == "node gone"]
    assert gone == ["spot sim-00002: reclaimed"], status.timeline
    assert any("reclaim notice for sim-00002" in e.detail for e in status.timeline)


async def wait_status(
    handle: WorkflowHandle[Any, Any], ok: Callable[[JobStatus], bool], timeout_s: float = 60
) -> JobStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = await handle.query("status", result_type=JobStatus)
        if ok(status):
            return status
        # the whole status, nodes and timeline: pytest cuts a repr to a line ("Pending", and
        # not why: busy run 14's Karpenter failures said no more)
        assert time.monotonic() < deadline, status.model_dump_json(indent=1)[:6000]
        await asyncio.sleep(0.1)


def test_the_poll_interval_follows_what_a_poll_costs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stat is polled 5x as often as a billed S3 GET; the environment's setting wins, and a
    runtime whose control file is prompt slows a billed store's poll only."""
    monkeypatch.delenv(control.POLL_ENV, raising=False)
    monkeypatch.delenv(control.STORE_POLL_ENV, raising=False)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    file_store, s3_store = JobStore("file:///tmp/spotrain-poll"), JobStore("s3://chan/jobs/chan")
    assert control.poll_interval(file_store) == control.LOCAL_POLL_S == 0.05
    assert control.poll_interval(s3_store) == control.S3_POLL_S == 0.25
    assert control.poll_interval() == 0.05  # the runtime's control file
    monkeypatch.setenv(control.STORE_POLL_ENV, "1")
    assert control.poll_interval(s3_store) == 1.0
    assert control.poll_interval(file_store) == control.poll_interval() == 0.05
    monkeypatch.setenv(control.POLL_ENV, "0.5")
    assert control.poll_interval(file_store) == control.poll_interval(s3_store) == 0.5
    assert control.poll_interval() == 0.5
