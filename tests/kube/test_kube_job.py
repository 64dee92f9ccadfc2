"""A whole TrainingJob through the Kubernetes runtime on the real control plane: a reclaim with
notice shrinks it, returning capacity grows it back, it completes, and nothing is left behind;
with `resize: live` (the real example in every pod), the survivors' pods are never replaced.

Real: the Temporal dev server and the TrainingJob workflow, kube-apiserver (the runtime as
its ServiceAccount), kube-scheduler binding each pod to its member's node, the training
library in every rank. Stood in for: EC2 (the simulated cloud; each instance it runs joins the
cluster as an EKS-labelled node and leaves when it goes, as its kubelet would register and
vanish) and the kubelet (tests/kube/kube_kubelet.py runs each bound pod's command as a local
process with the pod's environment and volumes).
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubernetes import client
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.kube_live import PORT_SPAN
from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.embedded.stack import port_block
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.job.state import JobResult, JobStatus
from tests.elastic.test_control_channel import wait_status
from tests.elastic.test_live_resize import (
    books_the_two_losses,
    live_job_spec,
    parked_for_the_notice_growth_and_loss,
)
from tests.elastic.test_local_runtime import WORKER
from tests.jobs import (
    Sim,
    fast_spec,
    left_before_the_shrink,
    record_history,
    running_at,
    sizes,
    until,
)
from tests.kube.k8s_cluster import (
    NAMESPACE,
    ControlPlane,
)
from tests.kube.kube_kubelet import LocalKubelet, node_name, nodes_follow_instances
from tests.kube.kube_support import job_on_kubernetes
from tests.workflows.test_workflow_scenarios import in_seconds, members


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
    core, runtime, cloud, kubelet = job_on_kubernetes(cluster, tmp_path / "kubelet")
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
            result: JobResult = await handle.result()

        selector = f"spotrain.io/job={spec['name']}"
        deadline = time.monotonic() + 60
        while core.list_namespaced_pod(NAMESPACE, label_selector=selector).items:
            assert time.monotonic() < deadline, "pods left behind"
            time.sleep(0.2)
    assert left_before_the_shrink(result, victim), result.timeline
    assert sizes(result)[-3:] == [3, 2, 3]
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


async def test_live_training_job_on_kubernetes(
    dev_env: WorkflowEnvironment, cluster: ControlPlane, tmp_path: Path
) -> None:
    """`resize: live` through the whole workflow on Kubernetes, with the real example in every
    pod: a reclaim notice shrinks the job and the replacement grows it back, a node lost
    without notice costs at most a step; the pods of surviving ranks are never replaced, so
    each node holds one pod over the whole job."""
    name = f"live-{uuid.uuid4().hex[:8]}"
    spec = live_job_spec(name, tmp_path, image="ghcr.io/example/train:1")
    core = client.CoreV1Api(cluster.admin)
    worker_sa = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    cloud = SimulatedCloud(zones=["us-east-1a"])
    kubelet = LocalKubelet(core, NAMESPACE, tmp_path / "kubelet")
    with (
        port_block(PORT_SPAN) as rendezvous,  # every pod here shares this machine's network
        kubelet.serving(),
        nodes_follow_instances(cloud, cluster, kubelet),
        ThreadPoolExecutor(16) as pool,
    ):
        runtime = KubeRuntime(
            NAMESPACE,
            worker_sa,
            master_port=rendezvous,
            gang_timeout_s=60,
            watch_s=1,
            ack_poll_s=0.1,
        )
        async with workflow_worker(
            dev_env.client, name, cloud.activities() + runtime.activities(), activity_executor=pool
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob", spec, id=name, task_queue=name, result_type=JobResult
            )
            status = await wait_status(handle, lambda s: s.world_size == 3 and s.step > 10, 120)
            first = status.generation
            noticed = status.nodes[-1].node_id or ""
            await handle.signal("reclaim", {"node_id": noticed, "deadline": in_seconds(120)})
            status = await wait_status(
                handle, lambda s: s.generation >= first + 2 and s.world_size == 3, 120
            )
            grown = status.step
            status = await wait_status(  # (rank 2 is in the status once its node is placed)
                handle, lambda s: s.step > grown + 10 and rank_node(s, 2) is not None
            )
            lost = rank_node(status, 2) or ""
            cloud.reclaim(lost)  # its node (and the pod's process) goes with the instance
            await handle.signal("node_lost", {"node_id": lost, "event_id": f"lost-{lost}"})
            result = await asyncio.wait_for(handle.result(), 240)
            await record_history(handle, "live_resize_kubernetes")
        selector = f"spotrain.io/job={name}"
        deadline = time.monotonic() + 60
        while left := core.list_namespaced_pod(NAMESPACE, label_selector=selector).items:
            assert time.monotonic() < deadline, [p.metadata.name for p in left]
            time.sleep(0.2)
    timeline = [(e.generation, e.event, e.detail) for e in result.timeline]
    told = "\n".join(map(str, timeline))  # (a string: pytest shows it whole)
    parked = [e[2] for e in timeline if e[1] == "generation parked (live resize)"]
    assert parked_for_the_notice_growth_and_loss(parked, noticed, lost), told
    gone = [e[2] for e in timeline if e[1] == "node gone"]
    assert books_the_two_losses(gone, noticed, lost), told
    assert result.steps_done == 1200 and result.steps_lost <= 1, result
    # Pods are made only for the first three nodes and the replacements: one per node, ever
    # (the second replacement's only if it came before the job's last step, see above).
    pods = "\n".join(map(str, kubelet.started))
    nodes = [node for _, node, _ in kubelet.started]
    assert len(set(nodes)) == len(nodes) and len(nodes) in (4, 5), f"{pods}\n{told}"
    assert all(node == node_name(instance) for _, node, instance in kubelet.started)
    assert kubelet.running == {} and cloud.running() == []


def rank_node(status: JobStatus, rank: int) -> str | None:
    """The node that holds `rank` in this status, if one does yet."""
    return next((n.node_id for n in status.nodes if n.rank == rank and n.node_id), None)
