"""Turn the reclaim notices clouds send into the signal payloads the TrainingJob workflow takes.

Pure functions, no I/O: every input shape (the plain spotrain form, AWS EventBridge events
direct or wrapped in SNS, aws-node-termination-handler's webhook) is validated here and
normalised to a list of `ReclaimNotice`, `NodeLost` or `Ignored` (an AWS Health event can name
several instances). Errors name the offending field so a sender can fix its request (HTTP 400
for bytes that are not JSON, 422 for JSON of the wrong shape). Times are kept to a sane range,
so no input can overflow date arithmetic here or in the workflow.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
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


def _sane_time(value: datetime) -> datetime:
    """In UTC and between 1970 and 2999: a notice outside that is not a real one, and far
    calendar ends would overflow `time + 2 minutes` or the workflow's `deadline - now`."""
    try:
        utc = value.astimezone(UTC)
    except OverflowError:
        raise ValueError("time out of range") from None
    if not 1970 <= utc.year <= 2999:
        raise ValueError("time out of range (1970-2999)")
    return utc


Instant = Annotated[AwareDatetime, AfterValidator(_sane_time)]

SPOT_NOTICE = timedelta(minutes=2)  # AWS: the interruption warning comes 2 min before
INSTANCE_ID = re.compile(r"i-[0-9a-f]{8,17}")


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
    deadline: Instant | None = None
    kind: Literal["interruption", "rebalance", "scheduled"] = "interruption"
    lost: bool = False


def parse_reclaim(obj: Any) -> list[Outcome]:
    req = _validate(PlainReclaim, obj)
    if req.lost:
        return [NodeLost(node_id=req.instance_id, event_id=req.event_id)]
    return [
        ReclaimNotice(
            node_id=req.instance_id, deadline=req.deadline, event_id=req.event_id, kind=req.kind
        )
    ]


# --- AWS EventBridge (direct, SNS-wrapped, or from SQS): POST /v1/events/aws -----------------


class AwsEvent(BaseModel):
    id: EventId
    detail_type: str = Field(alias="detail-type")
    time: Instant
    detail: dict[str, Any]


class Ec2Detail(BaseModel):
    instance_id: NodeId = Field(alias="instance-id")
    state: str | None = None


class CapacityReservationDetail(Ec2Detail):
    termination_time: Instant | None = Field(None, alias="instance-termination-time")


class HealthDetail(BaseModel):
    service: str | None = None
    category: str | None = Field(None, alias="eventTypeCategory")
    entities: list[dict[str, Any]] = Field(default_factory=list, alias="affectedEntities")
    start: Any = Field(None, alias="startTime")


def health_start(value: Any) -> datetime | None:
    """A Health event's `startTime`, when the scheduled change begins: EventBridge writes it
    as RFC 1123 ("Sat, 05 Jun 2016 15:10:09 GMT"); ISO 8601 is read too. None when absent
    or unreadable (senders such as Karpenter's tests leave it out): the change is no less
    certain, only undated, so it is never a reason to refuse the event."""
    if not isinstance(value, str) or len(value) > 64:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            return None
    if when.tzinfo is None:
        return None
    try:
        return _sane_time(when)
    except ValueError:
        return None


# The states in which an instance can no longer run its rank: the set aws-node-termination-
# handler drains on and Karpenter acts on. A stopping instance is lost too: NTH's webhook
# cannot tell which state it saw, so both paths treat all four alike.
LOST_STATES = {"stopping", "stopped", "shutting-down", "terminated"}

SPOT_ITN = "EC2 Spot Instance Interruption Warning"
CAPACITY_RESERVATION_ITN = "EC2 Capacity Reservation Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
STATE_CHANGE = "EC2 Instance State-change Notification"
HEALTH = "AWS Health Event"

SNS_TYPES = ("Notification", "SubscriptionConfirmation", "UnsubscribeConfirmation")


