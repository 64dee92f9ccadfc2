"""The operator's decisions, pure: names and ids derived from a resource, the spec a
`TrainingJob` resource means, its status from the workflow's `status` query, the Events its
timeline warrants, and what a `kubectl scale` asks of the workflow. No I/O, no clock.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

from spotrain.workflows.contract import ScaleIn, ScaleOut
from spotrain.workflows.job.state import JobStatus, TimelineEntry

# Timeline entries whose Event is a Warning; every other entry is Normal.
WARNINGS = ("fault", "failed", "launch failed", "node gone", "reclaim", "scale out timed out")


class Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)


class NodeStatus(Camel):
    id: str | None = Field(None, description="the node's instance id (ScaleIn's workers)")
    slot: int
    rank: int | None = None
    lifecycle: str = Field(description="spot or on-demand")
    instance_type: str
    zone: str | None = None
    state: str = Field(description="requested, ready, gone or released")


class Condition(Camel):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str = ""


class TrainingJobStatus(Camel):
    """What `kubectl get -o yaml` shows: the workflow's `status` query, mirrored."""

    workflow_id: str | None = Field(None, description="the Temporal workflow behind the job")
    observed_generation: int | None = Field(
        None, description="the metadata.generation whose spec.replicas the workflow was given"
    )
    phase: str | None = Field(None, description="Pending, Running, Resizing, ..., Succeeded")
    generation: int | None = Field(None, description="the job's generation (membership)")
    replicas: int | None = Field(None, description="nodes in the running generation")
    target: int | None = Field(None, description="nodes the job aims to hold")
    nodes: list[NodeStatus] = Field(default_factory=list)
    steps: int | None = Field(None, description="steps done")
    steps_lost: int | None = Field(None, description="steps lost to reclaims and faults")
    reclaims: int | None = None
    cost: str | None = Field(None, description="USD so far")
    last_event: str | None = None
    message: str | None = None
    conditions: list[Condition] = Field(default_factory=list)


class ScaleStatus(Camel):
    """A ScaleIn's or ScaleOut's outcome."""

    phase: Literal["Pending", "Succeeded", "Failed"] | None = None
    message: str | None = None


def workflow_id(namespace: str, name: str, uid: str) -> str:
    """One resource, one workflow: a retried create finds the one it started."""
    return f"k8s/{namespace}/{name}/{uid}"


def job_name(name: str, uid: str) -> str:
    """The job's name as its pods and nodes are labelled: a DNS label of at most 50, unique
    across namespaces and re-creations by the uid. A resource's name may hold dots (a DNS
    subdomain): they become dashes, so `a.b` is a valid job, not Invalid for a pattern its
    author never wrote."""
    return f"{name[:41].replace('.', '-').rstrip('-')}-{uid.replace('-', '')[:8]}"


def job_input(resource: dict[str, Any]) -> dict[str, Any]:
    """The workflow's input: the resource's spec with its name, replicas as initial_nodes."""
    meta = resource["metadata"]
    spec = {k: v for k, v in resource["spec"].items() if k != "replicas"}
    spec["name"] = job_name(meta["name"], meta["uid"])
    if (replicas := resource["spec"].get("replicas")) is not None:
        spec["elastic"] = {**spec.get("elastic", {}), "initial_nodes": replicas}
    return spec


def invalid_message(refusal: str) -> str:
    """A job spec's refusal (`SpecError`'s text) in the resource's own terms: each field under
    `spec.`, and the replicas it gave where the job spec says initial_nodes."""
    head, *lines = refusal.replace("invalid job spec", "invalid TrainingJob spec").splitlines()
    said = [head]
    for line in lines:
        where, sep, why = line.strip().partition(": ")
        if sep:
            where = "spec" if where == "(spec)" else f"spec.{where}"
            line = f"  {where.replace('spec.elastic.initial_nodes', 'spec.replicas')}: {why}"
        said.append(re.sub(r"\binitial_nodes\b", "replicas", line))
    return "\n".join(said)


def scale_request(replicas: int, target: int) -> tuple[str, ScaleOut | ScaleIn] | None:
    """The update that moves the workflow's target to `replicas` (None: already there)."""
    if replicas > target:
        return "scale_out", ScaleOut(count=replicas - target)
    if replicas < target:
        return "scale_in", ScaleIn(count=target - replicas)
    return None


