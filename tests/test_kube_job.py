"""A whole TrainingJob through the Kubernetes runtime on the real control plane: a reclaim with
notice shrinks it, returning capacity grows it back, it completes, and nothing is left behind.

Real: the Temporal dev server and the TrainingJob workflow, kube-apiserver (the runtime as
its ServiceAccount), kube-scheduler binding each pod to its member's node, the training
library in every rank. Stood in for: EC2 (the simulated cloud; each instance it runs joins the
cluster as an EKS-labelled node and leaves when it goes, as its kubelet would register and
vanish) and the kubelet (tests/kube_kubelet.py runs each bound pod's command as a local
process with the pod's environment and volumes).
"""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from kubernetes import client
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.state import JobResult
from tests.jobs import Sim, fast_spec, running_at, sizes, until
from tests.k8s_cluster import (  # noqa: F401 (the fixtures)
    NAMESPACE,
    ControlPlane,
    cluster_fixture,
    control_plane_fixture,
)
from tests.kube_kubelet import LocalKubelet
from tests.test_local_runtime import WORKER
from tests.test_workflow_scenarios import in_seconds, members


def node_name(instance: str) -> str:
    return f"ip-{instance}.ec2.internal"


@contextmanager
def nodes_follow_instances(
    cloud: SimulatedCloud, cluster: ControlPlane, kubelet: LocalKubelet
) -> Iterator[None]:
    """Each running instance of the simulated cloud is a node (its kubelet: `kubelet`); an
    instance that is gone takes its node with it."""
    core = client.CoreV1Api(cluster.admin)
    stop = threading.Event()

    def sync() -> None:
        running = {node_name(n.node_id): n for n in cloud.running()}
        for name in set(running) - kubelet.nodes:
            info = running[name]
            cluster.add_node(name, info.node_id, zone=info.zone, fake=False)
            kubelet.nodes.add(name)
        for name in kubelet.nodes - set(running):
            core.delete_node(name)
            kubelet.nodes.discard(name)

    def follow() -> None:
        while not stop.wait(0.2):
            sync()

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        sync()  # the instances released as the job ended take their nodes too


async def test_training_job_reclaimed_and_grown_on_kubernetes(
    dev_env: WorkflowEnvironment, cluster: ControlPlane, tmp_path: Path
) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    spec = fast_spec(
        image="ghcr.io/example/train:1",
        command=[sys.executable, str(tmp_path / "worker.py"), "train"],
        checkpoint=f"file://{tmp_path}/ckpt",
        total_steps=800,
    )
    spec["elastic"] |= {"min_nodes": 2, "max_nodes": 3, "graceful_shutdown_timeout_s": 10}
    core = client.CoreV1Api(cluster.admin)
    worker_sa = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    runtime = KubeRuntime(NAMESPACE, worker_sa, gang_timeout_s=60, watch_s=1, ack_poll_s=0.1)
    cloud = SimulatedCloud(zones=["us-east-1a"])
    kubelet = LocalKubelet(core, NAMESPACE, tmp_path / "kubelet")
    queue = uuid.uuid4().hex
    with (
        kubelet.serving(),
        nodes_follow_instances(cloud, cluster, kubelet),
        ThreadPoolExecutor(16) as pool,
    ):
        async with workflow_worker(
            dev_env.client,
            queue,
            cloud.activities() + runtime.activities(),
            activity_executor=pool,
        ):
            sim = Sim(dev_env.client, cloud, runtime, queue)  # type: ignore[arg-type]
            handle = await sim.start(spec)
            before = await until(sim, handle, lambda s: running_at(3)(s) and s.step > 40, 120)
            victim = members(before)[1]
            await handle.signal(
                "reclaim", {"node_id": victim, "deadline": in_seconds(120), "event_id": "r1"}
            )
            shrunk = await until(sim, handle, running_at(2), 120)
            grown = await until(sim, handle, running_at(3, generation=shrunk.generation + 1), 120)
            result: JobResult = await handle.result()

        selector = f"spotrain.io/job={spec['name']}"
        deadline = time.monotonic() + 60
        while core.list_namespaced_pod(NAMESPACE, label_selector=selector).items:
            assert time.monotonic() < deadline, "pods left behind"
            time.sleep(0.2)
    assert victim not in members(shrunk)
    assert sizes(grown)[-3:] == [3, 2, 3]
    assert result.reclaims == 1 and result.steps_done == 800
    assert result.steps_lost == 0  # the elastic event reached the ranks: they checkpointed
    # every generation's pods ran, each on its member's node (bound by kube-scheduler)
    assert len(kubelet.started) == 3 + 2 + 3
    assert all(node == node_name(instance) for _, node, instance in kubelet.started)
    assert kubelet.running == {}
    assert core.list_namespaced_service(NAMESPACE, label_selector=selector).items == []
    assert core.list_namespaced_config_map(NAMESPACE, label_selector=selector).items == []
    assert cloud.running() == []
    assert [n.metadata.name for n in core.list_node().items] == []
