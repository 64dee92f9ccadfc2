"""Live resize with the real example (examples/train_ddp.py: PyTorch DDP, gloo, CPU) on the local
runtime: surviving ranks keep their process through shrink and growth, a joiner takes the
state from them, a rank lost without notice costs at most the step in flight, and a survivor
that hangs sends the job back to its last checkpoint."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from spotrain import elastic
from spotrain.activities.local import LocalRuntime
from spotrain.activities.simulated import SimulatedCloud
from spotrain.elastic import environment, live
from spotrain.elastic.control import Channel
from spotrain.elastic.environment import rank_env
from spotrain.elastic.job_store import AFTER_RESIZE, JobStore
from spotrain.workers.embedded.stack import free_port
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.contract import CleanupRequest, GenerationPlan, Member
from spotrain.workflows.job.state import JobResult, JobStatus
from tests.elastic.test_control_channel import wait_status
from tests.elastic.test_train_ddp import (
    EXAMPLE,
    GLOBAL_BATCH,
    TOTAL_STEPS,
    records,
    run_to_end,
    stop_generation,
    watch,
)
from tests.elastic.test_train_ddp import plan as restart_plan
from tests.jobs import process_spec, record_history
from tests.warm_python import WARM_PYTHON

pytest.importorskip("torch")


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_python_server")]  # (warm_python.py)
COLD = [sys.executable]  # for ranks a test freezes with SIGSTOP


def plan(tmp_path: Path, generation: int, nodes: list[int], **kw: object) -> GenerationPlan:
    p = restart_plan(tmp_path, generation, len(nodes), **kw)  # type: ignore[arg-type]
    p.members = [Member(node_id=f"node-{i}", address="127.0.0.1") for i in nodes]
    return p.model_copy(update={"resize": "live", "collective_timeout_s": 5.0})


def pids(rt: LocalRuntime, generation: int, job: str = "ddp") -> dict[int, int]:
    return {r.rank: (r.record() or {})["pid"] for r in rt._ranks(job, generation)}


def run_until(env: ActivityEnvironment, rt: LocalRuntime, p: GenerationPlan, step: int) -> None:
    deadline = time.monotonic() + 90
    while (result := watch(env, rt, p)).outcome == "progress" and (result.step or 0) < step:
        assert time.monotonic() < deadline, f"generation {p.generation} made no progress"
    assert result.outcome == "progress", (result, rt.log_path(p.job, 0, p.generation).read_text())


def consumed(entries_by_gen: list[tuple[dict[int, list[dict]], int]]) -> list[int]:
    """Stream positions consumed by the steps the final model went through: each generation's
    entries up to the step the next one resumed from."""
    return sorted(
        p
        for rec, upto in entries_by_gen
        for entries in rec.values()
        for e in entries
        if e["step"] <= upto
        for p in range(e["start"], e["start"] + e["count"])
    )


def through_held(
    rec: dict[int, list[dict]], held: int, global_batch: int = GLOBAL_BATCH
) -> dict[int, list[dict]]:
    """`rec` with every rank's record completed through `held`, the newest step a survivor
    holds (the next generation resumes from it). A rank that recorded `held` finished that
    step's all-reduces, and an all-reduce completes on any rank only with every rank's share
    in it: so the step's samples all went into the state the next generation takes, though a
    rank may not have written the step down: the rank killed (after its share went out) and
    also a survivor whose own all-reduce failed (gloo's ring: its send to the dead peer fails
    while the rank it sent to finishes). Such a survivor parks a step behind and takes the
    newest state from the one ahead (handover.roles). A record is one entry short: never
    more."""
    assert any(entries[-1]["step"] >= held for entries in rec.values()), held
    completed = {}
    for rank, entries in rec.items():
        last = entries[-1]
        assert last["step"] >= held - 1, (rank, last, held)
        if last["step"] == held - 1:  # same world, same share of the next global batch
            entries = [*entries, {**last, "step": held, "start": last["start"] + global_batch}]
        completed[rank] = entries
    return completed


def test_the_accounting_completes_only_a_step_some_rank_finished() -> None:
    """through_held: a rank one entry short of the held step (the one killed, a survivor whose
    last all-reduce failed) is completed with its share; two short, or a held step that no
    rank finished, is a loss it reports."""

    def entries(rank: int, upto: int) -> list[dict]:
        return [
            {"step": s, "start": (s - 1) * GLOBAL_BATCH + 17 * rank} for s in range(1, upto + 1)
        ]

    done = through_held({0: entries(0, 5), 1: entries(1, 4), 2: entries(2, 4)}, 5)
    assert [e["step"] for e in done[1]] == [1, 2, 3, 4, 5] == [e["step"] for e in done[2]]
    assert done[1][-1]["start"] == 4 * GLOBAL_BATCH + 17
    with pytest.raises(AssertionError):
        through_held({0: entries(0, 5), 1: entries(1, 3)}, 5)
    with pytest.raises(AssertionError):
        through_held({0: entries(0, 4), 1: entries(1, 4)}, 5)


def rank_logs(root: Path) -> str:
    """The tail of every rank log under a local runtime's root, for a failure's message."""
    return "\n".join(f"{p}:\n{p.read_text()[-3000:]}" for p in sorted(root.rglob("rank-*.log")))


def notice_checkpoints(location: str) -> list[dict[str, Any]]:
    return [r for r in JobStore(location).checkpoints() if r["kind"] == "notice"]


def assert_same_weights(resized: Path, uninterrupted: Path) -> None:
    """Every rank's weights after the last step equal an uninterrupted run's, to float tolerance
    (another world size sums the same global batch in another order)."""
    want = json.loads((uninterrupted / "final-rank-0.json").read_text())
    ranks = sorted(resized.glob("final-rank-*.json"))
    assert ranks and len(want) > 0
    for f in ranks:  # every rank of the last generation: joiners as well as survivors
        assert json.loads(f.read_text()) == pytest.approx(want, rel=1e-4, abs=1e-6), f.name


def books_the_two_losses(gone: list[str], noticed: str, lost: str) -> bool:
    """The job's "node gone" details: the noticed node reclaimed, then the one lost without
    notice, booked under what the job learns of it first: the node_lost signal ("lost"), or
    the cloud's record of the instance ("reclaimed") when the failed watch looks."""
    return gone[:1] == [f"spot {noticed}: reclaimed"] and gone[1:] in (
        [f"spot {lost}: lost"],
        [f"spot {lost}: reclaimed"],
    )