SPEC_IGNORED = (
    "the running job cannot apply this edit: only spec.replicas reaches it (kubectl scale); "
    "to change anything else, delete the TrainingJob and create it again"
)


def spec_applied(s: JobStatus, wanted: str | None) -> Condition:
    """Whether the job runs the resource's spec (`wanted`: its digest), less replicas: a spec
    edited after the start is stored by the API server, but the workflow keeps the one it got."""
    if wanted is None or s.spec_digest is None:
        return Condition(type="SpecApplied", status="Unknown", reason="NotCompared")
    if wanted == s.spec_digest:
        return Condition(type="SpecApplied", status="True", reason="Running")
    return Condition(type="SpecApplied", status="False", reason="Ignored", message=SPEC_IGNORED)


def mirror(
    s: JobStatus, workflow: str, observed: int | None, wanted: str | None = None
) -> TrainingJobStatus:
    """The resource's status from the workflow's `status` query (`wanted`: the digest of the
    resource's spec, compared with the one the job runs)."""
    last = s.timeline[-1] if s.timeline else None
    held = [n for n in s.nodes if n.state.is_alive]
    return TrainingJobStatus(
        workflow_id=workflow,
        observed_generation=observed,
        phase=s.phase.value,
        generation=s.generation,
        replicas=s.world_size,
        target=s.target_nodes,
        nodes=[
            NodeStatus(
                id=n.node_id,
                slot=n.slot,
                rank=n.rank,
                lifecycle=str(n.lifecycle),
                instance_type=n.instance_type,
                zone=n.zone,
                state=n.state.value,
            )
            for n in held
        ],
        steps=s.step,
        steps_lost=s.steps_lost,
        reclaims=s.reclaims,
        cost=f"{s.total_cost:.2f}",
        last_event=f"{last.event}: {last.detail}" if last and last.detail else last and last.event,
        message=s.failure,
        conditions=[
            Condition(
                type="Ready",
                status="True" if s.phase.value == "Running" else "False",
                reason=s.phase.value,
            ),
            Condition(
                type="NodesReleased",
                status="False" if held else "True",
                reason="Held" if held else "NoneHeld",
                message=f"{len(held)} node(s) held",
            ),
            spec_applied(s, wanted),
        ],
    )


def needs_release(s: JobStatus) -> bool:
    """The job's state says it is not over, or holds nodes: if its workflow has ended anyway
    (terminated, timed out), nothing but a ReleaseJob will release them."""
    return not s.phase.is_final or any(n.state.is_alive for n in s.nodes)


def ended_without_teardown(
    s: JobStatus, workflow: str, observed: int | None, how: str, released: list[str] | None
) -> TrainingJobStatus:
    """The resource's status when the workflow ended without its own teardown (`how`: its
    execution status, TERMINATED or TIMED_OUT): a terminal phase whatever the last query said,
    the nodes being released (`released` None) or released."""
    done = released is not None
    what = (
        f"released {len(released)} node(s) by their ownership labels or tags: "
        f"{', '.join(released) or 'none left'}"
        if released is not None
        else "releasing every node labelled or tagged with the job"
    )
    out = mirror(s, workflow, observed)
    return out.model_copy(
        update={
            "phase": "Failed",
            "replicas": 0,
            "nodes": [] if done else out.nodes,
            "message": f"the workflow ended ({how}) without the job's own teardown: {what}",
            "conditions": [
                Condition(type="Ready", status="False", reason="WorkflowEnded"),
                Condition(
                    type="NodesReleased",
                    status="True" if done else "False",
                    reason="Released" if done else "Releasing",
                    message=what,
                ),
            ],
        }
    )


class EventPlan(BaseModel):
    name: str
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


def event_plan(uid: str, entry: TimelineEntry) -> EventPlan:
    """The Kubernetes Event for one timeline entry. Its name is a digest of the resource and
    the entry, so a restarted operator that posts it again is refused (409), never doubled."""
    key = f"{uid}|{entry.time.isoformat()}|{entry.event}|{entry.detail}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    warn = any(entry.event.startswith(w) for w in WARNINGS)
    return EventPlan(
        name=f"spotrain.{uid[:8]}.{digest}",
        type="Warning" if warn else "Normal",
        reason="".join(w.capitalize() for w in entry.event.replace(":", " ").split())[:128],
        message=(entry.detail or entry.event)[:1024],
    )
