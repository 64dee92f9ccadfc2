"""What the TrainingJob workflow and its activities exchange.

The workflow calls activities by name (the constants below); a worker registers one
implementation of each: EC2 or a simulated cloud for the node provider, local processes,
Kubernetes pods or a simulation for the rank runtime. Everything here is plain data, so it
is safe inside the workflow sandbox and survives the pydantic data converter.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from spotrain.workflows.job.checkpoints import CheckpointStats
from spotrain.workflows.policies.stragglers import RankSteps

Lifecycle = Literal["spot", "on-demand"]


class Message(BaseModel):
    """Payloads crossing the Temporal boundary: strict on input so typos fail loudly."""

    model_config = ConfigDict(extra="forbid")


# --- signal and update payloads (the public interface other tools use) -----------------------


class ReclaimNotice(Message):
    """Signal `reclaim`: the cloud will take `node_id` at `deadline` (None: now/unknown)."""

    node_id: str
    deadline: datetime | None = None
    event_id: str | None = None
    kind: Literal["interruption", "rebalance", "scheduled"] = Field(
        "interruption",
        description="rebalance: an early warning the job acts on only if its policy says so; "
        "scheduled: a change AWS scheduled for the instance (retirement, stop, reboot, "
        "maintenance), certain to come at `deadline` (its start time; None: not given), an "
        "early warning that make_before_break's rule takes as certain",
    )


class NodeLost(Message):
    """Signal `node_lost`: `node_id` is already gone (terminated, crashed, unreachable)."""

    node_id: str
    event_id: str | None = None


class ScaleOut(Message):
    """Add `count` nodes; with `timeout_s`, the update answers once they came or, if they did
    not in time, once the target went back."""

    count: int = Field(ge=1)
    timeout_s: float | None = Field(None, gt=0)


class ScaleIn(Message):
    """Remove `count` nodes (highest rank first) or exactly the named `node_ids`."""

    count: int | None = Field(None, ge=1)
    node_ids: list[str] | None = None


class Empty(Message):
    """Payload of `pause` and `resume`."""


class SetBudget(Message):
    """Update `set_budget`: the job's spend cap becomes `usd` (the validator says if not)."""

    usd: float


# --- capacity pools: what a job and its pool tell each other (signals both ways) ---------


class PoolReport(Message):
    """Signal `report` to a pool: the job's claim and where it stands. The whole picture every
    time, so the latest report wins and a repeated one does no harm."""

    job: str
    seq: int = Field(description="the job's report counter: older reports are ignored")
    claiming: bool = Field(description="False: the job left (ended or paused), holds nothing")
    priority: int
    team: str | None = None
    preemptible: bool = False
    min_nodes: int
    max_nodes: int
    gpus_per_node: int = 0
    spot_price: float
    on_demand_price: float
    min_on_demand: int = Field(0, description="on-demand nodes it cannot run without")
    max_on_demand: int = Field(0, description="on-demand nodes it may use at most")
    all_on_demand: bool = False
    progress: float = 0.0
    holding: int = 0
    holding_on_demand: int = 0
    allowance: int = Field(0, description="the grant it acts on")
    allowance_on_demand: int = 0
    grant_seq: int = Field(0, description="the last grant it applied")


class PoolGrant(Message):
    """Signal `grant` to a job: how many nodes, and of them on-demand, it may hold now."""

    seq: int
    nodes: int
    on_demand: int
    refused: str | None = Field(None, description="the job can never fit in the pool: why")


# --- node provider ---------------------------------------------------------------------------


class Offer(Message):
    """A (type, zone) spot pool that can serve now, and what it costs."""

    instance_type: str
    zone: str
    price: float
    score: float | None = Field(None, description="spot placement score when the API has one")
    capacity: int | None = Field(
        None,
        description="how many more nodes the pool can give now, where the provider says (the "
        "simulated cloud, from its trace); None: unknown (EC2, Karpenter)",
    )


class Regional(Message):
    """A provider call that may span the job's regions: the home `region` (where on-demand
    nodes are bought) and the `more_regions` its spot pools may also come from."""

    region: str = "us-east-1"
    more_regions: list[str] = Field(default_factory=list)

    @property
    def regions(self) -> list[str]:
        return [self.region, *self.more_regions]

    def region_of(self, zone: str | None) -> str:
        """The region a zone belongs to (zone names start with their region's:
        us-west-2b, us-west-2-lax-1a); the home region for no zone or an unknown one."""
        owners = [r for r in self.regions if zone and zone.startswith(r)]
        return max(owners, key=len, default=self.region)


class LaunchRequest(Regional):
    """One node for one slot. (job, slot, attempt) makes the launch idempotent."""

    job: str
    slot: int
    attempt: int
    generation: int
    lifecycle: Lifecycle
    instance_type: str
    zone: str | None = None
    max_price: float | None = None
    gpus: int = Field(0, description="GPUs the node must have (a NodeClaim requests them)")
    fallback_pools: list[tuple[str, str]] = Field(
        default_factory=list,
        description="other (type, zone) spot pools that would do, best first: a provider that "
        "launches through EC2 Fleet lets EC2 choose among all of them in one call",
    )
    placement_group: bool = Field(
        False,
        description="launch into the job's cluster placement group in `zone` (the spec's "
        "placement_group; EC2 only); False in histories from before the field",
    )


class NodeInfo(Message):
    """A node as the provider sees it."""

    node_id: str
    slot: int
    lifecycle: Lifecycle
    instance_type: str
    zone: str
    state: Literal["requested", "ready", "gone"]
    reason: str | None = Field(None, description="why gone: 'reclaimed', 'terminated', ...")
    address: str = Field("127.0.0.1", description="where its workers are reachable")


