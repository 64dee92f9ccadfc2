"""The example job, for real: PyTorch DDP (gloo, CPU) processes started by the local runtime,
resized 2 -> 3 ranks through an elastic event and a DCP checkpoint, then run to completion."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from temporalio.testing import ActivityEnvironment

from spotrain.activities.local import LocalRuntime
from spotrain.elastic.job_store import JobStore
from spotrain.workflows.contract import (
    GenerationPlan,
    Member,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)
from spotrain.workflows.spec import parse_spec
from tests.warm_python import WARM_PYTHON

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_python_server")]  # (warm_python.py)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
TOTAL_STEPS = 300
GLOBAL_BATCH = 50  # uneven over 3 ranks: 16, 17, 17


def plan(
    tmp_path: Path,
    generation: int,
    nodes: int,
    job: str = "ddp",
    total_steps: int = TOTAL_STEPS,
    checkpoint: str | None = None,
    ckpt_every: int = 50,
    example: Path = EXAMPLE,
    step_time: str = "0.02",
    python: list[str] = WARM_PYTHON,
) -> GenerationPlan:
    """`python`: sys.executable alone for ranks a test freezes with SIGSTOP (tests/warm_python.py
    says why)."""
    (tmp_path / job).mkdir(exist_ok=True)
    return GenerationPlan(
        job=job,
        generation=generation,
        members=[Member(node_id=f"node-{i}", address="127.0.0.1") for i in range(nodes)],
        # 20 ms a step (a bigger model's pace): the resize lands mid-run on an idle machine too
        command=[*python, str(example), "--record", str(tmp_path / job), "--step-time", step_time],
        checkpoint=checkpoint or f"file://{tmp_path}/{job}/store",
        scale_config={"lr": 0.02, "ckpt_every": ckpt_every},
        global_batch_size=GLOBAL_BATCH,
        total_steps=total_steps,
    )


def run_to_end(env: ActivityEnvironment, rt: LocalRuntime, p: GenerationPlan) -> WatchResult:
    deadline = time.monotonic() + 90
    while (result := watch(env, rt, p)).outcome == "progress":
        assert time.monotonic() < deadline, f"{p.job} generation {p.generation} did not finish"
    assert result.outcome == "completed", (result, rt.log_path(p.job, 0).read_text())
    return result


def watch(env: ActivityEnvironment, rt: LocalRuntime, p: GenerationPlan) -> WatchResult:
    req = WatchRequest(
        job=p.job,
        generation=p.generation,
        world_size=p.world_size,
        checkpoint=p.checkpoint,
        report_after_s=0.5,
    )
    return env.run(rt.watch_generation, req)


def stop_generation(
    env: ActivityEnvironment, rt: LocalRuntime, p: GenerationPlan, **how: Any
) -> StopResult:
    req = StopRequest(
        job=p.job, generation=p.generation, world_size=p.world_size, checkpoint=p.checkpoint, **how
    )
    return env.run(rt.stop_generation, req)


def records(tmp_path: Path, generation: int, job: str = "ddp") -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for f in (tmp_path / job).glob(f"gen-{generation}-rank-*.jsonl"):
        rank = int(f.stem.rsplit("-", 1)[1])
        out[rank] = [json.loads(line) for line in f.read_text().splitlines()]
    return out


def test_resize_keeps_loss_falling_and_consumes_every_sample_once(tmp_path: Path) -> None:
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt")
    gen0 = plan(tmp_path, 0, nodes=2)
    env.run(rt.start_generation, gen0)
    deadline = time.monotonic() + 60
    # Resize once a few checkpoints' worth is done (on a loaded machine progress is bursty).
    while (result := watch(env, rt, gen0)).outcome == "progress" and (result.step or 0) < 12:
        assert time.monotonic() < deadline, "generation 0 made no progress"
    assert result.outcome == "progress", (result, rt.log_path("ddp", 0, 0).read_text())

    started = time.monotonic()
    stop = stop_generation(env, rt, gen0, graceful=True, grace_s=30)
    assert stop.acked_ranks == [0, 1] and not stop.forced
    assert time.monotonic() - started < 30
    resized_at = stop.checkpoint_step
    assert resized_at is not None and 10 <= resized_at < TOTAL_STEPS - 10

    gen1 = plan(tmp_path, 1, nodes=3)
    env.run(rt.start_generation, gen1)
    # Reference: one rank, never resized, a few steps past the resize point.
    ref_steps = min(resized_at + 20, TOTAL_STEPS)  # a late resize leaves fewer steps after it
    ref = plan(tmp_path, 0, nodes=1, job="ref", total_steps=ref_steps)
    env.run(rt.start_generation, ref)
    assert run_to_end(env, rt, gen1).exit_codes == {0: 0, 1: 0, 2: 0}
    run_to_end(env, rt, ref)

    # Steps add up exactly: generation 0 did 1..resized_at, generation 1 the rest.
    rec0, rec1 = records(tmp_path, 0), records(tmp_path, 1)
    assert [e["step"] for e in rec0[0]] == list(range(1, resized_at + 1))
    assert [e["step"] for e in rec1[0]] == list(range(resized_at + 1, TOTAL_STEPS + 1))
    assert {e["world"] for e in rec1[1]} == {3}

    # Every position of the sample stream consumed exactly once, across both world sizes.
    positions = sorted(
        p
        for rec in (rec0, rec1)
        for entries in rec.values()
        for e in entries
        for p in range(e["start"], e["start"] + e["count"])
    )
    assert positions == list(range(TOTAL_STEPS * GLOBAL_BATCH))

    # Loss keeps falling across the resize: no reset to the initial weights.
    losses = [e["loss"] for e in rec0[0] + rec1[0]]
    first, after, last = (sum(losses[i : i + 5]) / 5 for i in (0, resized_at, TOTAL_STEPS - 5))
    assert after < 0.5 * first, (first, after)
    # Still falling after the resize, unless it came late, when training had converged
    # (on a loaded machine the ranks may be far along before the stop lands): then only
    # noise separates the two windows, and both are a small fraction of where it started.
    assert last < after or max(after, last) < 0.1 * first, (first, after, last)
    # ... and resumed training is the same computation as never resized (same samples, global
    # mean gradients, optimizer state resharded), up to float summation order. (This, not a
    # loss window before vs after, proves continuity: windows differ by their batches alone.)
    ref_losses = [e["loss"] for e in records(tmp_path, 0, job="ref")[0]]
    assert losses[:ref_steps] == pytest.approx(ref_losses, rel=1e-3)
    assert not any(r.alive() for g in (0, 1) for r in rt._ranks("ddp", g))


def test_resumes_on_other_ranks_from_s3_after_a_loss_without_notice(
    tmp_path: Path, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints straight to S3 (moto): 2 ranks lose their nodes without notice, 3 other
    ranks resume from the last complete periodic checkpoint there and finish."""
    pytest.importorskip("s3torchconnector")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket="ddp-ckpt")
    uri, total = "s3://ddp-ckpt/ddp", 150
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt")
    gen0 = plan(tmp_path, 0, nodes=2, total_steps=total, checkpoint=uri, ckpt_every=20)
    env.run(rt.start_generation, gen0)
    deadline = time.monotonic() + 120
    while (result := watch(env, rt, gen0)).checkpoint_step is None or result.checkpoint_step < 40:
        assert result.outcome == "progress", (result, rt.log_path("ddp", 0, 0).read_text())
        assert time.monotonic() < deadline, "no periodic checkpoint reached S3"
    assert result.checkpoints and result.checkpoints.kinds["periodic"] >= 2
    assert result.checkpoints.blocked_p50_s < result.checkpoints.p50_s  # asynchronous
    lost = stop_generation(
        env, rt, gen0, graceful=False, grace_s=0, lost_node_ids=["node-0", "node-1"]
    )
    resumed_at = lost.checkpoint_step
    assert resumed_at is not None and resumed_at >= 40 and resumed_at % 20 == 0

    gen1 = plan(tmp_path, 1, nodes=3, total_steps=total, checkpoint=uri, ckpt_every=20)
    gen1.members = [
        m.model_copy(update={"node_id": f"node-{i + 2}"}) for i, m in enumerate(gen1.members)
    ]
    env.run(rt.start_generation, gen1)
    done = run_to_end(env, rt, gen1)
    assert done.exit_codes == {0: 0, 1: 0, 2: 0}
    rec1 = records(tmp_path, 1)
    assert [e["step"] for e in rec1[0]] == list(range(resumed_at + 1, total + 1))
    assert {e["world"] for e in rec1[2]} == {3}

    store = JobStore(uri)
    assert store.latest_checkpoint()["step"] == total and store.loaded_step(1) == resumed_at
    kept = [r["step"] for r in store.checkpoints()]
    assert kept[-1] == total and len(kept) <= 3 + 1  # keep 3, and the one generation 1 loaded
    assert store.checkpoint_dirs() == kept  # no leftovers of the save the loss cut short
    assert done.checkpoints and done.checkpoints.kinds.get("final") == 1


def test_example_job_spec_validates_and_runs_this_script() -> None:
    spec = parse_spec(yaml.safe_load((EXAMPLE.parent / "job.yaml").read_text()))
    assert spec.command[-1] == "examples/train_ddp.py"
    assert (EXAMPLE.parent.parent / spec.command[-1]).resolve() == EXAMPLE
    assert spec.global_batch_size and spec.elastic.min_nodes < spec.elastic.max_nodes