def is_sns_envelope(obj: Any) -> bool:
    """A tuple, not a set: `Type` may be any JSON value, lists included."""
    return isinstance(obj, dict) and obj.get("Type") in SNS_TYPES


def health_event_id(event_id: str, instance_id: str) -> str:
    """One Health event may name several instances; each gets its own event id (a job owning
    two of them must get both), the same whichever path brought it."""
    return f"{event_id}/{instance_id}"


def parse_aws(obj: Any) -> list[Outcome]:
    """An EventBridge event, or an SNS notification whose Message is one. The event id is
    EventBridge's, so the same event arriving by two paths signals the same event id."""
    if is_sns_envelope(obj):
        if obj["Type"] != "Notification":
            return [Ignored(reason=f"SNS {obj['Type']}")]
        message = obj.get("Message")
        if not isinstance(message, str):
            raise SchemaError("Message", "SNS Message must be a string")
        try:
            obj = decode_json(message)
        except MalformedJSON:
            raise SchemaError("Message", "SNS Message is not JSON") from None
    event = _validate(AwsEvent, obj)
    kind = event.detail_type
    if kind == SPOT_ITN:  # sent two minutes before the instance is taken
        detail = _validate(Ec2Detail, event.detail)
        deadline = event.time + SPOT_NOTICE
        return [ReclaimNotice(node_id=detail.instance_id, deadline=deadline, event_id=event.id)]
    if kind == CAPACITY_RESERVATION_ITN:  # likewise, and it names the termination time
        cr = _validate(CapacityReservationDetail, event.detail)
        deadline = cr.termination_time or event.time + SPOT_NOTICE
        return [ReclaimNotice(node_id=cr.instance_id, deadline=deadline, event_id=event.id)]
    if kind == REBALANCE:
        detail = _validate(Ec2Detail, event.detail)
        return [_early_warning(detail.instance_id, event.id)]
    if kind == STATE_CHANGE:
        detail = _validate(Ec2Detail, event.detail)
        if detail.state in LOST_STATES:
            return [NodeLost(node_id=detail.instance_id, event_id=event.id)]
        return [Ignored(reason=f"instance state {detail.state!r}")]
    if kind == HEALTH:
        return _health(event)
    return [Ignored(reason="unknown detail-type")]


def _early_warning(node_id: str, event_id: str) -> ReclaimNotice:
    """Rebalance recommendations: no deadline (the instance is not being taken yet, and may
    never be); a job acts per `elastic.early_warning`."""
    return ReclaimNotice(node_id=node_id, event_id=event_id, kind="rebalance")


def _scheduled(node_id: str, event_id: str, start: datetime | None) -> ReclaimNotice:
    """A scheduled change (retirement, stop, reboot, maintenance): certain, due at its start
    (None: not given); an early warning a job acts on per `elastic.early_warning`, which
    make_before_break's rule weighs as certain."""
    return ReclaimNotice(node_id=node_id, event_id=event_id, deadline=start, kind="scheduled")


def _health(event: AwsEvent) -> list[Outcome]:
    """AWS Health scheduled changes for EC2 (retirement, stop, reboot, maintenance): a
    scheduled change for each affected instance, due at the event's `startTime`."""
    detail = _validate(HealthDetail, event.detail)
    if detail.service != "EC2" or detail.category != "scheduledChange":
        return [Ignored(reason="AWS Health event not an EC2 scheduled change")]
    ids = [e.get("entityValue") for e in detail.entities]
    instances = [i for i in ids if isinstance(i, str) and INSTANCE_ID.fullmatch(i)]
    if not instances:
        return [Ignored(reason="AWS Health event names no instance")]
    start = health_start(detail.start)
    return [_scheduled(i, health_event_id(event.id, i), start) for i in instances]


# --- aws-node-termination-handler: POST /v1/events/kubernetes ------------------------------

