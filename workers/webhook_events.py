"""Turn the reclaim notices clouds send into the signal payloads the TrainingJob workflow takes.

Pure functions, no I/O: every input shape (the plain spotrain form, AWS EventBridge events
direct or wrapped in SNS, Kubernetes node-termination-handler / Karpenter notices) is
validated here and normalised to a `ReclaimNotice`, a `NodeLost` or an `Ignored`. Errors name
the offending field so a sender can fix its request (HTTP 400 for bytes that are not JSON, 422
for JSON of the wrong shape).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AliasChoices,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)

from spotrain.workflows.contract import NodeLost, ReclaimNotice

# Node ids go into a visibility query: a strict charset keeps quotes (injection) out.
NodeId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
EventId = Annotated[str, StringConstraints(min_length=1, max_length=256)]

M = TypeVar("M", bound=BaseModel)

SPOT_NOTICE = timedelta(minutes=2)  # AWS: the interruption warning comes 2 min before


class Ignored(BaseModel):
    """An event we understood but that asks nothing of a job (202, not an error)."""

    reason: str


Outcome = ReclaimNotice | NodeLost | Ignored


class MalformedJSON(ValueError):
    """The body is not JSON (HTTP 400)."""


class SchemaError(ValueError):
    """The JSON does not have the expected shape (HTTP 422); `field` names what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def outcome_kind(outcome: Outcome) -> str:
    """A small fixed label set for metrics (never a sender-chosen string)."""
    if isinstance(outcome, ReclaimNotice):
        return outcome.kind
    return "node_lost" if isinstance(outcome, NodeLost) else "ignored"


def decode_json(body: bytes | str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise MalformedJSON(str(e)) from None


def _validate(model: type[M], obj: Any) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(part) for part in first["loc"]) or "body"
        raise SchemaError(field, first["msg"]) from None


# --- the plain spotrain form: POST /v1/reclaims ----------------------------------------------


class PlainReclaim(BaseModel):
    """`lost: true` means there is no notice: the node is already gone (signal `node_lost`)."""

    model_config = ConfigDict(extra="forbid")

    instance_id: NodeId
    event_id: EventId
    deadline: AwareDatetime | None = None
    kind: Literal["interruption", "rebalance"] = "interruption"
    lost: bool = False


def parse_reclaim(obj: Any) -> Outcome:
    req = _validate(PlainReclaim, obj)
    if req.lost:
        return NodeLost(node_id=req.instance_id, event_id=req.event_id)
    return ReclaimNotice(
        node_id=req.instance_id, deadline=req.deadline, event_id=req.event_id, kind=req.kind
    )


# --- AWS EventBridge (direct, SNS-wrapped, or from SQS): POST /v1/events/aws -----------------


class AwsEvent(BaseModel):
    id: EventId
    detail_type: str = Field(alias="detail-type")
    time: AwareDatetime
    detail: dict[str, Any]


class Ec2Detail(BaseModel):
    instance_id: NodeId = Field(alias="instance-id")
    state: str | None = None


LOST_STATES = {"shutting-down", "terminated"}


SNS_TYPES = ("Notification", "SubscriptionConfirmation", "UnsubscribeConfirmation")


def is_sns_envelope(obj: Any) -> bool:
    """A tuple, not a set: `Type` may be any JSON value, lists included."""
    return isinstance(obj, dict) and obj.get("Type") in SNS_TYPES


def parse_aws(obj: Any) -> Outcome:
    """An EventBridge event, or an SNS notification whose Message is one. The event id is
    EventBridge's, so the same event arriving by two paths signals the same event id."""
    if is_sns_envelope(obj):
        if obj["Type"] != "Notification":
            return Ignored(reason=f"SNS {obj['Type']}")
        message = obj.get("Message")
        if not isinstance(message, str):
            raise SchemaError("Message", "SNS Message must be a string")
        try:
            obj = decode_json(message)
        except MalformedJSON:
            raise SchemaError("Message", "SNS Message is not JSON") from None
    event = _validate(AwsEvent, obj)
    if event.detail_type == "EC2 Spot Instance Interruption Warning":
        detail = _validate(Ec2Detail, event.detail)
        return ReclaimNotice(
            node_id=detail.instance_id, deadline=event.time + SPOT_NOTICE, event_id=event.id
        )
    if event.detail_type == "EC2 Instance Rebalance Recommendation":
        detail = _validate(Ec2Detail, event.detail)
        return ReclaimNotice(node_id=detail.instance_id, event_id=event.id, kind="rebalance")
    if event.detail_type == "EC2 Instance State-change Notification":
        detail = _validate(Ec2Detail, event.detail)
        if detail.state in LOST_STATES:
            return NodeLost(node_id=detail.instance_id, event_id=event.id)
        return Ignored(reason=f"instance state {detail.state!r}")
    return Ignored(reason="unknown detail-type")


# --- Kubernetes notices: POST /v1/events/kubernetes ------------------------------------------

# aws-node-termination-handler `Kind`s and Karpenter's interruption event reasons.
KUBE_KINDS: dict[str, Literal["interruption", "rebalance", "lost"]] = {
    "SPOT_ITN": "interruption",
    "SpotInterrupted": "interruption",
    "REBALANCE_RECOMMENDATION": "rebalance",
    "SpotRebalanceRecommendation": "rebalance",
    "STATE_CHANGE": "lost",
    "InstanceTerminating": "lost",
    "InstanceStopping": "lost",
}


def _alias(*names: str) -> Any:
    return Field(None, validation_alias=AliasChoices(*names))


class KubeNotice(BaseModel):
    """snake_case fields, or the names of NTH's webhook template (`{{ .EventID }}` ...)."""

    event_id: EventId = Field(validation_alias=AliasChoices("event_id", "EventID"))
    kind: str = Field(validation_alias=AliasChoices("kind", "Kind"))
    instance_id: NodeId | None = _alias("instance_id", "InstanceID")
    provider_id: str | None = _alias("provider_id", "ProviderID")
    node_name: NodeId | None = _alias("node_name", "NodeName")
    deadline: AwareDatetime | None = _alias("deadline", "StartTime")

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_absent(cls, value: Any) -> Any:
        """NTH's template renders missing values as empty strings."""
        return None if value == "" else value


class ProviderInstance(BaseModel):
    instance_id: NodeId


def _node_id(notice: KubeNotice) -> str:
    """instance id, else the last segment of the provider id (`aws:///us-east-1a/i-0abc`),
    else the node name (clusters that name nodes by instance id, spotrain's local nodes)."""
    if notice.instance_id:
        return notice.instance_id
    if notice.provider_id:
        last = notice.provider_id.rstrip("/").rsplit("/", 1)[-1]
        try:
            return ProviderInstance(instance_id=last).instance_id
        except ValidationError:
            raise SchemaError("provider_id", "no instance id in provider id") from None
    if notice.node_name:
        return notice.node_name
    raise SchemaError("instance_id", "one of instance_id, provider_id, node_name is required")


def parse_kubernetes(obj: Any) -> Outcome:
    notice = _validate(KubeNotice, obj)
    action = KUBE_KINDS.get(notice.kind)
    if action is None:
        return Ignored(reason="unknown kind")
    node_id = _node_id(notice)
    if action == "lost":
        return NodeLost(node_id=node_id, event_id=notice.event_id)
    return ReclaimNotice(
        node_id=node_id, deadline=notice.deadline, event_id=notice.event_id, kind=action
    )