def parked_for_the_notice_growth_and_loss(parked: list[str], noticed: str, lost: str) -> bool:
    """The details of the job's live parks begin with the scenario's three resizes, in order:
    the notice's shrink, the replacement's growth, the loss's shrink. The growth after the
    loss is not asked for: under load the job can reach its last step before the second
    replacement is up (CI saw it on Kubernetes), and then that growth is the job's end."""
    return (
        len(parked) >= 3
        and parked[0].startswith(f"reclaim notice for {noticed};")
        and parked[1].startswith("grow: ")
        and parked[2].startswith(f"{lost} ")
    )


def test_survivors_keep_training_through_shrink_and_growth(tmp_path: Path) -> None:
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt")
    gen0 = plan(tmp_path, 0, [0, 1, 2])
    env.run(rt.start_generation, gen0)
    run_until(env, rt, gen0, 12)

    # Shrink on a reclaim notice: every rank parks at once; the notice's checkpoint is not
    # written before (no pause) but by the survivors, beside training, once resized.
    notice = stop_generation(
        env, rt, gen0, graceful=True, grace_s=30, live=True, notice_at=datetime.now(UTC)
    )
    assert notice.acked_ranks == [0, 1, 2] and not notice.forced
    s0 = notice.held_step
    assert s0 is not None and (notice.checkpoint_step or 0) < s0
    # The middle node leaves: rank 2's process trains on as rank 1 (a rank kept by mistake
    # would leave a hole in the new group, or train on another rank's share of the batch).
    gen1 = plan(tmp_path, 1, [0, 2])
    env.run(rt.start_generation, gen1)
    assert pids(rt, 1) == {0: pids(rt, 0)[0], 1: pids(rt, 0)[2]}  # same processes, renumbered
    run_until(env, rt, gen1, s0 + 12)
    deadline = time.monotonic() + 60  # (written beside training: done when it is done)
    while not (written := notice_checkpoints(gen1.checkpoint)):
        assert time.monotonic() < deadline, rank_logs(tmp_path / "rt")
        time.sleep(0.1)
    assert [(r["step"], r["generation"]) for r in written] == [(s0, 1)], written
    assert 0 < written[0]["after_notice_s"] < 30 and written[0]["blocked_s"] < 1

    # Growth onto a new node: no checkpoint; the joiner takes the state from the survivors.
    grow = stop_generation(env, rt, gen1, graceful=True, grace_s=30, live=True)
    s1 = grow.held_step
    assert s1 is not None and s1 > s0 and grow.checkpoint_step < s1
    gen2 = plan(tmp_path, 2, [0, 2, 3])
    env.run(rt.start_generation, gen2)
    assert pids(rt, 2)[0] == pids(rt, 0)[0] and pids(rt, 2)[1] == pids(rt, 0)[2]
    assert pids(rt, 2)[2] not in pids(rt, 0).values()
    ref = restart_plan(tmp_path, 0, 1, job="ref")
    env.run(rt.start_generation, ref)
    assert run_to_end(env, rt, gen2).exit_codes == {0: 0, 1: 0, 2: 0}
    run_to_end(env, rt, ref)

    rec = [records(tmp_path, g) for g in range(3)]
    assert [e["step"] for e in rec[0][0]] == list(range(1, s0 + 1))
    assert [e["step"] for e in rec[1][0]] == list(range(s0 + 1, s1 + 1))
    assert [e["step"] for e in rec[2][0]] == list(range(s1 + 1, TOTAL_STEPS + 1))
    assert {e["world"] for e in rec[1][1]} == {2} and {e["world"] for e in rec[2][2]} == {3}
    assert consumed([(rec[0], s0), (rec[1], s1), (rec[2], TOTAL_STEPS)]) == list(
        range(TOTAL_STEPS * GLOBAL_BATCH)
    )
    # The same computation as a rank never resized: the state crossed in memory intact.
    losses = [e["loss"] for g in range(3) for e in rec[g][0]]
    ref_losses = [e["loss"] for e in records(tmp_path, 0, job="ref")[0]]
    assert losses == pytest.approx(ref_losses, rel=1e-3)
    assert_same_weights(tmp_path / "ddp", tmp_path / "ref")
    store = JobStore(gen2.checkpoint)
    assert store.loaded_step(1) is None and store.loaded_step(2) is None  # nothing from disk
    assert not any(r.alive() for g in range(3) for r in rt._ranks("ddp", g))


