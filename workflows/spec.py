"""The job spec: the contract users write as YAML or JSON.

One pydantic model validates everything before a single node is ordered, with error messages
that name the offending field. The same JSON object is the `TrainingJob` workflow's input, so
`temporal workflow start --input-file job.json` and `spotrain submit job.yaml` agree.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from spotrain.workflows.planner import pack_gpus

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,48}[a-z0-9])?$"

PositiveSeconds = Annotated[float, Field(gt=0)]
NonNegativeSeconds = Annotated[float, Field(ge=0)]
WarningPolicy = Literal["ignore", "shrink", "make_before_break"]


class Strict(BaseModel):
    """Unknown fields are typos, not extensions: reject them."""

    model_config = ConfigDict(extra="forbid")


class InstanceType(Strict):
    name: str = Field(min_length=1, description="EC2 instance type, e.g. p3.2xlarge")
    gpus: int = Field(0, ge=0, description="GPUs on one node of this type")
    on_demand_price: float = Field(gt=0, description="USD per hour on demand")
    spot_price: float | None = Field(
        None,
        gt=0,
        description="USD per hour on spot, for cost accounting; None: the market price the "
        "provider reports for the node's pool when it is bought",
    )


class SpotPolicy(Strict):
    """Where spot nodes may come from and what they may cost."""

    instance_types: list[InstanceType] = Field(min_length=1)
    region: str = Field("us-east-1", description="home region: on-demand nodes are bought here")
    more_regions: list[str] = Field(
        default_factory=list,
        description="more regions whose spot pools may serve (the ranks' network must span them)",
    )
    zones: list[str] = Field(default_factory=list, description="empty: any zone of the regions")
    max_price: float | None = Field(None, gt=0, description="USD per hour; default on-demand")
    enabled: bool = Field(True, description="false: run on on-demand nodes only")

    @property
    def regions(self) -> list[str]:
        return [self.region, *self.more_regions]

    @model_validator(mode="after")
    def _check_regions(self) -> SpotPolicy:
        regions = self.regions
        repeated = sorted({r for r in regions if regions.count(r) > 1})
        if repeated:
            raise ValueError(f"more_regions repeats {', '.join(repeated)}")
        strays = [z for z in self.zones if not any(z.startswith(r) for r in regions)]
        if self.more_regions and strays:  # a zone's name is how its node finds its region
            raise ValueError(
                f"zones {strays} are in none of the regions {regions}: add their region to "
                "more_regions"
            )
        return self


class OnDemandPolicy(Strict):
    """When spot is short: whether to fall back to on-demand nodes, and how far."""

    fallback: bool = True
    max_nodes: int | None = Field(None, ge=0, description="cap on on-demand nodes; None: no cap")
    return_to_spot: bool = Field(True, description="swap fallback nodes back when spot returns")
    base_nodes: int = Field(0, ge=0, description="on-demand nodes never reclaimed (the base)")


class StragglerPolicy(Strict):
    """Ranks much slower than their own history and their peers, or hung while their peers
    step: flagged in `status`, then their node replaced (workflows/stragglers.py)."""

    slowdown: float = Field(
        2.0, gt=1, description="flag a rank whose recent steps take this many times longer"
    )
    patience_s: NonNegativeSeconds = Field(
        300, description="a rank flagged slow this long has its node replaced"
    )
    replace: bool = Field(True, description="false: only flag, never replace")


class ElasticPolicy(Strict):
    """Sizes the job may take and how fast it changes size."""

    min_nodes: int = Field(1, ge=1)
    max_nodes: int = Field(1, ge=1)
    initial_nodes: int | None = Field(None, ge=1, description="default: max_nodes")
    increment_step: int | None = Field(None, ge=1, description="sizes are min + k*step")
    discrete_sizes: list[int] | None = Field(None, min_length=1, description="e.g. [2, 4, 8]")
    graceful_shutdown_timeout_s: PositiveSeconds = 60
    scaling_timeout_s: NonNegativeSeconds = Field(30, description="debounce before growing")
    faulty_scale_down_timeout_s: NonNegativeSeconds = Field(
        120, description="after a fault, wait this long for a replacement before shrinking"
    )
    max_restarts: int = Field(5, ge=0, description="failed generations in a row before failing")
    max_launch_attempts: int = Field(
        20,
        ge=1,
        description="tries of one node's launch (errors other than no capacity: API limits, "
        "timeouts) before that node is given up; no capacity moves on to the next pool at once",
    )
    stall_timeout_s: PositiveSeconds = Field(600, description="no progress this long is a fault")
    straggler: StragglerPolicy | None = Field(
        None,
        description="detect slow and hung ranks (a rank with no step for stall_timeout_s while "
        "its peers step is hung) and replace their nodes; None: off",
    )
    reclaim_policy: Literal["drop", "replace"] = Field(
        "replace", description="drop the lost node, or order a replacement and grow back"
    )
    act_on_rebalance: bool = Field(
        False, description="treat an EC2 rebalance recommendation as a reclaim notice"
    )
    early_warning: WarningPolicy | None = Field(
        None,
        description="what an early warning (rebalance recommendation, scheduled retirement) "
        "does: ignore it, shrink as on a reclaim notice, or make_before_break (order a "
        "replacement at once, swap onto it in one resize when ready); None: shrink with "
        "act_on_rebalance, else ignore",
    )
    reclaim_notice: Literal["shrink", "make_before_break"] = Field(
        "shrink",
        description="on a reclaim notice: shrink at once (the replacement grows back later), "
        "or order the replacement first and swap onto it in one resize if it is ready before "
        "the deadline minus the checkpoint p99 (else shrink)",
    )
    max_surge_nodes: int = Field(
        0,
        ge=0,
        description="nodes a make-before-break replacement may hold beyond max_nodes while it "
        "overlaps the warned node (0: only below max_nodes); a pool's grant is never exceeded",
    )
    resize: Literal["restart", "live"] = Field(
        "restart",
        description="restart: every resize checkpoints and restarts every rank; live: surviving "
        "ranks re-form the process group in place and joiners get the state from them (the "
        "training code must follow spotrain.elastic.live; both runtimes)",
    )
    collective_timeout_s: PositiveSeconds = Field(
        30,
        description="how long a collective waits for a peer: a rank lost without notice is "
        "detected within it (passed to ranks as SPOTRAIN_COLLECTIVE_TIMEOUT_S)",
    )
    opportunistic: bool = Field(True, description="grow onto spare spot capacity up to max")
    progress_report_interval_s: PositiveSeconds = Field(
        30, description="how often running ranks' progress reaches the workflow"
    )
    capacity_check_interval_s: PositiveSeconds = Field(
        120, description="how often to look for spot capacity and reconcile node states"
    )

    @model_validator(mode="after")
    def _sizes(self) -> ElasticPolicy:
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) > max_nodes ({self.max_nodes})")
        if self.increment_step is not None and self.discrete_sizes is not None:
            raise ValueError("set increment_step or discrete_sizes, not both")
        if self.discrete_sizes is not None:
            bad = [s for s in self.discrete_sizes if not self.min_nodes <= s <= self.max_nodes]
            if bad:
                raise ValueError(
                    f"discrete_sizes {bad} outside [min_nodes, max_nodes] = "
                    f"[{self.min_nodes}, {self.max_nodes}]"
                )
        if self.act_on_rebalance and self.early_warning not in (None, "shrink"):
            raise ValueError(
                f"act_on_rebalance means early_warning: shrink, not {self.early_warning}: "
                "set only early_warning"
            )
        if self.reclaim_policy == "drop" and "make_before_break" in (
            self.warning_policy,
            self.reclaim_notice,
        ):
            raise ValueError(
                "make_before_break orders a replacement: it needs reclaim_policy: replace"
            )
        if self.initial_nodes is not None and not (
            self.min_nodes <= self.initial_nodes <= self.max_nodes
        ):
            raise ValueError(
                f"initial_nodes ({self.initial_nodes}) outside [min_nodes, max_nodes] = "
                f"[{self.min_nodes}, {self.max_nodes}]"
            )
        return self

    @property
    def warning_policy(self) -> WarningPolicy:
        """What an early warning does (`early_warning`, defaulting from `act_on_rebalance`)."""
        if self.early_warning is not None:
            return self.early_warning
        return "shrink" if self.act_on_rebalance else "ignore"


class DeadlinePolicy(Strict):
    """Finish by a time: spot while an on-demand finish stays safely possible, else on-demand
    (the policy and its figures: `workflows/deadline.py`)."""

    at: datetime | None = Field(None, description="finish by this time (ISO 8601, with zone)")
    max_duration_s: PositiveSeconds | None = Field(
        None, description="finish within this many seconds of submission"
    )
    margin_s: NonNegativeSeconds = Field(
        1800, description="slack kept in hand: below it, the job moves to on-demand"
    )
    hysteresis_s: NonNegativeSeconds = Field(
        3600, description="slack beyond the margin needed to go back to spot"
    )
    switch_s: NonNegativeSeconds = Field(
        600, description="how long a move to on-demand takes to train again (launch, load)"
    )
    steps_per_hour: float | None = Field(
        None, gt=0, description="expected rate at max_nodes, until the job has measured one"
    )

    @model_validator(mode="after")
    def _one_deadline(self) -> DeadlinePolicy:
        if (self.at is None) == (self.max_duration_s is None):
            raise ValueError("give exactly one of at (a time) or max_duration_s")
        if self.at is not None and self.at.tzinfo is None:
            raise ValueError(f"at {self.at.isoformat()} needs a time zone, e.g. 'Z' or '+00:00'")
        return self


class PoolMembership(Strict):
    """A shared capacity pool the job draws its nodes from (its quota, queue and budgets)."""

    name: str = Field(pattern=NAME_PATTERN, description="the pool (`spotrain pool create`)")
    team: str | None = Field(None, description="whose budget in the pool the job spends")
    preemptible: bool = Field(
        False,
        description="at its min, may be paused whole (after a checkpoint) for a job "
        "of higher priority",
    )


class JobSpec(Strict):
    """One training job. `name` is also its Temporal workflow id."""

    name: str = Field(pattern=NAME_PATTERN, description="DNS label: a-z, 0-9, '-'; max 50")
    type: Literal["pytorch", "horovod", "mpi", "command"] = Field(
        "pytorch", description="horovod, mpi: a launcher logs in to the workers over SSH"
    )
    image: str | None = Field(None, description="container image (Kubernetes runtime)")
    command: list[str] = Field(min_length=1, description="argv of each node's worker")
    env: dict[str, str] = Field(
        default_factory=dict, description="plain settings only: secrets belong in the runtime"
    )
    procs_per_node: int = Field(1, ge=1)
    gpus_per_node: int | None = Field(None, ge=0)
    total_gpus: int | None = Field(None, ge=1, description="packed onto instance shapes")
    total_steps: int = Field(gt=0, description="the job is done when this many steps are done")
    global_batch_size: int | None = Field(None, ge=1)
    scale_config: dict[int, dict[str, Any]] = Field(
        default_factory=dict, description="per-world-size overrides passed to ranks"
    )
    elastic: ElasticPolicy = Field(default_factory=ElasticPolicy)
    spot: SpotPolicy
    on_demand: OnDemandPolicy = Field(default_factory=OnDemandPolicy)
    checkpoint: str = Field(description="s3://bucket/prefix or file:///path")
    checkpoint_keep: int = Field(
        3, ge=1, description="complete checkpoints kept (the training library deletes older)"
    )
    cleanup: Literal["always", "keep_failed", "never"] = "keep_failed"
    priority: int = Field(0, description="higher runs first when capacity is short")
    pool: PoolMembership | None = Field(None, description="None: unconstrained by any pool")
    deadline: DeadlinePolicy | None = Field(None, description="None: no deadline, spot first")
    budget_usd: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="total spend cap in USD: reaching it pauses the job after a checkpoint "
        "(`spotrain budget` raises it); None: no cap",
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if not re.match(r"^(s3://[^/]+(/.*)?|file:///.+)$", self.checkpoint):
            raise ValueError(
                f"checkpoint {self.checkpoint!r} must be s3://bucket/prefix or file:///path"
            )
        if self.gpus_per_node is not None and self.total_gpus is not None:
            raise ValueError("set gpus_per_node or total_gpus, not both")
        shapes = [t.gpus for t in self.spot.instance_types]
        if self.gpus_per_node and max(shapes) < self.gpus_per_node:
            raise ValueError(
                f"gpus_per_node ({self.gpus_per_node}) exceeds every instance type's GPUs "
                f"({shapes})"
            )
        if self.total_gpus is not None:
            if max(shapes) == 0:
                raise ValueError("total_gpus needs instance types with GPUs")
            packed = [used for _, used in pack_gpus(self.total_gpus, shapes)]
            if self.elastic.max_nodes != len(packed):
                raise ValueError(
                    f"total_gpus {self.total_gpus} packs onto {len(packed)} node(s) using "
                    f"{' + '.join(map(str, packed))} GPUs: set elastic.max_nodes to {len(packed)}"
                )
        if self.on_demand.base_nodes > self.elastic.max_nodes:
            raise ValueError(
                f"on_demand.base_nodes ({self.on_demand.base_nodes}) > elastic.max_nodes "
                f"({self.elastic.max_nodes})"
            )
        if (
            self.on_demand.max_nodes is not None
            and self.on_demand.base_nodes > self.on_demand.max_nodes
        ):
            raise ValueError("on_demand.base_nodes exceeds on_demand.max_nodes")
        if not self.spot.enabled and not (self.on_demand.fallback or self.on_demand.base_nodes):
            raise ValueError("spot.enabled is false and on-demand fallback is off: no nodes")
        if self.pool and self.pool.preemptible and self.on_demand.base_nodes:
            raise ValueError(
                "pool.preemptible with on_demand.base_nodes: base nodes are never preempted"
            )
        max_world = self.elastic.max_nodes * self.procs_per_node
        if self.global_batch_size is not None and self.global_batch_size < max_world:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) is smaller than the largest "
                f"world size ({max_world}): some rank would get an empty batch"
            )
        return self

    def instance_type(self, name: str) -> InstanceType:
        for t in self.spot.instance_types:
            if t.name == name:
                return t
        raise KeyError(name)


class SpecError(ValueError):
    """A job spec that does not validate; the message lists every bad field."""


def describe_errors(err: ValidationError, what: str = "job spec") -> str:
    """Field-named, one line per problem: `elastic.min_nodes: ...`."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(spec)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def parse_spec(data: Any) -> JobSpec:
    """Validate a decoded YAML/JSON object; raise SpecError with every problem named."""
    if not isinstance(data, dict):
        raise SpecError(f"invalid job spec: expected a mapping, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe_errors(err)) from None
