"""The real control plane itself (tests/kube/k8s_cluster.py), that none of its processes
outlives its owner, the deployment's manifests as the apiserver sees them, and the webhook's
node lookup as its own ServiceAccount."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from kubernetes import client, utils
from kubernetes.client.exceptions import ApiException

from spotrain.activities.kube_api import instance_id
from spotrain.workers.webhook.server import NodeNames
from tests.kube.k8s_cluster import (
    NAMESPACE,
    ROOT,
    SYSTEM_NAMESPACE,
    TOOLS,
    ControlPlane,
    control_plane_or_skip,
)

K8S = Path(__file__).resolve().parents[2] / "infra/k8s"
WEBHOOK = "system:serviceaccount:spotrain:spotrain-webhook"


def test_fake_eks_nodes_are_kept_ready_by_kwok(cluster: ControlPlane) -> None:
    cluster.add_node("ip-10-0-1-5.ec2.internal", "i-0123456789abcdef0", zone="us-east-1b")
    core = client.CoreV1Api(cluster.admin)
    deadline = time.monotonic() + 30
    while True:
        node = core.read_node("ip-10-0-1-5.ec2.internal")
        ready = [c.status for c in node.status.conditions or [] if c.type == "Ready"]
        if ready == ["True"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ready == ["True"]
    assert node.spec.provider_id == "aws:///us-east-1b/i-0123456789abcdef0"
    assert node.metadata.labels["topology.kubernetes.io/zone"] == "us-east-1b"
    assert instance_id(node) == "i-0123456789abcdef0"


@pytest.mark.parametrize("manifest", ["worker.yaml", "webhook.yaml"])
def test_deployments_pass_server_side_validation(cluster: ControlPlane, manifest: str) -> None:
    """`kubectl apply --dry-run=server` with strict field validation: the apiserver's own
    checks (and admission) of infra/k8s, beyond what the client's models can tell."""
    created = utils.create_from_yaml(
        cluster.admin, str(K8S / manifest), dry_run="All", field_validation="Strict"
    )
    kinds = [d["kind"] for d in yaml.safe_load_all((K8S / manifest).read_text()) if d]
    assert "Deployment" in kinds
    assert [o.kind for group in created for o in group] == kinds  # each one accepted


async def test_webhook_resolves_node_names_as_its_own_service_account(
    cluster: ControlPlane,
) -> None:
    """The webhook's node lookup (workers/webhook/server.py) with the token of `spotrain-webhook`:
    the ClusterRole spotrain-node-lookup lets it read a node, and nothing else."""
    cluster.add_node("ip-10-0-9-9.ec2.internal", "i-0ddd1")
    core = client.CoreV1Api(cluster.admin)
    core.create_node(  # a node registered without the instance-id label: providerID only
        {
            "metadata": {"name": "ip-10-0-9-8.ec2.internal"},
            "spec": {"providerID": "aws:///us-east-1a/i-0eee2"},
        }
    )
    webhook = cluster.api_client(cluster.service_account_kubeconfig("spotrain-webhook"))
    mark = cluster.audit_mark()
    names = NodeNames(webhook)
    assert await names.instance_id("ip-10-0-9-9.ec2.internal") == "i-0ddd1"
    assert await names.instance_id("ip-10-0-9-8.ec2.internal") == "i-0eee2"
    assert await names.instance_id("ip-10-0-0-99.ec2.internal") is None  # 404: not a node
    assert await names.instance_id("ip-10-0-9-9.ec2.internal") == "i-0ddd1"  # cached
    requests = cluster.requests(WEBHOOK, mark)
    assert [(r.verb, r.resource, r.code) for r in requests] == [
        ("get", "nodes", 200),
        ("get", "nodes", 200),
        ("get", "nodes", 404),
    ]
    as_webhook = client.CoreV1Api(webhook)
    for forbidden in (as_webhook.list_node, lambda: as_webhook.list_namespaced_pod(NAMESPACE)):
        with pytest.raises(ApiException) as info:
            forbidden()
        assert info.value.status == 403