def test_a_rank_lost_without_notice_costs_at_most_the_step_in_flight(tmp_path: Path) -> None:
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt")
    gen0 = plan(tmp_path, 0, [0, 1, 2], ckpt_every=1000)  # no periodic checkpoint to fall to
    env.run(rt.start_generation, gen0)
    run_until(env, rt, gen0, 15)
    assert rt.kill_node("ddp", "node-2") == [2]
    # The survivors' next collective fails at once (the peer's sockets close): they park.
    lost = stop_generation(
        env, rt, gen0, graceful=False, grace_s=10, live=True, lost_node_ids=["node-2"]
    )
    assert lost.acked_ranks == [0, 1] and lost.checkpoint_step is None
    # The stop told the survivors which node is gone (a node that closes nothing is aborted on)
    control = JobStore(gen0.checkpoint).store.get_json(JobStore.control_key(0))
    assert control["lost"] == ["node-2"] and control["checkpoint"] is False
    held = lost.held_step
    reached = max(e["step"] for entries in records(tmp_path, 0).values() for e in entries)
    assert held is not None and reached - held <= 1, (reached, held)
    gen1 = plan(tmp_path, 1, [0, 1], ckpt_every=1000)
    env.run(rt.start_generation, gen1)
    ref = restart_plan(tmp_path, 0, 1, job="ref")
    env.run(rt.start_generation, ref)
    assert run_to_end(env, rt, gen1).exit_codes == {0: 0, 1: 0}
    run_to_end(env, rt, ref)
    # The step in flight was dropped whole and redone with the same samples.
    assert_same_weights(tmp_path / "ddp", tmp_path / "ref")
    rec0, rec1 = records(tmp_path, 0), records(tmp_path, 1)
    assert [e["step"] for e in rec1[0]] == list(range(held + 1, TOTAL_STEPS + 1))
    assert consumed([(through_held(rec0, held), held), (rec1, TOTAL_STEPS)]) == list(
        range(TOTAL_STEPS * GLOBAL_BATCH)
    )
    assert not any(r.alive() for g in range(2) for r in rt._ranks("ddp", g))


