"""infra/k8s: every manifest is a valid object of the kubernetes client's models, and the
objects refer to each other correctly (selectors, ServiceAccounts, role bindings, probes).

namespace.yaml and rbac.yaml are also applied to a real kube-apiserver by every Kubernetes
test (tests/kube/k8s_cluster.py), whose RBAC then authorizes the runtime and the webhook. For the
rest, the client's generated models reject wrong types, and the lossless round trip below
catches misspelled or misplaced fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "infra/k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def docs() -> list[dict[str, Any]]:
    return [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def model_class(doc: dict[str, Any]) -> type:
    """`apps/v1` + `Deployment` -> client.V1Deployment."""
    version = doc["apiVersion"].rsplit("/", 1)[-1]
    return getattr(client, version.capitalize() + doc["kind"])


def by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in docs() if d["kind"] == kind]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_loads_into_client_models_losslessly(path: Path) -> None:
    api = client.ApiClient()
    for doc in yaml.safe_load_all(path.read_text()):
        if doc:
            model = model_class(doc).from_dict(doc)
            assert api.sanitize_for_serialization(model) == doc, doc["metadata"]["name"]


def test_a_misspelled_field_is_caught() -> None:
    """The check above is not vacuous: an unknown field does not survive the round trip."""
    doc = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"slector": {}},
    }
    model = model_class(doc).from_dict(doc)
    assert client.ApiClient().sanitize_for_serialization(model) != doc


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFESTS]
    namespaces = {d["metadata"]["name"] for d in by_kind("Namespace")}
    assert namespaces == {"spotrain", "spotrain-jobs"} and "namespace" not in kustomization
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
    for doc in docs():
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"]["namespace"] in namespaces, doc["metadata"]["name"]


def test_selectors_match_the_pods_they_mean() -> None:
    templates = {d["metadata"]["name"]: d["spec"]["template"] for d in by_kind("Deployment")}
    for name, tpl in templates.items():
        deployment = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == name)
        assert (
            deployment["spec"]["selector"]["matchLabels"].items()
            <= tpl["metadata"]["labels"].items()
        )
    selectors = [s["spec"]["selector"] for s in by_kind("Service")] + [
        p["spec"]["selector"]["matchLabels"] for p in by_kind("PodDisruptionBudget")
    ]
    for selector in selectors:
        matched = [
            n for n, t in templates.items() if selector.items() <= t["metadata"]["labels"].items()
        ]
        assert len(matched) == 1, selector
    # The operator's single replica may be drained at will: it keeps no state (no PDB).
    budgets = {p["metadata"]["name"] for p in by_kind("PodDisruptionBudget")}
    assert budgets == set(templates) - {"spotrain-operator"}


def test_service_accounts_and_bindings_fit_together() -> None:
    accounts = {d["metadata"]["name"]: d for d in by_kind("ServiceAccount")}
    roles = {(d["kind"], d["metadata"]["name"]) for d in by_kind("Role") + by_kind("ClusterRole")}
    bound: set[str] = set()
    for binding in by_kind("RoleBinding") + by_kind("ClusterRoleBinding"):
        assert (binding["roleRef"]["kind"], binding["roleRef"]["name"]) in roles
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["name"] in accounts
            bound.add(subject["name"])
    pod_specs = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in by_kind("Deployment")
    }
    assert pod_specs["spotrain-worker"]["serviceAccountName"] in bound
    webhook = pod_specs["spotrain-webhook"]
    rights = {
        (b["roleRef"]["name"], verb, resource)
        for b in by_kind("ClusterRoleBinding") + by_kind("RoleBinding")
        if any(s["name"] == webhook["serviceAccountName"] for s in b["subjects"])
        for role in by_kind("ClusterRole") + by_kind("Role")
        if role["metadata"]["name"] == b["roleRef"]["name"]
        for rule in role["rules"]
        for verb in rule["verbs"]
        for resource in rule["resources"]
    }
    assert {(verb, resource) for _, verb, resource in rights} == {("get", "nodes")}


def test_webhook_probes_hit_served_routes() -> None:
    routes = yaml.safe_load((ROOT / "workers/webhook/openapi.yaml").read_text())["paths"]
    deployment = next(
        d for d in by_kind("Deployment") if d["metadata"]["name"] == "spotrain-webhook"
    )
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] in routes


def test_no_secret_in_a_plain_env_value() -> None:
    for deployment in by_kind("Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                secretish = any(s in env["name"] for s in ("TOKEN", "SECRET", "KEY"))
                if secretish and not env["name"].endswith("_FILE"):
                    assert "secretKeyRef" in env["valueFrom"], env["name"]


def test_worker_deployment_runs_the_kubernetes_runtime_with_metrics() -> None:
    """The Deployment's command is one `spotrain worker` accepts, with pods as workers (the
    local runtime would start training inside the controller's own pod) and the metrics port
    it exposes."""
    from spotrain.workers.worker import parser

    (deployment,) = (d for d in by_kind("Deployment") if d["metadata"]["name"] == "spotrain-worker")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["spotrain", "worker"]
    args = parser().parse_args(container["args"][2:])
    assert (args.runtime, args.provider) == ("kubernetes", "ec2")
    port = int(args.metrics.rsplit(":", 1)[1])
    assert {"name": "metrics", "containerPort": port} in container["ports"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)