def test_a_service_account_token_is_refused_once_its_account_is_deleted(
    cluster: ControlPlane,
) -> None:
    """Tokens are bound to their ServiceAccount (TokenRequest): authentication is real. The
    apiserver looks the account up in its informer cache, so the deletion takes effect when
    its watch delivers it (a read right after the delete was once still 403: authenticated)."""
    core = client.CoreV1Api(cluster.admin)
    core.create_namespaced_service_account(SYSTEM_NAMESPACE, {"metadata": {"name": "short-lived"}})
    nodes = client.CoreV1Api(cluster.api_client(cluster.service_account_kubeconfig("short-lived")))

    def status() -> int:
        with pytest.raises(ApiException) as info:
            nodes.read_node("anything")
        return info.value.status

    assert status() == 403  # authenticated as the account, which may not read nodes
    core.delete_namespaced_service_account("short-lived", SYSTEM_NAMESPACE)
    deadline = time.monotonic() + 30
    while (seen := status()) == 403 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert seen == 401


def _children(pid: int) -> dict[int, str]:
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            name, rest = stat.read_text().rsplit(")", 1)
            if int(rest.split()[1]) == pid:
                found[int(stat.parent.name)] = name.split("(", 1)[1]
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.mark.parametrize("end", ["stopped", "killed"])
def test_no_control_plane_process_outlives_its_owner(end: str) -> None:
    """Whether the owner stops it (Ctrl-C) or dies by SIGKILL (a test process killed at its
    timeout): etcd, kube-apiserver, kube-scheduler and kwok all go with it."""
    env = {**os.environ, "SPOTRAIN_K8S_BIN": str(control_plane_or_skip())}
    owner = subprocess.Popen(
        [sys.executable, "-m", "tests.kube.k8s_cluster"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert owner.stdout is not None
        first = owner.stdout.readline()
        assert "control plane up" in first, first
        children = _children(owner.pid)
        assert set(children.values()) == set(TOOLS), children
        owner.send_signal(signal.SIGINT) if end == "stopped" else owner.kill()
        owner.wait(timeout=60)
        deadline = time.monotonic() + 30
        while left := {pid: name for pid, name in children.items() if _alive(pid)}:
            assert time.monotonic() < deadline, f"left running after the owner {end}: {left}"
            time.sleep(0.1)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(owner.pid, signal.SIGKILL)
        for pid in _children(owner.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_pod_deleted_at_once_is_not_deleted_again(cluster: ControlPlane) -> None:
    """kwok ends pods deleted with a grace period, by name; one deleted with none (as the
    runtime replaces a pod made differently) the apiserver removes at once, and kwok must
    leave its name alone: its late delete removed the pod made anew under that name (the
    flake of test_a_pod_found_made_differently_is_replaced, under load)."""
    cluster.add_node("ip-10-0-1-6.ec2.internal", "i-0123456789abcdef1", fake=True)
    cluster.ensure_namespace(NAMESPACE)
    core = client.CoreV1Api(cluster.admin)

    def pod(name: str) -> dict:
        return {
            "metadata": {"name": name, "labels": {"spotrain.io/managed": "true"}},
            "spec": {
                "nodeName": "ip-10-0-1-6.ec2.internal",
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "c", "image": "ghcr.io/example/train:1"}],
            },
        }

    def running(name: str) -> bool:
        return core.read_namespaced_pod(name, NAMESPACE).status.phase == "Running"

    core.create_namespaced_pod(NAMESPACE, pod("at-once"))
    core.create_namespaced_pod(NAMESPACE, pod("graceful"))
    wait_for(lambda: running("at-once") and running("graceful"))
    core.delete_namespaced_pod("at-once", NAMESPACE, grace_period_seconds=0)
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_pod("at-once", NAMESPACE)
    assert gone.value.status == 404
    core.delete_namespaced_pod("graceful", NAMESPACE, grace_period_seconds=1)
    wait_for(lambda: not pods_named(core, "graceful"))  # kwok ends it, as a kubelet would
    kwok_deletes = [
        line for line in cluster.log_tail("kwok", 10_000).splitlines() if "at-once" in line
    ]
    assert [line for line in kwok_deletes if "elete" in line] == []


def pods_named(core: client.CoreV1Api, name: str) -> list[str]:
    found = core.list_namespaced_pod(NAMESPACE, field_selector=f"metadata.name={name}").items
    return [p.metadata.name for p in found]


def wait_for(check: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)