def test_a_survivor_that_hangs_is_detected_and_the_others_go_on(tmp_path: Path) -> None:
    """A parked survivor that never answers again: the new group does not form within the
    collective timeout, the survivor that came parks again and the runtime reports the
    failure; the hung one is killed and the next generation goes on from the other's memory.
    With no survivor left at all, the job falls back to its last checkpoint."""
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt", term_grace_s=1)
    gen0 = plan(tmp_path, 0, [0, 1, 2], python=COLD)
    env.run(rt.start_generation, gen0)
    run_until(env, rt, gen0, 12)
    notice = stop_generation(
        env, rt, gen0, graceful=True, grace_s=30, live=True, notice_at=datetime.now(UTC)
    )
    held = notice.held_step
    assert held is not None
    hung = pids(rt, 0)[1]
    os.killpg(hung, signal.SIGSTOP)  # the rank and its launcher: parked, then never answer
    try:
        gen1 = plan(tmp_path, 1, [0, 1], python=COLD)
        env.run(rt.start_generation, gen1)
        # Rank 0 waits for rank 1 in the new group for the collective timeout (5 s).
        deadline = time.monotonic() + 60
        while (result := watch(env, rt, gen1)).outcome == "progress":
            assert time.monotonic() < deadline, "the hung survivor was never detected"
        assert result.outcome == "failed" and "lost a peer" in (result.detail or ""), result
        stop = stop_generation(env, rt, gen1, graceful=False, grace_s=6, live=True)
        assert stop.acked_ranks == [0] and stop.forced and stop.held_step == held
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(hung, signal.SIGCONT)
    gen2 = plan(tmp_path, 2, [0, 1], python=COLD)
    env.run(rt.start_generation, gen2)
    run_until(env, rt, gen2, held + 12)
    log = rt.log_path("ddp", 0, 2).read_text()
    assert pids(rt, 2)[0] == pids(rt, 0)[0], log
    assert records(tmp_path, 2)[0][0]["step"] == held + 1  # from memory, not a restart

    # Every survivor gone (killed while parked): the job's next generation loads from disk.
    again = stop_generation(env, rt, gen2, graceful=True, grace_s=30, live=True)
    assert again.held_step is not None
    rt._kill(rt._ranks("ddp", 2))
    gen3 = plan(tmp_path, 3, [0, 1], python=COLD)
    latest = JobStore(gen3.checkpoint).latest_checkpoint()["step"]
    env.run(rt.start_generation, gen3)
    run_to_end(env, rt, gen3)
    assert JobStore(gen3.checkpoint).loaded_step(3) == latest < again.held_step
    assert records(tmp_path, 3)[0][0]["step"] == latest + 1
    assert not any(r.alive() for g in range(4) for r in rt._ranks("ddp", g))


