"""Fixtures and helpers for the Kubernetes runtime's tests on the real control plane
(tests/kube/test_kube_runtime.py, tests/kube/test_kube_watch.py): three EKS-like spot nodes, the
runtime as the `spotrain-worker` ServiceAccount, its requests from the audit log."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client
from temporalio.testing import ActivityEnvironment

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.simulated import SimulatedCloud
from spotrain.elastic.job_store import JobStore
from spotrain.workflows.contract import GenerationPlan, Member, StopRequest, WatchRequest
from tests.kube.k8s_cluster import NAMESPACE as NS
from tests.kube.k8s_cluster import ControlPlane, Request
from tests.kube.kube_kubelet import LocalKubelet, finish_pod

JOB = "mnist"
NODES = {"ip-10-0-0-1": "i-0aaa", "ip-10-0-0-2": "i-0bbb", "ip-10-0-0-3": "i-0ccc"}
SPOT_TAINT = {"key": "karpenter.sh/capacity-type", "value": "spot", "effect": "NoSchedule"}
WORKER = "system:serviceaccount:spotrain:spotrain-worker"
ROOT = Path(__file__).resolve().parents[2]
R = TypeVar("R")


def add_nodes(cluster: ControlPlane, fake: bool = True) -> None:
    for name, iid in NODES.items():
        cluster.add_node(name, iid, taints=[SPOT_TAINT], gpus=8, fake=fake)


@pytest.fixture(name="kube")
def kube_fixture(cluster: ControlPlane) -> ControlPlane:
    """The cluster with three spot nodes that kwok keeps Ready."""
    add_nodes(cluster)
    return cluster


@pytest.fixture(name="core")
def core_fixture(cluster: ControlPlane) -> client.CoreV1Api:
    """The admin's view, for setting up and inspecting (never the runtime's)."""
    return client.CoreV1Api(cluster.admin)


@pytest.fixture(name="worker_client")
def worker_client_fixture(cluster: ControlPlane) -> client.ApiClient:
    return cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))


@pytest.fixture(name="runtime")
def runtime_fixture(worker_client: client.ApiClient) -> KubeRuntime:
    return KubeRuntime(NS, worker_client, gang_timeout_s=30, watch_s=1, ack_poll_s=0.05)


@pytest.fixture(name="audit")
def audit_fixture(cluster: ControlPlane) -> Callable[[], list[Request]]:
    """The runtime's requests since the test began, from the apiserver's audit log."""
    mark = cluster.audit_mark()
    return lambda: cluster.requests(WORKER, mark)


def plan_for(ckpt: str, generation: int = 1, nodes: int = 3, **kw: Any) -> GenerationPlan:
    members = [Member(node_id=iid, address="unused") for iid in list(NODES.values())[:nodes]]
    fields: dict[str, Any] = {
        "job": JOB,
        "generation": generation,
        "members": members,
        "command": ["python", "train.py"],
        "image": "ghcr.io/example/train:1",
        "checkpoint": ckpt,
        "total_steps": 100,
    }
    return GenerationPlan(**{**fields, **kw})


def run(fn: Callable[..., R], *args: Any) -> R:
    return ActivityEnvironment().run(fn, *args)


def in_thread(fn: Callable[..., R], *args: Any) -> Future[R]:
    return ThreadPoolExecutor(1).submit(run, fn, *args)


def pods(core: client.CoreV1Api, selector: str = "", ns: str = NS) -> dict[str, client.V1Pod]:
    return {p.metadata.name: p for p in core.list_namespaced_pod(ns, label_selector=selector).items}


def wait_until(check: Callable[[], Any], timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return found


def bound(core: client.CoreV1Api, name: str) -> bool:
    """The scheduler bound the pod to a node."""
    pod = pods(core).get(name)
    return pod is not None and pod.spec.node_name is not None


def env_of(pod: client.V1Pod) -> dict[str, str]:
    return {e.name: e.value for e in pod.spec.containers[0].env}


def deletes(requests: list[Request], resource: str = "pods") -> list[tuple[str, str]]:
    """(name, gracePeriodSeconds) of each delete the runtime sent, in order."""
    found = []
    for r in requests:
        if r.verb == "delete" and r.resource == resource:
            grace = r.uri.split("gracePeriodSeconds=")[1].split("&")[0] if "grace" in r.uri else ""
            found.append((r.name, grace))
    return found


def stop_request(ckpt: str, **kw: Any) -> StopRequest:
    defaults: dict[str, Any] = dict(
        job=JOB, generation=1, world_size=3, checkpoint=ckpt, graceful=True, grace_s=5
    )
    return StopRequest(**{**defaults, **kw})


@pytest.fixture(name="ckpt")
def ckpt_fixture(tmp_path: Path) -> str:
    return f"file://{tmp_path}/ckpt"


def ack_on_stop(core: client.CoreV1Api, ckpt: str, ranks: dict[str, list[int]]) -> None:
    """Stand-in for the training processes and their kubelet: once a pod's control annotation
    says stop (what its downwardAPI file would show), its ranks checkpoint (ack) and its
    container exits 0."""

    def worker() -> None:
        waiting = dict(ranks)
        deadline = time.monotonic() + 20
        while waiting and time.monotonic() < deadline:
            for name in list(waiting):
                pod = core.read_namespaced_pod(name, NS)
                if (pod.metadata.annotations or {}).get("spotrain.io/control") == "stop":
                    for rank in waiting.pop(name):
                        JobStore(ckpt).write_ack(1, rank, step=40, time=time.time())
                    finish_pod(core, NS, name, 0)
            time.sleep(0.05)

    threading.Thread(target=worker, daemon=True).start()


def watch_request(ckpt: str, report_after_s: float = 20) -> WatchRequest:
    return WatchRequest(
        job=JOB, generation=1, world_size=3, checkpoint=ckpt, report_after_s=report_after_s
    )


@pytest.fixture(name="rbac")
def rbac_fixture(cluster: ControlPlane) -> client.RbacAuthorizationV1Api:
    return client.RbacAuthorizationV1Api(cluster.admin)


def job_on_kubernetes(
    cluster: ControlPlane, root: Path
) -> tuple[client.CoreV1Api, KubeRuntime, SimulatedCloud, LocalKubelet]:
    """A whole job's parts on the Kubernetes runtime: the admin's API (to look), the runtime as
    the worker's ServiceAccount, a one-zone simulated cloud (its instances join as nodes with
    tests/kube_kubelet.py's `nodes_follow_instances`) and the stand-in kubelet under `root`."""
    core = client.CoreV1Api(cluster.admin)
    worker_sa = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    runtime = KubeRuntime(NS, worker_sa, gang_timeout_s=60, watch_s=1, ack_poll_s=0.1)
    return core, runtime, SimulatedCloud(zones=["us-east-1a"]), LocalKubelet(core, NS, root)


def spotrain(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it: its own process, with `env`."""
    return subprocess.run(
        [sys.executable, "-m", "spotrain.workers.cli.main", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def granted(path: Path, *roles: str) -> set[tuple[str, str]]:
    """Every (verb, resource) that the Roles and ClusterRoles named `roles` in the RBAC file
    `path` grant: what an audit log of a whole run must show in use, and no more."""
    pairs = set()
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc["kind"] in ("Role", "ClusterRole") and doc["metadata"]["name"] in roles:
            for rule in doc["rules"]:
                pairs |= {(v, r) for v in rule["verbs"] for r in rule["resources"]}
    return pairs
