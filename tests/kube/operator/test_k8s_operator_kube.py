"""The operator end to end on the Kubernetes runtime, driven with kubectl as a user would:
`kubectl apply` a TrainingJob, its rank pods appear labelled as the job's, `kubectl scale`
up and down changes them and the printer columns follow, and `kubectl delete` ends with the
resource gone only once every pod and node is.

Real: kube-apiserver with the CRDs, kube-scheduler binding each rank pod to its member's
node, kubectl, the operator as a subprocess (its ServiceAccount), the Temporal dev server and
the TrainingJob workflow, the Kubernetes runtime (the worker's ServiceAccount), the training
library in every rank. Stood in for: EC2 (the simulated cloud; each instance registers as a
node) and the kubelet (tests/kube_kubelet.py runs each bound pod as a local process)."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import yaml
from kubernetes import client, watch
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.k8s.crd import API_VERSION, GROUP, VERSION
from spotrain.workers.k8s.operator_status import job_name
from spotrain.workers.worker import workflow_worker
from tests.elastic.test_local_runtime import WORKER
from tests.jobs import FAST_ELASTIC, process_spec
from tests.kube.k8s_cluster import (
    NAMESPACE,
    ControlPlane,
)
from tests.kube.kube_kubelet import node_name, nodes_follow_instances
from tests.kube.kube_support import job_on_kubernetes
from tests.kube.kubectl import Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture
from tests.kube.operator.operator_support import NS, operator, resource, status, wait_for

JOB = "kube-e2e"
R = TypeVar("R")


def trainingjob(tmp_path: Path, replicas: int) -> dict[str, Any]:
    """Real rank processes (tests/test_local_runtime.py's worker) that train until stopped."""
    elastic = {
        **FAST_ELASTIC,
        "min_nodes": 1,
        "max_nodes": 3,
        "opportunistic": False,  # the size moves only when kubectl moves it
        "graceful_shutdown_timeout_s": 10,
    }
    command = [sys.executable, str(tmp_path / "worker.py"), "train"]
    spec = process_spec("unused", command, f"file://{tmp_path}/ckpt", elastic)
    del spec["name"]
    spec |= {"image": "ghcr.io/example/train:1", "total_steps": 10_000_000}
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainingJob",
        "metadata": {"name": JOB},
        "spec": {"replicas": replicas, **spec},
    }


def on_deletion(api: client.ApiClient, name: str, version: str, look: Callable[[], R]) -> R:
    """`look()` as soon as a watch hears that the TrainingJob `name` was deleted."""
    custom = client.CustomObjectsApi(api)
    for event in watch.Watch().stream(
        custom.list_namespaced_custom_object,
        GROUP,
        VERSION,
        NS,
        "trainingjobs",
        field_selector=f"metadata.name={name}",
        resource_version=version,
        timeout_seconds=120,
    ):
        if event["type"] == "DELETED":
            return look()
    raise AssertionError(f"{name} was not deleted in 120 s")


async def test_kubectl_drives_a_training_job_on_kubernetes(
    dev_env: WorkflowEnvironment, cluster: ControlPlane, kubectl: Kubectl, tmp_path: Path
) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    cluster.ensure_namespace(NS)
    core, runtime, cloud, kubelet = job_on_kubernetes(cluster, tmp_path / "kubelet")
    queue = uuid.uuid4().hex
    with (
        operator(cluster, kubectl, dev_env.client, queue, tmp_path) as op,
        kubelet.serving(),
        nodes_follow_instances(cloud, cluster, kubelet),
        ThreadPoolExecutor(16) as pool,
    ):
        activities = cloud.activities() + runtime.activities()
        async with workflow_worker(dev_env.client, queue, activities, activity_executor=pool):
            with op.running():
                job = yaml.safe_dump(trainingjob(tmp_path, 2))
                kubectl("apply", "-n", NS, "-f", "-", stdin=job)
                uid = resource(kubectl, JOB)["metadata"]["uid"]
                selector = f"spotrain.io/managed=true,spotrain.io/job={job_name(JOB, uid)}"

                def ranks(size: int) -> dict[str, dict[str, str]] | None:
                    """The job's pods once they are `size` Running ranks of one generation,
                    each on the node of the member the resource's status lists for it."""
                    found = kubectl.json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"]
                    running = [p for p in found if p["status"].get("phase") == "Running"]
                    generations = {p["metadata"]["labels"]["spotrain.io/generation"] for p in found}
                    shown = status(kubectl, JOB)
                    if len(running) != size or len(found) != size or len(generations) != 1:
                        return None
                    if (shown.get("replicas"), shown.get("target")) != (size, size):
                        return None
                    placed = {
                        (p["metadata"]["annotations"]["spotrain.io/node-id"], p["spec"]["nodeName"])
                        for p in running
                    }
                    if placed != {(n["id"], node_name(n["id"])) for n in shown["nodes"]}:
                        return None  # (the status mirror is a pass behind the pods)
                    return {p["metadata"]["name"]: p["metadata"]["labels"] for p in running}

                def columns() -> list[str]:
                    return kubectl("get", "-n", NS, f"tj/{JOB}").stdout.splitlines()[1].split()

                pods = await wait_for(lambda: ranks(2), "2 rank pods", 120)
                ranks_seen = sorted(int(labels["spotrain.io/rank"]) for labels in pods.values())
                assert ranks_seen == [0, 1]
                assert columns()[:6] == [JOB, "Running", "2", "2", "1", "3"]
                for size in (3, 1):
                    kubectl("scale", "-n", NS, f"trainingjob/{JOB}", f"--replicas={size}")
                    after = await wait_for(lambda n=size: ranks(n), f"{size} rank pods", 120)
                    assert not set(after) & set(pods)  # a new generation's pods
                    assert columns()[:4] == [JOB, "Running", str(size), str(size)]
                    pods = after
                generation = resource(kubectl, JOB)["metadata"]["generation"]
                assert status(kubectl, JOB)["observedGeneration"] == generation

                # the resource goes last: the moment it is gone, nothing of the job is left
                # (the finalizer waited for the workflow's teardown)
                def leftovers() -> dict[str, list[str]]:
                    found = {
                        kind: [
                            o.metadata.name for o in items(NAMESPACE, label_selector=selector).items
                        ]
                        for kind, items in (
                            ("pods", core.list_namespaced_pod),
                            ("services", core.list_namespaced_service),
                            ("configmaps", core.list_namespaced_config_map),
                        )
                    }
                    return found | {"instances": [n.node_id for n in cloud.running()]}

                version = resource(kubectl, JOB)["metadata"]["resourceVersion"]
                with ThreadPoolExecutor(1) as one:
                    gone = one.submit(on_deletion, cluster.admin, JOB, version, leftovers)
                    kubectl("delete", "-n", NS, f"trainingjob/{JOB}", "--wait=false")
                    left = await asyncio.wait_for(asyncio.wrap_future(gone), 120)
                assert left == {"pods": [], "services": [], "configmaps": [], "instances": []}
    assert kubelet.running == {}
    assert len(kubelet.started) == 2 + 3 + 1
    assert core.list_node().items == []  # each instance's node went with it