def live_job_spec(name: str, tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """The example through the whole workflow, `resize: live`: up to 3 nodes, 30 ms steps,
    its records under tmp_path/rec."""
    command = [*WARM_PYTHON, str(EXAMPLE), "--record", str(tmp_path / "rec")]
    elastic = {
        "min_nodes": 1,
        "max_nodes": 3,
        "resize": "live",
        "collective_timeout_s": 10,
        "graceful_shutdown_timeout_s": 20,
        "scaling_timeout_s": 1,
        "faulty_scale_down_timeout_s": 0,
        "capacity_check_interval_s": 1,
        "progress_report_interval_s": 0.5,
    }
    return process_spec(
        name,
        [*command, "--step-time", "0.03"],
        f"file://{tmp_path / 'ckpt'}",
        elastic,
        total_steps=1200,
        global_batch_size=GLOBAL_BATCH,
        scale_config={n: {"lr": 0.02, "ckpt_every": 100} for n in (1, 2, 3)},
        **overrides,
    )


async def test_a_live_job_through_a_notice_a_loss_and_growth(
    dev_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """The real TrainingJob on the local runtime and the simulated cloud, `resize: live`: a
    reclaim notice shrinks it and the replacement grows it back, a node lost without notice
    costs at most a step, and rank 0's process trains through every generation."""
    runtime = LocalRuntime(tmp_path / "rt", term_grace_s=2)
    cloud = SimulatedCloud(zones=["us-east-1a"])
    name = f"live-{uuid.uuid4().hex[:8]}"
    spec = live_job_spec(name, tmp_path, cleanup="never")  # (rank logs stay for the checks)
    with ThreadPoolExecutor(8) as pool:
        async with workflow_worker(
            dev_env.client,
            name,
            cloud.activities() + runtime.activities(),
            activity_executor=pool,
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob", spec, id=name, task_queue=name, result_type=JobResult
            )
            try:
                try:
                    status = await wait_status(handle, lambda s: s.world_size == 3 and s.step > 10)
                except AssertionError:
                    st = await handle.query("status", result_type=JobStatus)
                    raise AssertionError([(e.event, e.detail) for e in st.timeline]) from None
                first = status.generation
                noticed = status.nodes[-1].node_id or ""
                deadline = datetime.now(UTC) + timedelta(seconds=120)
                await handle.signal("reclaim", {"node_id": noticed, "deadline": deadline})
                status = await wait_status(
                    handle, lambda s: s.generation >= first + 2 and s.world_size == 3, 90
                )
                grown = status.step
                status = await wait_status(handle, lambda s: s.step > grown + 10)
                lost = next(n.node_id for n in status.nodes if n.rank == 2 and n.node_id)
                assert runtime.kill_node(name, lost), "no rank ran on the node to lose"
                cloud.reclaim(lost)
                await handle.signal("node_lost", {"node_id": lost, "event_id": f"lost-{lost}"})
                result = await asyncio.wait_for(handle.result(), 240)
                await record_history(handle, "live_resize")
                log = runtime.log_path(name, rank=0, generation=first).read_text()
            finally:
                with contextlib.suppress(Exception):
                    await handle.cancel()
                runtime.cleanup_job(CleanupRequest(job=name))
    parked = [e.detail for e in result.timeline if e.event == "generation parked (live resize)"]
    print(
        "\n".join(
            f"{e.time:%H:%M:%S.%f} {e.generation} {e.event}: {e.detail}" for e in result.timeline
        )
    )
    assert parked_for_the_notice_growth_and_loss(parked, noticed, lost), [
        (e.generation, e.event, e.detail) for e in result.timeline
    ]
    gone = [e.detail for e in result.timeline if e.event == "node gone"]
    assert books_the_two_losses(gone, noticed, lost), result.timeline
    assert result.steps_lost <= 1, result
    # The first rank-0 process trained on through the shrink on the notice: not
    # restarted. (Through every generation, nearly always; but a rank that neither parks nor
    # exits at a stop is killed after the grace period and replaced, an outlier seen about
    # once in 40 growths under load and not yet explained: README, known limits.)
    trained_in = {int(line.split()[1]) for line in log.splitlines() if line.startswith("gen ")}
    assert {first, first + 1} <= trained_in, log


def test_a_rank_votes_for_a_checkpoint_only_for_an_event_it_saw(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rank that learned of the event only from its peers' flags has no vote: deciding on
    its own default, it once started a save its peers never joined."""
    env = rank_env(plan(tmp_path, 4, [0, 1]), 0, 0, master_port=1, control_file="")
    for key, value in {**env, environment.RESIZE: "live", elastic.SIGTERM_ENV: "0"}.items():
        monkeypatch.setenv(key, value)
    elastic.settings.cache_clear()
    elastic.store.cache_clear()
    monkeypatch.setattr(elastic, "_channel", Channel())
    assert not live.wants_checkpoint()  # nothing seen here (yet)
    elastic._channel.raise_event("control record", {"kind": "stop", "checkpoint": False})
    assert not live.wants_checkpoint()  # growth: the survivors' memory carries the state
    monkeypatch.setattr(elastic, "_channel", Channel())
    elastic._channel.raise_event("control record", {"kind": "stop", "checkpoint": AFTER_RESIZE})
    assert not live.wants_checkpoint()  # a notice: the survivors write it once resized
    monkeypatch.setattr(elastic, "_channel", Channel())
    elastic._channel.raise_event("SIGTERM", {"kind": "stop"})
    assert live.wants_checkpoint()  # a notice, or an event that does not say
    monkeypatch.delenv(environment.RESIZE)
    monkeypatch.setattr(elastic, "_channel", Channel())
    assert not live.wants_checkpoint()
    elastic._channel.raise_event("control record", {"kind": "stop", "checkpoint": False})
    assert live.wants_checkpoint()  # restart mode always checkpoints
    elastic.settings.cache_clear()
    elastic.store.cache_clear()


LEAVES_GROUP = """
import os, sys, time, torch, torch.distributed as dist
from spotrain.elastic import live
live.init_process_group("gloo")
dist.barrier()
rank = dist.get_rank()
if rank == 2:  # waits for rank 0, which parks instead (its own peer was lost): how long?
    started = time.monotonic()
    try:
        dist.recv(torch.ones(1), src=0)
    except Exception:
        print(f"failed after {time.monotonic() - started:.2f}", flush=True)
elif rank == 0:
    time.sleep(0.5)
    live.next_generation(7)  # parks; no next generation comes, so it leaves after a while
else:
    time.sleep(12)  # alive and silent
os._exit(0)
"""


def test_a_parked_rank_leaves_its_group_so_a_peer_waiting_on_it_fails_at_once(
    tmp_path: Path,
) -> None:
    """A survivor still blocked in a collective with a rank that parked (its own peer lost)
    fails on the closed connection at once, not after the collective timeout."""
    p = plan(tmp_path, 5, [0, 1, 2]).model_copy(update={"collective_timeout_s": 10.0})
    port = free_port()
    procs = []
    for rank in range(3):
        env = rank_env(p, rank, 0, master_port=port, control_file="")
        env |= {"MASTER_ADDR": "127.0.0.1", environment.RESIZE: "live"}
        env |= {environment.PARK_TIMEOUT: "8", elastic.SIGTERM_ENV: "0"}
        procs.append(
            subprocess.Popen(
                [*WARM_PYTHON, "-c", LEAVES_GROUP],
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [proc.communicate(timeout=60)[0] for proc in procs]
    waited = float(outputs[2].split("failed after ")[1].split()[0])
    assert waited < 3, outputs  # rank 0 parked at 0.5 s; its collective timeout is 10 s
    assert JobStore(p.checkpoint).ack_steps(5) == {0: 7}


JOINER_AFTER_RENDEZVOUS = r"""
import json, os, sys, torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from spotrain.elastic import live, sharded  # (what a live loop imports: its head start)

torch.set_num_threads(1)
before = set(sys.modules)
live.init_process_group("gloo")  # the rendezvous; then up to the first training collective:
mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=(sharded.REPLICATE, sharded.SHARD))
fsdp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
fully_shard(fsdp[0], mesh=mesh)
fully_shard(fsdp, mesh=mesh)
ddp = DistributedDataParallel(torch.nn.Linear(4, 1), init_sync=False)
for model in (fsdp, ddp):
    model(torch.ones(2, 4)).sum().backward()
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_a_joiner_imports_nothing_after_the_rendezvous() -> None:
    """Survivors wait for a joiner in their first collective, within the collective timeout: a
    module a joiner's first DDP or fully_shard imports (torch._dynamo: over 10 s on a loaded
    machine) must already be in, from its head start."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env |= {"MASTER_PORT": str(free_port()), environment.RESIZE: "live"}
    out = subprocess.run(
        [sys.executable, "-c", JOINER_AFTER_RENDEZVOUS],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    imported = json.loads(out.stdout.splitlines()[-1])
    assert len(imported) < 5, imported  # (torch._dynamo brings almost 300)
