"""What the worker's grants cannot be turned into, tried as its ServiceAccount on the real
apiserver with infra/k8s's namespace.yaml and rbac.yaml: no pod outside the training pods'
namespace, none as another identity, none with the node's filesystem, and no Secret read,
listed or deleted in bulk. Each refusal is checked beside a plain pod that the same identity
may create (server-side dry runs: nothing is left behind)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.kube.k8s_cluster import NAMESPACE, SYSTEM_NAMESPACE, ControlPlane


def pod(**spec: Any) -> dict[str, Any]:
    container = {"name": "train", "image": "ghcr.io/example/train:1"}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probe", "labels": {"spotrain.io/managed": "true"}},
        "spec": {"containers": [container], **spec},
    }


@pytest.fixture(name="worker")
def worker_fixture(cluster: ControlPlane) -> client.CoreV1Api:
    return client.CoreV1Api(
        cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    )


def refusal(call: Any, *args: Any, **kwargs: Any) -> str:
    """The apiserver's 403 message for a call it must refuse."""
    with pytest.raises(ApiException) as info:
        call(*args, **kwargs)
    assert info.value.status == 403, info.value
    return str(json.loads(info.value.body)["message"])


def test_a_plain_training_pod_is_allowed(worker: client.CoreV1Api) -> None:
    """The control for the refusals below: the same identity, namespace and pod shape."""
    made = worker.create_namespaced_pod(NAMESPACE, pod(), dry_run="All")
    assert made.spec.service_account_name == "default"


def test_no_pod_in_spotrains_own_namespace(worker: client.CoreV1Api) -> None:
    """Where the operator's account and the webhook token live."""
    body = pod(serviceAccountName="spotrain-operator")
    message = refusal(worker.create_namespaced_pod, SYSTEM_NAMESPACE, body, dry_run="All")
    assert "spotrain-worker" in message and "cannot create resource" in message


def test_no_pod_as_another_service_account(cluster: ControlPlane, worker: client.CoreV1Api) -> None:
    """Only `default` exists where the worker may run pods, and nothing grants it anything."""
    for account in ("spotrain-operator", "spotrain-worker"):
        body = pod(serviceAccountName=account)
        message = refusal(worker.create_namespaced_pod, NAMESPACE, body, dry_run="All")
        assert f'serviceaccount "{account}" not found' in message, message
    accounts = client.CoreV1Api(cluster.admin).list_namespaced_service_account(NAMESPACE)
    assert [a.metadata.name for a in accounts.items] == ["default"]
    default = cluster.api_client(cluster.service_account_kubeconfig("default", NAMESPACE))
    as_default = client.CoreV1Api(default)
    for call in (as_default.list_namespaced_pod, as_default.list_namespaced_secret):
        assert "cannot list resource" in refusal(call, NAMESPACE)


def with_capability(capability: str) -> dict[str, Any]:
    body = pod()
    body["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": [capability]}}
    return body


@pytest.mark.parametrize(
    "body",
    [
        pod(volumes=[{"name": "root", "hostPath": {"path": "/"}}]),
        pod(hostPID=True),
        pod(hostNetwork=True),
        with_capability("SYS_ADMIN"),
    ],
    ids=["hostPath", "hostPID", "hostNetwork", "SYS_ADMIN"],
)
def test_no_pod_reaches_into_its_node(worker: client.CoreV1Api, body: dict[str, Any]) -> None:
    """Pod Security's baseline level on the namespace (a privileged container is refused
    before it, by this apiserver's --allow-privileged=false)."""
    message = refusal(worker.create_namespaced_pod, NAMESPACE, body, dry_run="All")
    assert 'violates PodSecurity "baseline:latest"' in message, message


def test_no_secret_is_read_listed_or_deleted_in_bulk(worker: client.CoreV1Api) -> None:
    """A collection delete returns the Secrets it deletes: the worker deletes its jobs' SSH
    keys by name, and has no rights at all where spotrain's own Secrets are."""
    for namespace in (NAMESPACE, SYSTEM_NAMESPACE):
        refusal(worker.list_namespaced_secret, namespace)
        refusal(worker.read_namespaced_secret, "spotrain-webhook", namespace)
        refusal(worker.delete_collection_namespaced_secret, namespace)
    refusal(worker.delete_namespaced_secret, "spotrain-webhook", SYSTEM_NAMESPACE)
