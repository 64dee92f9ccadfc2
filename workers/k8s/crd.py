"""The custom resources `kubectl` drives, generated from the pydantic models so they never drift.

`TrainingJob`'s spec schema is `JobSpec`'s JSON schema (less `name`, which is the resource's
own name, plus `replicas`, the scale subresource's target) rewritten as the structural OpenAPI
v3 schema a CustomResourceDefinition needs; its status schema is `TrainingJobStatus`'s. The
cross-field checks pydantic makes after parsing (min <= max and the like) become CEL rules, so
that the API server refuses such a resource with the field named, before any workflow starts.

`python -m spotrain.workers.k8s.crd > infra/k8s/crds.yaml` writes them; a test regenerates
the file and compares.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import yaml
from pydantic import BaseModel

from spotrain.workers.k8s.operator_status import ScaleStatus, TrainingJobStatus
from spotrain.workflows.spec import ElasticPolicy, JobSpec, OnDemandPolicy

GROUP = "spotrain.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
FINALIZER = f"{GROUP}/release-nodes"
DROPPED = (
    "title",
    "default",
    "$defs",
)  # defaults stay pydantic's: the stored object is what was written


def structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema as a structural CRD schema: `$ref`s inlined, `X | None` as X
    (an absent field is None), numeric exclusive bounds in OpenAPI v3.0's boolean form, an
    open mapping as `x-kubernetes-preserve-unknown-fields`."""
    if "$ref" in schema:
        return structural(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    options = [s for s in schema.get("anyOf", []) if s.get("type") != "null"]
    if "anyOf" in schema and len(options) == 1:
        merged = {k: v for k, v in schema.items() if k != "anyOf"} | options[0]
        return structural(merged, defs)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in DROPPED:
            continue
        if key == "exclusiveMinimum":
            out |= {"minimum": value, "exclusiveMinimum": True}
        elif key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key == "additionalProperties":
            if value is True or value == {}:
                out["x-kubernetes-preserve-unknown-fields"] = True
            elif value is not False:  # false: unknown fields are refused by strict validation
                out[key] = structural(value, defs)
        elif key == "description":
            out[key] = " ".join(value.split())
        else:
            out[key] = value
    if "x-kubernetes-preserve-unknown-fields" in out:
        out.pop("additionalProperties", None)
    return out


def model_schema(model: type[BaseModel], **kw: Any) -> dict[str, Any]:
    raw = model.model_json_schema(**kw)
    return structural(raw, raw.get("$defs", {}))


def _or_default(model: type[BaseModel], field: str, where: str = "self") -> str:
    """A CEL expression for the field's value, or pydantic's default when it is absent."""
    default = model.model_fields[field].default
    return f"(has({where}.{field}) ? {where}.{field} : {default})"


def _elastic_rules() -> list[dict[str, str]]:
    lo, hi = _or_default(ElasticPolicy, "min_nodes"), _or_default(ElasticPolicy, "max_nodes")
    return [
        {
            "rule": f"{lo} <= {hi}",
            "message": "min_nodes must be <= max_nodes",
            "fieldPath": ".min_nodes",
        },
        {
            "rule": "!has(self.increment_step) || !has(self.discrete_sizes)",
            "message": "set increment_step or discrete_sizes, not both",
            "fieldPath": ".discrete_sizes",
        },
        {
            "rule": f"!has(self.initial_nodes) || ({lo} <= self.initial_nodes && "
            f"self.initial_nodes <= {hi})",
            "message": "initial_nodes must be within [min_nodes, max_nodes]",
            "fieldPath": ".initial_nodes",
        },
        {
            "rule": "!has(self.discrete_sizes) || "
            f"self.discrete_sizes.all(s, {lo} <= s && s <= {hi})",
            "message": "discrete_sizes must be within [min_nodes, max_nodes]",
            "fieldPath": ".discrete_sizes",
        },
    ]


def _spec_rules() -> list[dict[str, str]]:
    def elastic(field: str) -> str:
        default = ElasticPolicy.model_fields[field].default
        return (
            f"(has(self.elastic) && has(self.elastic.{field}) ? self.elastic.{field} : {default})"
        )

    lo, hi = elastic("min_nodes"), elastic("max_nodes")
    base = _or_default(OnDemandPolicy, "base_nodes", "self.on_demand")
    placement = JobSpec.model_fields["placement"].default
    return [
        {
            "rule": f"!has(self.replicas) || ({lo} <= self.replicas && self.replicas <= {hi})",
            "message": "replicas must be within [elastic.min_nodes, elastic.max_nodes]",
            "fieldPath": ".replicas",
        },
        {
            "rule": "!has(self.replicas) || !has(self.elastic) || "
            "!has(self.elastic.discrete_sizes) || self.replicas in self.elastic.discrete_sizes",
            "message": "replicas must be one of elastic.discrete_sizes",
            "fieldPath": ".replicas",
        },
        {
            "rule": "!has(self.gpus_per_node) || !has(self.total_gpus)",
            "message": "set gpus_per_node or total_gpus, not both",
            "fieldPath": ".total_gpus",
        },
        {
            "rule": f"!has(self.on_demand) || {base} <= {hi}",
            "message": "on_demand.base_nodes must be <= elastic.max_nodes",
            "fieldPath": ".on_demand.base_nodes",
        },
        {
            "rule": "!has(self.placement_group) || !self.placement_group || "
            f"(has(self.placement) ? self.placement : '{placement}') == 'zone'",
            "message": "placement_group needs placement: zone",
            "fieldPath": ".placement_group",
        },
    ]


def training_job_spec_schema() -> dict[str, Any]:
    spec = model_schema(JobSpec)
    del spec["properties"]["name"]
    spec["required"] = [f for f in spec["required"] if f != "name"]
    spec["properties"] = {
        "replicas": {
            "type": "integer",
            "minimum": 1,
            "description": "nodes wanted now (`kubectl scale`): the workflow's target, within "
            "elastic.min_nodes and max_nodes; default: elastic.initial_nodes",
        },
        **spec["properties"],
    }
    spec["properties"]["elastic"]["x-kubernetes-validations"] = _elastic_rules()
    spec["x-kubernetes-validations"] = _spec_rules()
    spec["description"] = "The job spec `spotrain submit` takes, less its name (the resource's)."
    return spec


def _crd(kind: str, plural: str, short: list[str], version: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{GROUP}",
            "labels": {"app.kubernetes.io/part-of": "spotrain"},
        },
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short,
                "categories": ["spotrain"],
            },
            "versions": [{"name": VERSION, "served": True, "storage": True, **version}],
        },
    }


