"""The TrainingJob, ScaleIn and ScaleOut custom resources on the real kube-apiserver, driven
with kubectl as a user would: the schema generated from the job spec is the committed one; a
valid resource is stored, an invalid one refused with its field named (the OpenAPI schema and
the CEL rules), a duplicate name refused; `kubectl get` prints the columns and `kubectl
scale` moves spec.replicas only within [min_nodes, max_nodes]."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from spotrain.workers.k8s import crd as k8s_crd
from spotrain.workflows.spec import parse_spec
from tests.kube.k8s_cluster import ROOT, ControlPlane
from tests.kube.kubectl import CRDS, Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture

EXAMPLE = ROOT / "examples/trainingjob.yaml"


def test_committed_crds_are_generated_from_the_job_spec() -> None:
    assert CRDS.read_text() == k8s_crd.render(), "run: python -m spotrain.workers.k8s.crd"


def test_example_is_a_valid_job_spec() -> None:
    from spotrain.workers.k8s.operator_status import job_input

    resource = yaml.safe_load(EXAMPLE.read_text())
    resource["metadata"]["uid"] = str(uuid.uuid4())
    spec = parse_spec(job_input(resource))
    assert spec.elastic.initial_nodes == 3 and spec.name.startswith("ddp-example-")


@pytest.fixture(name="ns")
def ns_fixture(control_plane: ControlPlane, kubectl: Kubectl) -> Iterator[str]:
    name = f"crd-{uuid.uuid4().hex[:6]}"
    control_plane.ensure_namespace(name)
    yield name
    kubectl("delete", "trainingjobs,scaleins,scaleouts", "--all", "-n", name, "--wait=false")


def example(name: str = "ddp-example", **elastic: object) -> dict:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["metadata"]["name"] = name
    doc["spec"]["elastic"].update(elastic)
    return doc


def apply(kubectl: Kubectl, ns: str, doc: dict, verb: str = "apply") -> tuple[int, str]:
    done = kubectl(verb, "-n", ns, "-f", "-", stdin=yaml.safe_dump(doc), check=False)
    return done.returncode, done.stdout + done.stderr


def test_valid_stored_and_printed_with_columns(kubectl: Kubectl, ns: str) -> None:
    code, said = apply(kubectl, ns, example())
    assert code == 0, said
    out = kubectl("get", "trainingjobs", "-n", ns).stdout.splitlines()
    assert out[0].split() == [
        "NAME",
        "PHASE",
        "NODES",
        "TARGET",
        "MIN",
        "MAX",
        "STEP",
        "COST",
        "AGE",
    ]
    assert out[1].split()[:3] == ["ddp-example", "2", "4"]  # no status yet: min, max, age
    wide = kubectl("get", "tj", "ddp-example", "-n", ns, "-o", "wide").stdout.splitlines()
    total = str(example()["spec"]["total_steps"])
    assert "TOTAL" in wide[0] and "LAST-EVENT" in wide[0] and total in wide[1].split()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"min_nodes": 0}, "spec.elastic.min_nodes: Invalid value: 0"),
        ({"min_nodes": 4, "max_nodes": 3}, "spec.elastic.min_nodes: Invalid value"),
        ({"increment_step": 1, "discrete_sizes": [2, 4]}, "spec.elastic.discrete_sizes"),
        ({"initial_nodes": 9}, "spec.elastic.initial_nodes"),
        ({"reclaim_policy": "keep"}, 'spec.elastic.reclaim_policy: Unsupported value: "keep"'),
        ({"max_nodes": 2}, "spec.replicas: Invalid value"),  # replicas 3 > max 2
        ({"discrete_sizes": [2, 4]}, "replicas must be one of elastic.discrete_sizes"),
        ({"min_nodes_typo": 1}, 'unknown field "spec.elastic.min_nodes_typo"'),
    ],
)
def test_invalid_refused_with_the_field_named(
    kubectl: Kubectl, ns: str, change: dict, named: str
) -> None:
    code, said = apply(kubectl, ns, example("bad", **change))
    assert code != 0 and named in said, said
    assert kubectl("get", "tj", "-n", ns, "-o", "name").stdout == ""


def test_top_level_rules(kubectl: Kubectl, ns: str) -> None:
    doc = example("gpus")
    doc["spec"] |= {"gpus_per_node": 1, "total_gpus": 2}
    code, said = apply(kubectl, ns, doc)
    assert code != 0 and "spec.total_gpus: Invalid value" in said, said
    doc = example("nocmd")
    del doc["spec"]["command"]
    code, said = apply(kubectl, ns, doc)
    assert code != 0 and "spec.command: Required value" in said, said


def test_duplicate_name_refused(kubectl: Kubectl, ns: str) -> None:
    assert apply(kubectl, ns, example(), "create")[0] == 0
    code, said = apply(kubectl, ns, example(), "create")
    assert code != 0 and "AlreadyExists" in said and '"ddp-example" already exists' in said


def test_scale_within_min_and_max(kubectl: Kubectl, ns: str) -> None:
    assert apply(kubectl, ns, example())[0] == 0
    kubectl("scale", "-n", ns, "trainingjob/ddp-example", "--replicas=4")
    replicas = kubectl("get", "-n", ns, "tj/ddp-example", "-o", "jsonpath={.spec.replicas}")
    assert replicas.stdout == "4"
    done = kubectl("scale", "-n", ns, "tj/ddp-example", "--replicas=5", check=False)
    assert done.returncode != 0 and "spec.replicas" in done.stderr
    done = kubectl("scale", "-n", ns, "tj/ddp-example", "--replicas=1", check=False)
    assert done.returncode != 0 and "spec.replicas" in done.stderr


def test_scale_requests_validated(kubectl: Kubectl, ns: str, tmp_path: Path) -> None:
    both = {
        "apiVersion": k8s_crd.API_VERSION,
        "kind": "ScaleIn",
        "metadata": {"name": "both"},
        "spec": {"trainingJob": "x", "count": 1, "workers": ["i-1"]},
    }
    code, said = apply(kubectl, ns, both)
    assert code != 0 and "give count or workers" in said, said
    out = {
        "apiVersion": k8s_crd.API_VERSION,
        "kind": "ScaleOut",
        "metadata": {"name": "out"},
        "spec": {"trainingJob": "x", "count": 1, "timeoutSeconds": 30},
    }
    assert apply(kubectl, ns, out)[0] == 0
    out["spec"]["count"] = 2
    code, said = apply(kubectl, ns, out)
    assert code != 0 and "a scale request is immutable" in said, said
