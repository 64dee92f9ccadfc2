"""The sharded example (examples/train_fsdp.py: FSDP2 as HSDP, gloo, CPU) resized on the
Kubernetes runtime, on the real control plane: one pod per node runs the node's two processes
(spotrain.elastic.procs). Live, a joining node's pod takes its shards from the survivors, and a
node lost without notice costs at most the step in flight; by restart, each generation's pods
load the last one's checkpoint onto their own mesh. The weights end as an uninterrupted run's
(on the local runtime).

Stood in for: the kubelet (tests/kube/kube_kubelet.py runs each bound pod's command as a local
process), as in tests/kube/test_kube_live.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes import client
from temporalio.testing import ActivityEnvironment

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.local import LocalRuntime
from spotrain.elastic.job_store import JobStore
from spotrain.workflows.contract import GenerationPlan
from tests.conftest import kill_local_ranks
from tests.elastic.test_live_resize import consumed, through_held
from tests.elastic.test_train_ddp import records
from tests.elastic.test_train_ddp import watch as watch_local
from tests.elastic.test_train_fsdp import GLOBAL_BATCH, PROCS, assert_same_weights, plan
from tests.kube.k8s_cluster import (  # noqa: F401 (the fixtures)
    NAMESPACE,
    ControlPlane,
)
from tests.kube.kube_kubelet import LocalKubelet
from tests.kube.test_kube_live import (  # noqa: F401 (the fixtures)
    JOB,
    NODES,
    job_pods,
    kubelet_fixture,
    logs,
    run,
    run_until,
    runtime_fixture,
    stop,
    watch,
)

pytest.importorskip("torch")

# Enough that the job still trains while a loaded machine starts the joiner's pod.
pytestmark = pytest.mark.usefixtures("warm_python_server")  # tests/warm_python.py

TOTAL_STEPS = 200


def on_kube(tmp_path: Path, generation: int, nodes: list[str], live: bool) -> GenerationPlan:
    """The example's generation on these nodes, as pods of the kubelet stand-in's image."""
    p = plan(tmp_path, generation, nodes, job=JOB, live=live, total_steps=TOTAL_STEPS)
    return p.model_copy(update={"image": "ghcr.io/example/train:1"})


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Path]]:
    """Two nodes, never resized, on the local runtime: started once, beside the module's first
    job, for all its tests (four more torch ranks per test otherwise). A call waits for it to
    finish and gives its folder."""
    tmp = tmp_path_factory.mktemp("kube-fsdp-reference")
    env, local = ActivityEnvironment(), LocalRuntime(tmp / "rt")
    ref = plan(tmp, 0, [0, 1], job="ref", total_steps=TOTAL_STEPS)

    @functools.cache
    def finished() -> Path:
        deadline = time.monotonic() + 180
        while (done := watch_local(env, local, ref)).outcome == "progress":
            assert time.monotonic() < deadline, "the reference did not finish"
        assert done.outcome == "completed", done
        return tmp / "ref"

    try:
        env.run(local.start_generation, ref)
        yield finished
    finally:
        kill_local_ranks(tmp)


def run_to_end(runtime: KubeRuntime, p: GenerationPlan, kubelet: LocalKubelet) -> None:
    """The job's last generation runs to completion."""
    deadline = time.monotonic() + 180
    while (result := watch(runtime, p)).outcome == "progress":
        assert time.monotonic() < deadline, logs(kubelet)
    assert result.outcome == "completed", (result, logs(kubelet))