# NTH's `Kind`s. A scheduled event (IMDS) or AWS Health scheduled change (queue) is a
# scheduled change; ASG lifecycle hooks and the rest are not reclaims.
NTH_KINDS: dict[str, Literal["interruption", "rebalance", "scheduled", "lost"]] = {
    "SPOT_ITN": "interruption",
    "REBALANCE_RECOMMENDATION": "rebalance",
    "SCHEDULED_EVENT": "scheduled",
    "STATE_CHANGE": "lost",
}

# In queue mode NTH's event id is a prefix plus the hex of EventBridge's event id
# (`fmt.Sprintf("spot-itn-event-%x", event.ID)`): decoding it gives back EventBridge's id, so a
# notice that came through NTH and the same event sent to /v1/events/aws dedupe.
NTH_QUEUE_EVENT_ID = re.compile(
    r"(spot-itn-event|rebalance-recommendation-event|ec2-state-change-event"
    r"|aws-health-scheduled-change-event)-((?:[0-9a-f]{2})+)"
)
NTH_QUEUE_MONITOR = "SQS_MONITOR"


def _alias(*names: str) -> Any:
    return Field(None, validation_alias=AliasChoices(*names))


class KubeNotice(BaseModel):
    """snake_case fields, or the names of NTH's webhook template (`{{ .EventID }}` ...).

    NTH's `StartTime` means different things per monitor: in IMDS mode (SPOT_ITN_MONITOR) it
    is when the instance will be taken; in queue mode (SQS_MONITOR) it is when EventBridge sent
    the notice, two minutes before that. `deadline` (snake_case senders) is always the
    deadline.
    """

    event_id: EventId = Field(validation_alias=AliasChoices("event_id", "EventID"))
    kind: str = Field(validation_alias=AliasChoices("kind", "Kind"))
    monitor: str | None = _alias("monitor", "Monitor")
    instance_id: NodeId | None = _alias("instance_id", "InstanceID")
    provider_id: str | None = _alias("provider_id", "ProviderID")
    node_name: NodeId | None = _alias("node_name", "NodeName")
    deadline: Instant | None = None
    start_time: Instant | None = _alias("start_time", "StartTime")

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


def eventbridge_id(nth_event_id: str) -> str | None:
    """EventBridge's event id inside an NTH queue-mode event id, else None (IMDS mode: NTH's
    ids there are hashes of the metadata, with nothing to share with EventBridge)."""
    match = NTH_QUEUE_EVENT_ID.fullmatch(nth_event_id)
    if match is None:
        return None
    try:
        decoded = bytes.fromhex(match.group(2)).decode("utf-8")
    except UnicodeDecodeError:
        return None
    return decoded if 0 < len(decoded) <= 200 and decoded.isprintable() else None


def _deadline(notice: KubeNotice, from_queue: bool) -> datetime | None:
    if notice.deadline or notice.start_time is None:
        return notice.deadline
    return notice.start_time + SPOT_NOTICE if from_queue else notice.start_time


def parse_kubernetes(obj: Any) -> list[Outcome]:
    notice = _validate(KubeNotice, obj)
    action = NTH_KINDS.get(notice.kind)
    if action is None:
        return [Ignored(reason="unknown kind")]
    node_id = _node_id(notice)
    shared_id = eventbridge_id(notice.event_id)
    from_queue = shared_id is not None or notice.monitor == NTH_QUEUE_MONITOR
    event_id = shared_id or notice.event_id
    if notice.event_id.startswith("aws-health-scheduled-change-event-") and shared_id:
        event_id = health_event_id(shared_id, node_id)
    if action == "lost":
        return [NodeLost(node_id=node_id, event_id=event_id)]
    if action == "rebalance":
        return [_early_warning(node_id, event_id)]
    if action == "scheduled":  # IMDS: StartTime is the event's NotBefore; queue: NTH's now
        return [_scheduled(node_id, event_id, None if from_queue else notice.start_time)]
    deadline = _deadline(notice, from_queue)
    return [ReclaimNotice(node_id=node_id, deadline=deadline, event_id=event_id)]