def _root(spec: dict[str, Any], status: dict[str, Any]) -> dict[str, Any]:
    return {
        "openAPIV3Schema": {
            "type": "object",
            "required": ["spec"],
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"type": "object"},
                "spec": spec,
                "status": status,
            },
        }
    }


def _column(name: str, path: str, kind: str = "string", **kw: Any) -> dict[str, Any]:
    return {"name": name, "type": kind, "jsonPath": path, **kw}


def training_job_crd() -> dict[str, Any]:
    version = {
        "schema": _root(training_job_spec_schema(), model_schema(TrainingJobStatus, by_alias=True)),
        "subresources": {
            "status": {},
            "scale": {
                "specReplicasPath": ".spec.replicas",
                "statusReplicasPath": ".status.replicas",
            },
        },
        "additionalPrinterColumns": [
            _column("Phase", ".status.phase"),
            _column("Nodes", ".status.replicas", "integer", description="world size in nodes"),
            _column("Target", ".status.target", "integer"),
            _column("Min", ".spec.elastic.min_nodes", "integer"),
            _column("Max", ".spec.elastic.max_nodes", "integer"),
            _column("Step", ".status.steps", "integer"),
            _column("Total", ".spec.total_steps", "integer", priority=1),
            _column("Cost", ".status.cost", description="USD so far"),
            _column("Last-Event", ".status.lastEvent", priority=1),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    }
    return _crd("TrainingJob", "trainingjobs", ["tj"], version)


def _scale_spec(out: bool) -> dict[str, Any]:
    props: dict[str, Any] = {
        "trainingJob": {"type": "string", "description": "the TrainingJob's name (same namespace)"},
        "count": {"type": "integer", "minimum": 1, "maximum": 1000, "description": "nodes"},
    }
    if out:
        props["timeoutSeconds"] = {
            "type": "number",
            "minimum": 0,
            "exclusiveMinimum": True,
            "maximum": 2592000,
            "description": "give the nodes this long, else the target goes back; none: no wait",
        }
        required, rules = ["trainingJob", "count"], []
    else:
        props["workers"] = {
            "type": "array",
            "maxItems": 1000,
            "items": {"type": "string"},
            "description": "the nodes to remove, by id (status.nodes[].id of the TrainingJob)",
        }
        required = ["trainingJob"]
        rules = [
            {"rule": "has(self.count) != has(self.workers)", "message": "give count or workers"}
        ]
    rules.append({"rule": "self == oldSelf", "message": "a scale request is immutable"})
    return {
        "type": "object",
        "required": required,
        "properties": props,
        "x-kubernetes-validations": rules,
    }


def scale_crd(kind: str) -> dict[str, Any]:
    version = {
        "schema": _root(_scale_spec(kind == "ScaleOut"), model_schema(ScaleStatus, by_alias=True)),
        "subresources": {"status": {}},
        "additionalPrinterColumns": [
            _column("Job", ".spec.trainingJob"),
            _column("Count", ".spec.count", "integer"),
            _column("Phase", ".status.phase"),
            _column("Message", ".status.message"),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    }
    return _crd(kind, f"{kind.lower()}s", [], version)


def all_crds() -> list[dict[str, Any]]:
    return [training_job_crd(), scale_crd("ScaleIn"), scale_crd("ScaleOut")]


def render() -> str:
    head = "# Generated by `python -m spotrain.workers.k8s.crd`: do not edit (a test compares).\n"
    docs = [copy.deepcopy(d) for d in all_crds()]
    return head + yaml.safe_dump_all(docs, sort_keys=False, width=100)


if __name__ == "__main__":
    sys.stdout.write(render())
