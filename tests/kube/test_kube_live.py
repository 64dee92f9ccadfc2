"""Live resize on the Kubernetes runtime, on the real control plane (tests/kube/k8s_cluster.py),
with the real example (examples/train_ddp.py: PyTorch DDP, gloo, CPU) in every pod: the pods
of surviving ranks stay through shrink and growth (same pod, same process), a leaving pod is
deleted once told to leave, a joining pod gets a head start and takes the state from the
survivors, and the ranks meet at rank 0's pod IP from the gang start.

Stood in for: the kubelet (tests/kube/kube_kubelet.py runs each bound pod's command as a local
process, every pod in this machine's network) and nothing else: kube-apiserver and
kube-scheduler are real, and the runtime acts as its ServiceAccount.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from temporalio.testing import ActivityEnvironment

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.kube_live import PORT_SPAN
from spotrain.elastic.job_store import JobStore
from spotrain.workers.embedded.stack import port_block
from spotrain.workflows.contract import (
    CleanupRequest,
    GenerationPlan,
    Member,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)
from tests.elastic.test_live_resize import consumed, notice_checkpoints, through_held
from tests.elastic.test_train_ddp import EXAMPLE, GLOBAL_BATCH, records
from tests.kube.k8s_cluster import (
    NAMESPACE,
    ControlPlane,
)
from tests.kube.kube_kubelet import LocalKubelet
from tests.warm_python import WARM_PYTHON

pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("warm_python_server")  # tests/warm_python.py

JOB = "live"
NODES = {"i-0aaa": "ip-10-0-0-1", "i-0bbb": "ip-10-0-0-2", "i-0ccc": "ip-10-0-0-3"}
NEW_NODE = ("i-0ddd", "ip-10-0-0-4")
# Enough that the job is still training when a loaded machine has a head start up (800 was
# not, beside two busy loops: the survivors finished the job while the joiner imported torch).
TOTAL_STEPS = 1600


@pytest.fixture(name="kubelet")
def kubelet_fixture(cluster: ControlPlane, tmp_path: Path) -> Iterator[LocalKubelet]:
    """Four nodes whose pods run as local processes."""
    core = client.CoreV1Api(cluster.admin)
    kubelet = LocalKubelet(core, NAMESPACE, tmp_path / "kubelet")
    for iid, name in [*NODES.items(), NEW_NODE]:
        cluster.add_node(name, iid, fake=False)
        kubelet.nodes.add(name)
    with kubelet.serving():
        yield kubelet


@pytest.fixture(name="runtime")
def runtime_fixture(cluster: ControlPlane) -> Iterator[KubeRuntime]:
    worker = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    # Rendezvous ports of this test's own: every pod here shares this machine's network.
    with port_block(PORT_SPAN) as base:
        yield KubeRuntime(
            NAMESPACE, worker, master_port=base, gang_timeout_s=60, watch_s=1, ack_poll_s=0.1
        )


def plan(tmp_path: Path, generation: int, nodes: list[str], **kw: Any) -> GenerationPlan:
    record = tmp_path / JOB
    record.mkdir(exist_ok=True)
    fields: dict[str, Any] = {
        "job": JOB,
        "generation": generation,
        "members": [Member(node_id=n, address="unused") for n in nodes],
        "command": [*WARM_PYTHON, str(EXAMPLE), "--record", str(record), "--step-time", "0.02"],
        "image": "ghcr.io/example/train:1",
        "checkpoint": f"file://{tmp_path}/ckpt",
        "scale_config": {"lr": 0.02, "ckpt_every": 50},
        "global_batch_size": GLOBAL_BATCH,
        "total_steps": TOTAL_STEPS,
        "graceful_shutdown_s": 30,
        "resize": "live",
        "collective_timeout_s": 5.0,
    }
    return GenerationPlan(**{**fields, **kw})


def run(fn: Any, *args: Any) -> Any:
    return ActivityEnvironment().run(fn, *args)


def watch(rt: KubeRuntime, p: GenerationPlan) -> WatchResult:
    req = WatchRequest(
        job=JOB,
        generation=p.generation,
        world_size=p.world_size,
        checkpoint=p.checkpoint,
        report_after_s=0.5,
    )
    return run(rt.watch_generation, req)


def run_until(rt: KubeRuntime, p: GenerationPlan, step: int, kubelet: LocalKubelet) -> WatchResult:
    deadline = time.monotonic() + 120
    while (result := watch(rt, p)).outcome == "progress" and (result.step or 0) < step:
        assert time.monotonic() < deadline, f"generation {p.generation} made no progress"
    assert result.outcome != "failed", (result, logs(kubelet))
    return result


def stop(rt: KubeRuntime, p: GenerationPlan, live: bool = True, **how: Any) -> StopResult:
    req = StopRequest(
        job=JOB,
        generation=p.generation,
        world_size=p.world_size,
        checkpoint=p.checkpoint,
        live=live,
        **how,
    )
    return run(rt.stop_generation, req)


def logs(kubelet: LocalKubelet) -> str:
    return "\n".join(
        f"--- {d.name}\n{(d / 'log').read_text()[-2000:]}"
        for d in sorted(kubelet.root.iterdir())
        if (d / "log").exists()
    )


def job_pods(core: client.CoreV1Api) -> dict[str, client.V1Pod]:
    found = core.list_namespaced_pod(NAMESPACE, label_selector=f"spotrain.io/job={JOB}").items
    return {p.metadata.name: p for p in found}


def test_pods_survive_shrink_and_growth(
    cluster: ControlPlane, kubelet: LocalKubelet, runtime: KubeRuntime, tmp_path: Path
) -> None:
    core = client.CoreV1Api(cluster.admin)
    gen1 = plan(tmp_path, 1, list(NODES))
    run(runtime.start_generation, gen1)
    assert JobStore(gen1.checkpoint).start_record(1)["rendezvous"] == {"MASTER_ADDR": "127.0.0.1"}
    run_until(runtime, gen1, 12, kubelet)
    uids = {n: p.metadata.uid for n, p in job_pods(core).items()}
    assert sorted(uids) == ["live-g1-0", "live-g1-1", "live-g1-2"]

    # Shrink on a reclaim notice: every rank parks at once and its pod stays; the notice's
    # checkpoint comes after, from the survivors, beside training.
    notice = stop(runtime, gen1, graceful=True, grace_s=30, notice_at=datetime.now(UTC))
    assert notice.acked_ranks == [0, 1, 2] and not notice.forced, logs(kubelet)
    s1 = notice.held_step
    assert s1 is not None and (notice.checkpoint_step or 0) < s1
    assert {n: p.metadata.uid for n, p in job_pods(core).items()} == uids  # all parked
    gen2 = plan(tmp_path, 2, ["i-0aaa", "i-0bbb"])
    run(runtime.start_generation, gen2)
    deadline = time.monotonic() + 30
    while "live-g1-2" in (pods := job_pods(core)):  # told to leave, it exits: then deleted
        assert pods["live-g1-2"].metadata.deletion_timestamp, "the leaver was not deleted"
        assert time.monotonic() < deadline, "the leaver's rank did not leave"
        time.sleep(0.1)
    assert {n: p.metadata.labels["spotrain.io/generation"] for n, p in pods.items()} == {
        "live-g1-0": "2",
        "live-g1-1": "2",
    }, "the survivors are relabelled into generation 2; the leaver is gone"
    assert {n: p.metadata.uid for n, p in pods.items()} == {n: uids[n] for n in pods}
    assert pods["live-g1-1"].metadata.annotations["spotrain.io/members"] == "2"
    run_until(runtime, gen2, s1 + 12, kubelet)
    deadline = time.monotonic() + 60
    while [(r["step"], r["generation"]) for r in notice_checkpoints(gen2.checkpoint)] != [(s1, 2)]:
        assert time.monotonic() < deadline, (notice_checkpoints(gen2.checkpoint), logs(kubelet))
        time.sleep(0.1)

    # Growth onto a new node: its pod is made ahead (a head start) and takes the state from
    # the survivors; no checkpoint is written for it.
    gen3 = plan(tmp_path, 3, ["i-0aaa", "i-0bbb", NEW_NODE[0]])
    run(runtime.prepare_generation, gen3)
    joiner = job_pods(core)["live-g3-2"]
    assert joiner.metadata.labels["spotrain.io/generation"] == "3"
    assert JobStore(gen3.checkpoint).waiting_ranks(3) == {2}  # torch imported, waiting
    grow = stop(runtime, gen2, graceful=True, grace_s=30)
    s2 = grow.held_step
    assert s2 is not None and s2 > s1 and (grow.checkpoint_step or 0) < s2, (grow, logs(kubelet))
    run(runtime.start_generation, gen3)
    assert job_pods(core)["live-g3-2"].metadata.uid == joiner.metadata.uid  # kept
    deadline = time.monotonic() + 120
    while (result := watch(runtime, gen3)).outcome == "progress":
        assert time.monotonic() < deadline, logs(kubelet)
    assert result.outcome == "completed", (result, logs(kubelet))

    # One process per pod for the whole job: three started, then the joiner.
    assert [name for name, _, _ in kubelet.started] == [
        "live-g1-0",
        "live-g1-1",
        "live-g1-2",
        "live-g3-2",
    ]
    rec = {g: records(tmp_path, g, job=JOB) for g in (1, 2, 3)}
    assert [e["step"] for e in rec[2][0]] == list(range(s1 + 1, s2 + 1))
    assert [e["step"] for e in rec[3][0]] == list(range(s2 + 1, TOTAL_STEPS + 1))
    assert {e["world"] for e in rec[3][2]} == {3}
    assert consumed([(rec[1], s1), (rec[2], s2), (rec[3], TOTAL_STEPS)]) == list(
        range(TOTAL_STEPS * GLOBAL_BATCH)
    )
    store = JobStore(gen3.checkpoint)
    assert store.loaded_step(2) is None and store.loaded_step(3) is None  # nothing from disk
    run(runtime.cleanup_job, CleanupRequest(job=JOB))
    deadline = time.monotonic() + 30
    while job_pods(core) or kubelet.running:
        assert time.monotonic() < deadline, "pods or processes left behind"
        time.sleep(0.2)


def test_a_node_lost_without_notice_costs_at_most_the_step_in_flight(
    cluster: ControlPlane, kubelet: LocalKubelet, runtime: KubeRuntime, tmp_path: Path
) -> None:
    core = client.CoreV1Api(cluster.admin)
    gen1 = plan(tmp_path, 1, list(NODES), scale_config={"lr": 0.02, "ckpt_every": 1000})
    run(runtime.start_generation, gen1)
    run_until(runtime, gen1, 15, kubelet)
    core.delete_node(NODES["i-0ccc"])  # the instance is gone, and its pod's process with it
    deadline = time.monotonic() + 10
    while "live-g1-2" in kubelet.running:  # (the stand-in notices on its next sync)
        assert time.monotonic() < deadline, "the lost node's process still runs"
        time.sleep(0.05)
    deadline = time.monotonic() + 60
    while (result := watch(runtime, gen1)).outcome == "progress":
        assert time.monotonic() < deadline, "the loss was never noticed"
    assert result.outcome == "failed", result
    lost = stop(runtime, gen1, graceful=False, grace_s=10, lost_node_ids=["i-0ccc"])
    assert lost.acked_ranks == [0, 1] and lost.checkpoint_step is None, logs(kubelet)
    held = lost.held_step
    reached = max(e["step"] for entries in records(tmp_path, 1, job=JOB).values() for e in entries)
    assert held is not None and reached - held <= 1, (reached, held)
    gen2 = plan(tmp_path, 2, ["i-0aaa", "i-0bbb"], scale_config={"lr": 0.02, "ckpt_every": 1000})
    run(runtime.start_generation, gen2)
    assert sorted(job_pods(core)) == ["live-g1-0", "live-g1-1"]
    deadline = time.monotonic() + 120
    while (result := watch(runtime, gen2)).outcome == "progress":
        assert time.monotonic() < deadline, logs(kubelet)
    assert result.outcome == "completed", (result, logs(kubelet))
    rec1, rec2 = records(tmp_path, 1, job=JOB), records(tmp_path, 2, job=JOB)
    assert [e["step"] for e in rec2[0]] == list(range(held + 1, TOTAL_STEPS + 1))
    assert consumed([(through_held(rec1, held), held), (rec2, TOTAL_STEPS)]) == list(
        range(TOTAL_STEPS * GLOBAL_BATCH)
    )
    assert len(kubelet.started) == 3  # no pod was started again


def test_a_stop_that_finds_the_job_done_ends_the_next_generations_head_start(
    cluster: ControlPlane, kubelet: LocalKubelet, runtime: KubeRuntime, tmp_path: Path
) -> None:
    """A resize decided as the last step ran: the stop reports the job done, and the head
    start made for the generation that will now never run goes at once (left Running until
    cleanup, it was deleted gracefully while its node was being released, and no kubelet was
    left to end it: CI saw it outlive the job)."""
    core = client.CoreV1Api(cluster.admin)
    gen1 = plan(tmp_path, 1, ["i-0aaa", "i-0bbb"])
    run(runtime.start_generation, gen1)
    run_until(runtime, gen1, 5, kubelet)
    gen2 = plan(tmp_path, 2, ["i-0aaa", "i-0bbb", NEW_NODE[0]])
    run(runtime.prepare_generation, gen2)
    assert "live-g2-2" in job_pods(core), logs(kubelet)
    JobStore(gen1.checkpoint).write_done(TOTAL_STEPS, time.time())  # the last step ran
    ended = stop(runtime, gen1, graceful=True, grace_s=30)
    assert ended.done and "live-g2-2" not in job_pods(core), (ended, logs(kubelet))
    run(runtime.cleanup_job, CleanupRequest(job=JOB))
