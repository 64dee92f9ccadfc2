"""Checkpoints for real: gloo ranks as subprocesses save and load DCP checkpoints through
spotrain.elastic.checkpoint, straight to moto's S3 server on loopback (and to files)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.s3 import models as s3_models
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.local import LocalRuntime
from spotrain.elastic.job_store import JobStore, StoreUnusable, checked_store
from spotrain.workers.embedded.stack import free_port
from spotrain.workflows.contract import CONFIG_ERROR
from tests.jobs import job_spec, simulated
from tests.warm_python import WARM_PYTHON

pytest.importorskip("torch")
pytest.importorskip("s3torchconnector")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_python_server")]  # (warm_python.py)

RANK = Path(__file__).resolve().parent / "ckpt_rank.py"


@pytest.fixture
def bucket(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)  # moto's per-request lines
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=name)
    yield name


def run_ranks(
    world: int, ops: list[list[Any]], uri: str, *, generation: int = 1, keep: int = 3
) -> dict[int, list[dict[str, Any]]]:
    """`world` gloo ranks of ckpt_rank.py; each rank's JSON lines, by rank."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SPOTRAIN_JOB": "ckpt",
            "SPOTRAIN_GENERATION": str(generation),
            "SPOTRAIN_CHECKPOINT": uri,
            "SPOTRAIN_TOTAL_STEPS": "100",
            "SPOTRAIN_CHECKPOINT_KEEP": str(keep),
        }
        procs.append(
            subprocess.Popen(
                [*WARM_PYTHON, str(RANK), json.dumps(ops)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = {}
    for rank, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[:1500] + " ... " + stderr[-1500:]
        out[rank] = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        out[rank][0]["stderr"] = stderr
    return out


def s3_keys(bucket: str, prefix: str = "") -> list[str]:
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def test_saved_at_three_ranks_on_s3_loads_at_two(bucket: str) -> None:
    uri = f"s3://{bucket}/job"
    run_ranks(3, [["save", 10, "periodic"]], uri)
    keys = s3_keys(bucket, "job/ckpt/step-0000010/")
    assert "job/ckpt/step-0000010/.metadata" in keys and len(keys) >= 2, keys

    loaded = run_ranks(2, [["load"]], uri, generation=2)
    for rank in (0, 1):
        assert loaded[rank][0]["step"] == 10
        assert loaded[rank][0]["values"] == [10.0] and loaded[rank][0]["saved_step"] == 10
    store = JobStore(uri)
    assert store.latest_checkpoint() == {"step": 10, "path": f"{uri}/ckpt/step-0000010"}
    assert store.loaded_step(2) == 10
    [record] = store.checkpoints()
    assert record["kind"] == "periodic" and record["world_size"] == 3
    assert record["bytes"] > 64 * 48 * 4 and record["duration_s"] > 0


@pytest.fixture
def slow_puts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str]]:
    """moto's S3 (in this process) takes 1.5 s over every object of the step-20 checkpoint;
    every PUT is logged with its time, in order."""
    original = s3_models.S3Backend.put_object
    log: list[tuple[float, str]] = []
    lock = threading.Lock()

    def put_object(self: Any, bucket_name: str, key_name: str, *args: Any, **kw: Any) -> Any:
        if "step-0000020/" in key_name:
            time.sleep(1.5)
        with lock:
            log.append((time.monotonic(), key_name))
        return original(self, bucket_name, key_name, *args, **kw)

    monkeypatch.setattr(s3_models.S3Backend, "put_object", put_object)
    return log


def test_async_save_runs_beside_training_never_two_in_flight(
    bucket: str, slow_puts: list[tuple[float, str]]
) -> None:
    uri = f"s3://{bucket}/job"
    ops = [["save", 10, "periodic"], ["async", 20], ["steps", 6], ["async", 30], ["close"]]
    out = run_ranks(2, ops, uri)
    for rank in (0, 1):
        _, first_async, steps, second_async, _ = out[rank]
        # Training went on while step 20 was written (>= 1.5 s per object): staging only.
        assert first_async["in_flight"] and first_async["blocked_s"] < 1.0, first_async
        # The marker stayed at the previous complete checkpoint while 20 was in flight.
        assert set(steps["markers"]) == {10}, steps
        # The next save waited for the one in flight instead of running beside it.
        assert second_async["blocked_s"] > 0.5, second_async
    step20 = [t for t, k in slow_puts if "step-0000020/" in k]
    step30 = [t for t, k in slow_puts if "step-0000030/" in k]
    assert step20 and step30 and max(step20) < min(step30), slow_puts
    store = JobStore(uri)
    assert store.latest_checkpoint()["step"] == 30
    records = {r["step"]: r for r in store.checkpoints()}
    assert set(records) == {10, 20, 30}
    assert records[20]["kind"] == "periodic" and records[20]["duration_s"] >= 1.5
    assert records[20]["blocked_s"] < records[20]["duration_s"]
    assert records[10]["blocked_s"] == records[10]["duration_s"]  # synchronous


@pytest.mark.parametrize("scheme", ["file", "s3"])
def test_retention_keeps_last_k_and_the_loaded_one_and_removes_leftovers(
    scheme: str, bucket: str, tmp_path: Path
) -> None:
    uri = f"s3://{bucket}/job" if scheme == "s3" else f"file://{tmp_path}/job"
    store = JobStore(uri)
    run_ranks(2, [["save", 10, "periodic"], ["save", 20, "periodic"]], uri, keep=2)
    # A save that never completed (files, no record), older than what comes next.
    store.store.put_json("ckpt/step-0000025/__0_0.distcp", {"partial": True})
    # A save still being written (files, no record yet), newer than any complete one.
    store.store.put_json("ckpt/step-0000045/__0_0.distcp", {"partial": True})
    # Generation 2 resumes from step 10 (as if 20 were not there yet), then saves 30 and 40.
    store.write_loaded(2, 10)
    run_ranks(2, [["save", 30, "periodic"], ["save", 40, "periodic"]], uri, generation=2, keep=2)
    assert [r["step"] for r in store.checkpoints()] == [10, 30, 40]
    assert store.checkpoint_dirs() == [10, 30, 40, 45]  # (45 may be in flight: it stays)
    assert store.latest_checkpoint()["step"] == 40

    # A straggler of an older generation deletes nothing once a newer one has started.
    store.mark_started(3, time.time())
    run_ranks(2, [["save", 50, "periodic"]], uri, generation=2, keep=1)
    assert store.checkpoint_dirs() == [10, 30, 40, 45, 50]
    # The newest generation applies keep=1: only the newest complete one stays.
    run_ranks(2, [["save", 60, "final"]], uri, generation=3, keep=1)
    assert store.checkpoint_dirs() == [60]
    assert [r["step"] for r in store.checkpoints()] == [60]


def test_corrupt_checkpoint_is_skipped_for_the_previous_complete_one(bucket: str) -> None:
    uri = f"s3://{bucket}/job"
    run_ranks(2, [["save", 10, "periodic"], ["save", 20, "periodic"]], uri)
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"])
    data = [k for k in s3_keys(bucket, "job/ckpt/step-0000020/") if k.endswith(".distcp")]
    for key in data:  # truncated by a crash of the store, say
        s3.put_object(Bucket=bucket, Key=key, Body=b"not a tensor")

    loaded = run_ranks(3, [["load"]], uri, generation=2)
    for rank in range(3):
        assert loaded[rank][0]["step"] == 10 and loaded[rank][0]["values"] == [10.0]
    [skipped] = JobStore(uri).skipped_checkpoints()
    assert skipped["step"] == 20 and skipped["generation"] == 2 and skipped["reason"]
    assert "step 20 does not load" in loaded[0][0]["stderr"]


def test_forbidden_or_missing_bucket_fails_the_start_with_the_stores_message(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    with pytest.raises(StoreUnusable, match="NoSuchBucket"):
        JobStore("s3://no-such-bucket-here/job").check(time.time())
    with pytest.raises(ApplicationError, match="NoSuchBucket") as err:
        checked_store("s3://no-such-bucket-here/job", time.time(), 1)
    assert err.value.type == CONFIG_ERROR and err.value.non_retryable
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StoreUnusable, match="Could not connect"):
        JobStore("s3://any-bucket/job").check(time.time())


async def test_job_on_a_missing_bucket_fails_at_start_with_s3s_message(
    ts_env: WorkflowEnvironment,
    moto_endpoint: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The real local runtime, its store on moto's S3: no rank ever starts, and the job fails
    at once (not after max_restarts, nor at its first checkpoint) with S3's own message."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    runtime = LocalRuntime(tmp_path)
    spec = job_spec(total_steps=600, checkpoint="s3://no-such-bucket-here/job")
    async with simulated(ts_env.client, runtime=runtime) as sim:  # type: ignore[arg-type]
        handle = await sim.start(spec)
        with pytest.raises(WorkflowFailureError) as failure:
            await handle.result()
    assert "NoSuchBucket" in str(failure.value.cause)
    assert "checkpoint location s3://no-such-bucket-here" in str(failure.value.cause)
    assert not list(tmp_path.glob("jobs/*/gen-*/rank-*.pid"))  # no rank was launched
    assert sim.cloud.running() == []


def test_an_asynchronous_save_writes_from_a_thread_that_yields_the_cpu(tmp_path: Path) -> None:
    """A background save's writing thread runs at nice 19 (training's threads keep theirs):
    on a node whose cores train, it writes in the gaps instead of slowing every step."""
    import torch
    import torch.distributed.checkpoint as dcp

    from spotrain.elastic import checkpoint

    def write() -> int:
        writer = checkpoint.storage_writer(str(tmp_path / "ckpt"), background="thread")
        dcp.save({"w": torch.ones(4)}, storage_writer=writer, no_dist=True)
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(write).result() == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0
    assert type(checkpoint.storage_writer(str(tmp_path / "sync"))) is dcp.FileSystemWriter
