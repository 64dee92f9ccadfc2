"""Who may submit is Kubernetes RBAC, on the real kube-apiserver (RBAC on, users by client
certificate): a user without spotrain-trainingjob-submitter is refused, a user bound to it in
a namespace may create, scale and delete TrainingJobs there and nowhere else, and never write
their status (the operator's alone). `kubectl apply -k infra/k8s` deploys the whole base, and
the operator's ServiceAccount gets exactly what it needs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.kube.k8s_cluster import ROOT, ControlPlane
from tests.kube.kubectl import Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture

EXAMPLE = (ROOT / "examples/trainingjob.yaml").read_text()


@pytest.fixture(name="ns")
def ns_fixture(control_plane: ControlPlane, kubectl: Kubectl) -> str:
    name = f"rbac-{uuid.uuid4().hex[:6]}"
    control_plane.ensure_namespace(name)
    kubectl("apply", "-f", str(ROOT / "infra/k8s/operator-rbac.yaml"))
    return name


def test_only_submitters_may_submit(control_plane: ControlPlane, kubectl: Kubectl, ns: str) -> None:
    mallory = kubectl.as_user(control_plane.user_kubeconfig("mallory"))
    alice = kubectl.as_user(control_plane.user_kubeconfig("alice"))
    refused = mallory("create", "-n", ns, "-f", "-", stdin=EXAMPLE, check=False)
    assert refused.returncode != 0
    assert (
        'User "mallory" cannot create resource "trainingjobs" in API group "spotrain.io"'
        in refused.stderr
    ), refused.stderr

    kubectl(
        "create", "rolebinding", "alice-submits", "-n", ns,
        "--clusterrole=spotrain-trainingjob-submitter", "--user=alice",
    )  # fmt: skip
    alice("create", "-n", ns, "-f", "-", stdin=EXAMPLE)
    alice("scale", "-n", ns, "trainingjob/ddp-example", "--replicas=2")
    assert alice("get", "-n", ns, "tj/ddp-example", "-o", "jsonpath={.spec.replicas}").stdout == "2"
    forged = alice(
        "patch", "-n", ns, "tj/ddp-example", "--subresource=status", "--type=merge",
        "-p", '{"status": {"phase": "Succeeded"}}', check=False,
    )  # fmt: skip
    assert forged.returncode != 0 and "cannot patch resource" in forged.stderr, forged.stderr
    elsewhere = alice("create", "-n", "default", "-f", "-", stdin=EXAMPLE, check=False)
    assert elsewhere.returncode != 0 and "forbidden" in elsewhere.stderr
    assert mallory("get", "-n", ns, "trainingjobs", check=False).returncode != 0
    alice("delete", "-n", ns, "tj/ddp-example")


def can(kubectl: Kubectl, who: str, verb: str, what: str, ns: str = "team-x") -> bool:
    """`kubectl auth can-i`; `what` may name a subresource ("trainingjobs.spotrain.io/status"),
    passed as --subresource (can-i reads "kind/x" as the object named x)."""
    kind, _, sub = what.partition("/")
    extra = [f"--subresource={sub}"] if sub else []
    done = kubectl("auth", "can-i", verb, kind, *extra, f"--as={who}", "-n", ns, check=False)
    return done.stdout.strip() == "yes"


WORKLOADS = ("operator.yaml", "webhook.yaml", "worker.yaml")  # the base's, beside the plane's own


@pytest.fixture(name="deployed")
def deployed_fixture(kubectl: Kubectl) -> Iterator[str]:
    """`kubectl apply -k infra/k8s`; after the test, its workloads go (the namespaces, accounts
    and RBAC are the plane's own, which other modules' tests dry-run the Deployments beside)."""
    base = str(ROOT / "infra/k8s")
    kubectl("apply", "-k", base, "--dry-run=server")
    try:
        yield kubectl("apply", "-k", base).stdout
    finally:
        for manifest in WORKLOADS:
            path = str(ROOT / "infra/k8s" / manifest)
            kubectl("delete", "-f", path, "--ignore-not-found", "--wait=false")


def test_kustomize_base_deploys_with_least_privilege(kubectl: Kubectl, deployed: str) -> None:
    applied = deployed
    for name in ("spotrain-operator", "spotrain-worker", "spotrain-webhook"):
        assert f"deployment.apps/{name} " in applied, applied
    path = "jsonpath={.items[*].spec.template.spec.containers[*].image}"
    images = kubectl("get", "deployments", "-n", "spotrain", "-o", path).stdout.split()
    assert set(images) == {"ghcr.io/spotrain/spotrain:0.1.0"}  # the image the Dockerfile builds
    op = "system:serviceaccount:spotrain:spotrain-operator"
    for verb, what in [
        ("watch", "trainingjobs.spotrain.io"),
        ("patch", "trainingjobs.spotrain.io/status"),
        ("patch", "scaleouts.spotrain.io/status"),
        ("create", "events"),
    ]:
        assert can(kubectl, op, verb, what), (verb, what)
    for verb, what in [
        ("create", "trainingjobs.spotrain.io"),
        ("delete", "trainingjobs.spotrain.io"),
        ("patch", "scaleouts.spotrain.io"),  # (its status only)
        ("watch", "scaleins.spotrain.io"),
        ("create", "pods"),
        ("get", "secrets"),
        ("update", "customresourcedefinitions.apiextensions.k8s.io"),
    ]:
        assert not can(kubectl, op, verb, what), (verb, what)