def test_a_sharded_job_resized_by_restart_on_kubernetes(
    kubelet: LocalKubelet,
    runtime: KubeRuntime,
    tmp_path: Path,
    uninterrupted: Callable[[], Path],
) -> None:
    """2 -> 3 -> 2 nodes (4 -> 6 -> 4 ranks) by restart: DCP reshards each checkpoint onto
    the next generation's pods, and every sample is consumed once."""
    a, b, c = list(NODES)
    stops, gens = [], [on_kube(tmp_path, 1, [a, b], live=False)]
    for g, nodes in enumerate(([a, b, c], [b, c]), start=2):
        run(runtime.start_generation, gens[-1])
        run_until(runtime, gens[-1], (stops[-1] if stops else 0) + 8, kubelet)
        done = stop(runtime, gens[-1], live=False, graceful=True, grace_s=60)
        assert done.checkpoint_step is not None and not done.forced, logs(kubelet)
        stops.append(done.checkpoint_step)
        gens.append(on_kube(tmp_path, g, nodes, live=False))
    run(runtime.start_generation, gens[-1])
    run_to_end(runtime, gens[-1], kubelet)

    assert [name for name, _, _ in kubelet.started] == [  # new pods at every generation
        f"{JOB}-g1-0",
        f"{JOB}-g1-1",
        f"{JOB}-g2-0",
        f"{JOB}-g2-1",
        f"{JOB}-g2-2",
        f"{JOB}-g3-0",
        f"{JOB}-g3-1",
    ]
    rec = {g: records(tmp_path, g, job=JOB) for g in (1, 2, 3)}
    assert {e["world"] for e in rec[2][5]} == {3 * PROCS}
    assert consumed([(rec[1], stops[0]), (rec[2], stops[1]), (rec[3], TOTAL_STEPS)]) == list(
        range(TOTAL_STEPS * GLOBAL_BATCH)
    )
    store = JobStore(gens[-1].checkpoint)
    assert store.loaded_step(2) == stops[0] and store.loaded_step(3) == stops[1]
    assert_same_weights(tmp_path / JOB, uninterrupted())


def test_a_sharded_job_grows_and_loses_a_node_live_on_kubernetes(
    cluster: ControlPlane,
    kubelet: LocalKubelet,
    runtime: KubeRuntime,
    tmp_path: Path,
    uninterrupted: Callable[[], Path],
) -> None:
    core = client.CoreV1Api(cluster.admin)
    a, b, c = list(NODES)

    def on(generation: int, nodes: list[str]) -> GenerationPlan:
        return on_kube(tmp_path, generation, nodes, live=True)

    gen1 = on(1, [a, b])
    run(runtime.start_generation, gen1)
    run_until(runtime, gen1, 8, kubelet)
    assert sorted(job_pods(core)) == [f"{JOB}-g1-0", f"{JOB}-g1-1"]  # a pod per node

    # Growth: the new node's pod (a head start) takes each shard from a survivor.
    gen2 = on(2, [a, b, c])
    run(runtime.prepare_generation, gen2)
    grow = stop(runtime, gen1, graceful=True, grace_s=60)
    s1 = grow.held_step
    assert s1 is not None and grow.checkpoint_step is None, logs(kubelet)
    run(runtime.start_generation, gen2)
    run_until(runtime, gen2, s1 + 8, kubelet)

    # Node b lost without notice: its pod's two processes go with it.
    core.delete_node(NODES[b])
    deadline = time.monotonic() + 10
    while f"{JOB}-g1-1" in kubelet.running:  # (the stand-in notices on its next sync)
        assert time.monotonic() < deadline, "the lost node's processes still run"
        time.sleep(0.05)
    deadline = time.monotonic() + 60
    while watch(runtime, gen2).outcome == "progress":
        assert time.monotonic() < deadline, "the loss was never noticed"
    lost = stop(runtime, gen2, graceful=False, grace_s=20, lost_node_ids=[b])
    held = lost.held_step
    assert lost.acked_ranks == [0, 1, 4, 5] and held is not None, logs(kubelet)
    gen3 = on(3, [a, c])
    run(runtime.start_generation, gen3)
    run_to_end(runtime, gen3, kubelet)

    # Three pods for the whole job, each with the node's processes: two, then the joiner.
    assert [name for name, _, _ in kubelet.started] == [
        f"{JOB}-g1-0",
        f"{JOB}-g1-1",
        f"{JOB}-g2-2",
    ]
    rec = {g: records(tmp_path, g, job=JOB) for g in (1, 2, 3)}
    assert [e["step"] for e in rec[3][0]] == list(range(held + 1, TOTAL_STEPS + 1))
    assert {e["world"] for e in rec[2][5]} == {3 * PROCS}
    rec2 = through_held(rec[2], held, GLOBAL_BATCH)
    assert consumed([(rec[1], s1), (rec2, held), (rec[3], TOTAL_STEPS)]) == list(
        range(TOTAL_STEPS * GLOBAL_BATCH)
    )
    store = JobStore(gen3.checkpoint)
    assert store.loaded_step(2) is None and store.loaded_step(3) is None  # nothing from disk
    assert_same_weights(tmp_path / JOB, uninterrupted())