class DescribeRequest(Regional):
    job: str
    node_ids: list[str]

    def answer(self, found: dict[str, NodeInfo]) -> list[NodeInfo]:
        """A provider's reply from the nodes it found for the job (by id): one per asked id,
        in order, an id it does not list being gone ("not-found", placeholder slot, type and
        zone); no ids asked: every node found (what a failed launch left behind)."""
        if not self.node_ids:
            return list(found.values())
        return [
            found.get(node_id)
            or NodeInfo(
                node_id=node_id,
                slot=-1,
                lifecycle="on-demand",
                instance_type="unknown",
                zone="unknown",
                state="gone",
                reason="not-found",
            )
            for node_id in self.node_ids
        ]


class ReleaseRequest(Regional):
    job: str
    node_ids: list[str]
    everything: bool = Field(
        False,
        description="every node the provider finds labelled or tagged with the job, listed or "
        "not: for a job whose workflow ended without its own cleanup (ReleaseJob)",
    )

    def asks_for(self, node_id: str) -> bool:
        return self.everything or node_id in self.node_ids


class ReleaseJobRequest(Regional):
    """ReleaseJob's input: the job, its regions, and whether its runtime keeps failed pods."""

    job: str
    keep: bool = False


# --- rank runtime --------------------------------------------------------------------------


class Member(Message):
    """One node of a generation, in rank order."""

    node_id: str
    address: str
    procs: int = 1


class GenerationPlan(Message):
    """A fixed membership: everything a runtime needs to start (or find) its workers."""

    job: str
    generation: int
    members: list[Member]
    command: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    image: str | None = None
    job_type: str = "pytorch"
    checkpoint: str
    checkpoint_keep: int = 3
    scale_config: dict[str, Any] = Field(default_factory=dict)
    global_batch_size: int | None = None
    total_steps: int
    gpus_per_proc: int = 0
    graceful_shutdown_s: float | None = Field(
        None, description="the spec's graceful timeout: a pod's terminationGracePeriodSeconds"
    )
    resize: Literal["restart", "live"] = Field(
        "restart", description="live: adopt the previous generation's parked ranks"
    )
    collective_timeout_s: float = 30.0
    peer_copy: bool = Field(
        False, description="live: each node keeps its ring neighbour's shards in memory"
    )

    @property
    def world_size(self) -> int:
        return sum(m.procs for m in self.members)


class StopRequest(Message):
    """Stop a generation. `graceful`: raise the elastic event and wait for acks first."""

    job: str
    generation: int
    world_size: int
    checkpoint: str
    graceful: bool
    grace_s: float
    lost_node_ids: list[str] = Field(default_factory=list)
    notice_at: datetime | None = Field(
        None, description="when the workflow acted on the reclaim notice behind this stop"
    )
    live: bool = Field(
        False, description="live resize: ranks that ack stay alive (parked) for the next generation"
    )


class StopResult(Message):
    acked_ranks: list[int]
    checkpoint_step: int | None = Field(None, description="latest complete checkpoint")
    forced: bool = Field(False, description="some rank had to be killed")
    step: int | None = Field(
        None,
        description="the step the ranks had reached when they stopped (what they redo "
        "from the checkpoint), if the runtime knows it",
    )
    held_step: int | None = Field(
        None, description="live resize: the step the parked ranks hold in memory (resume there)"
    )
    done: bool = Field(
        False, description="the ranks had finished the job (its completion marker) as they stopped"
    )


class WatchRequest(Message):
    job: str
    generation: int
    world_size: int
    checkpoint: str
    report_after_s: float = Field(description="return with progress at least this often")
    known_events: list[str] = Field(
        default_factory=list, description="event ids the workflow has: no early return for them"
    )


class WatchResult(Message):
    """Why a watch returned: it is time to report progress, every rank exited 0 after the
    completion marker (`completed`), or some rank exited otherwise or vanished (`failed`)."""

    outcome: Literal["progress", "completed", "failed"]
    step: int | None = None
    checkpoint_step: int | None = None
    exit_codes: dict[int, int] = Field(default_factory=dict, description="rank -> code")
    detail: str = ""
    notices: list[ReclaimNotice] = Field(
        default_factory=list, description="reclaim notices ranks found (EC2 metadata)"
    )
    checkpoints: CheckpointStats | None = None
    stepped: bool | None = Field(
        None, description="a failed generation reported a step (None: the runtime cannot tell)"
    )
    output: dict[int, str] = Field(
        default_factory=dict, description="rank -> the last lines a failed rank wrote"
    )
    ranks: list[RankSteps] = Field(
        default_factory=list, description="every rank's step times (straggler detection)"
    )


class CleanupRequest(Message):
    job: str
    keep: bool = Field(False, description="keep pods/logs for debugging (failed jobs)")


# --- activity names: one obvious place ------------------------------------------------------

FIND_OFFERS = "find_offers"
LAUNCH_NODE = "launch_node"
DESCRIBE_NODES = "describe_nodes"
RELEASE_NODES = "release_nodes"
START_GENERATION = "start_generation"
PREPARE_GENERATION = "prepare_generation"
STOP_GENERATION = "stop_generation"
WATCH_GENERATION = "watch_generation"
CLEANUP_JOB = "cleanup_job"
CHECK_CHECKPOINT = "check_checkpoint"

# Typed, non-retryable errors activities raise and the workflow acts on.
CAPACITY_ERROR = "CapacityError"  # this pool cannot serve now: try the next, then on-demand
CONFIG_ERROR = "ConfigError"  # bad credentials, unknown instance type: fail the job clearly
NON_RETRYABLE_ERRORS = (CAPACITY_ERROR, CONFIG_ERROR)
