"""The job spec: the contract users write as YAML or JSON.

One pydantic model validates everything before a single node is ordered, with error messages
that name the offending field. The same JSON object is the `TrainingJob` workflow's input, so
`temporal workflow start --input-file job.json` and `spotrain submit job.yaml` agree.

Every number is finite and bounded (the `MAX_*` and `MIN_*` below, documented in the README):
an infinite grace period or a 1e308 s interval overflows the workflow's timers or never lets
a wait end, a 1e-300 s interval spins it, and a huge node or GPU count makes planning, whose
cost grows with the square of the nodes, too slow for a workflow task.
"""

from __future__ import annotations

import hashlib
import math
import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from spotrain.workflows.json_values import (
    MAX_SCALE_CONFIG_DEPTH,
    MAX_SCALE_CONFIG_VALUES,
    json_problem,
)

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,48}[a-z0-9])?$"

MAX_DURATION_S = 30 * 86_400  # timeouts, grace periods, deadlines, slack: 30 days
LATEST_DEADLINE = datetime(2100, 1, 1, tzinfo=UTC)  # a fixed bound: specs parse in workflows
MIN_INTERVAL_S = 0.1  # the workflow's shortest timer: a shorter interval only spins it
MAX_INTERVAL_S = 86_400  # progress reports and capacity checks: at least daily
MAX_NODES = 1_000  # ordering 1,000 nodes takes ~0.2 s of a workflow task (quadratic)
MAX_GPUS_PER_NODE = 64
MAX_PROCS_PER_NODE = 256
MAX_TOTAL_GPUS = MAX_NODES * MAX_GPUS_PER_NODE
MAX_WORLD = MAX_NODES * MAX_PROCS_PER_NODE  # scale_config's keys
MAX_STEPS = 10**12  # total_steps, steps_per_hour: exact in a JSON double
MAX_BATCH = 10**9
MAX_PRICE_USD_H = 10_000  # per node
MAX_BUDGET_USD = 10**9
MAX_TRIES = 1_000  # restarts, launch attempts, checkpoints kept
MAX_PRIORITY = 10**6
MAX_SLOWDOWN = 1_000
MAX_LISTED = 100  # instance types, zones, regions, discrete sizes
# Sizes: the spec is the workflow's input and travels inside its state at every
# continue-as-new, where Temporal fails a task whose payload passes 2 MB (a 1 MB command wedged
# a job with its nodes held). The whole spec's JSON stays far below that.
MAX_SPEC_BYTES = 64 * 1024
MAX_ARGS = 1_000  # command's arguments, env's entries
MAX_ARG_CHARS = 16 * 1024  # one argument or env value
MAX_NAME_CHARS = 253  # instance types, regions, zones, teams, env names (a DNS name's length)
MAX_URL_CHARS = 2_048  # image, checkpoint
MAX_GRADIENT_BYTES = 10**15  # a quadrillion: 250 trillion fp32 parameters


def figure(x: float) -> str:
    """A bound as people read it: 2,592,000, 0.1, 1e+12."""
    return f"{x:,.0f}" if float(x).is_integer() and abs(x) < 1e13 else f"{x:g}"


def bounded(kind: type[int] | type[float], low: float, high: float, *, above: bool = False) -> Any:
    """An int or float, finite, in [low, high] (`above`: low itself excluded), as an annotated
    type. Pydantic's own refusal of inf or NaN ("Input should be a finite number") and of a
    float too big for an int names no bound: this check runs first and names it."""
    span = f"{'>' if above else '>='} {figure(low)} and <= {figure(high)}"

    def check(value: Any) -> Any:
        number = value
        if isinstance(value, str):  # pydantic reads "1e400" as inf
            try:
                number = float(value)
            except ValueError:
                return value
        if isinstance(number, float) and (
            not math.isfinite(number) or (kind is int and not low <= number <= high)
        ):
            raise PydanticCustomError(
                "bounded", "must be a finite number {span}, got {got}", {"span": span, "got": value}
            )
        return value

    floor = {"gt": low} if above else {"ge": low}
    # Field first: constraints placed after a validator would not reach the JSON schema.
    # Strict as the TrainingJob CRD is: "1000" or true is no count (a float field takes an int).
    field = Field(le=high, allow_inf_nan=False, strict=True, **floor)
    return Annotated[kind, field, BeforeValidator(check)]


Seconds = bounded(float, 0, MAX_DURATION_S)
PositiveSeconds = bounded(float, 0, MAX_DURATION_S, above=True)
Interval = bounded(float, MIN_INTERVAL_S, MAX_INTERVAL_S)
Price = bounded(float, 0, MAX_PRICE_USD_H, above=True)
Nodes = bounded(int, 1, MAX_NODES)
NodesOrNone = bounded(int, 0, MAX_NODES)  # a count that may be zero
Tries = bounded(int, 1, MAX_TRIES)
WorldSizeKey = Annotated[int, Field(ge=1, le=MAX_WORLD)]  # (lax: JSON's keys are text)
WarningPolicy = Literal["ignore", "shrink", "make_before_break"]
Placement = Literal["zone", "region", "any"]  # (workflows/policies/locality.py)
Label = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
Arg = Annotated[str, Field(max_length=MAX_ARG_CHARS)]


class Strict(BaseModel):
    """Unknown fields are typos, not extensions: reject them."""

    model_config = ConfigDict(extra="forbid")


class InstanceType(Strict):
    name: Label = Field(description="EC2 instance type, e.g. p3.2xlarge")
    gpus: bounded(int, 0, MAX_GPUS_PER_NODE) = Field(0, description="GPUs on one node of this type")
    on_demand_price: Price = Field(description="USD per hour on demand")
    spot_price: Price | None = Field(
        None,
        description="USD per hour on spot, for cost accounting; None: the market price the "
        "provider reports for the node's pool when it is bought",
    )


class SpotPolicy(Strict):
    """Where spot nodes may come from and what they may cost."""

    instance_types: list[InstanceType] = Field(
        min_length=1, max_length=MAX_LISTED, description="the node shapes the job may buy"
    )
    region: Label = Field("us-east-1", description="home region: on-demand nodes are bought here")
    more_regions: list[Label] = Field(
        default_factory=list,
        max_length=MAX_LISTED,
        description="more regions whose spot pools may serve (the ranks' network must span them)",
    )
    zones: list[Label] = Field(
        default_factory=list, max_length=MAX_LISTED, description="empty: any zone of the regions"
    )
    max_price: Price | None = Field(None, description="USD per hour; default on-demand")
    enabled: StrictBool = Field(True, description="false: run on on-demand nodes only")

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

    fallback: StrictBool = Field(True, description="buy on-demand nodes when spot is short")
    max_nodes: NodesOrNone | None = Field(None, description="cap on on-demand nodes; None: no cap")
    return_to_spot: StrictBool = Field(
        True, description="swap fallback nodes back when spot returns"
    )
    base_nodes: NodesOrNone = Field(0, description="on-demand nodes never reclaimed (the base)")


class StragglerPolicy(Strict):
    """Ranks much slower than their own history and their peers, or hung while their peers
    step: flagged in `status`, then their node replaced (workflows/policies/stragglers.py)."""

    slowdown: bounded(float, 1, MAX_SLOWDOWN, above=True) = Field(
        2.0, description="flag a rank whose recent steps take this many times longer"
    )
    patience_s: Seconds = Field(
        300, description="a rank flagged slow this long has its node replaced"
    )
    replace: StrictBool = Field(True, description="false: only flag, never replace")


class ElasticPolicy(Strict):
    """Sizes the job may take and how fast it changes size."""

    min_nodes: Nodes = Field(1, description="the job trains on no fewer nodes")
    max_nodes: Nodes = Field(1, description="the job grows to no more nodes")
    initial_nodes: Nodes | None = Field(None, description="default: max_nodes")
    increment_step: Nodes | None = Field(None, description="sizes are min + k*step")
    discrete_sizes: list[Nodes] | None = Field(
        None, min_length=1, max_length=MAX_LISTED, description="e.g. [2, 4, 8]"
    )
    graceful_shutdown_timeout_s: PositiveSeconds = Field(
        60, description="time ranks get to checkpoint and ack on a notice (capped by its deadline)"
    )
    scaling_timeout_s: Seconds = Field(30, description="debounce before growing")
    faulty_scale_down_timeout_s: Seconds = Field(
        120, description="after a fault, wait this long for a replacement before shrinking"
    )
    max_restarts: bounded(int, 0, MAX_TRIES) = Field(
        5, description="failed generations in a row before failing"
    )
    max_launch_attempts: Tries = Field(
        20,
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
    act_on_rebalance: StrictBool = Field(
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
    max_surge_nodes: NodesOrNone = Field(
        0,
        description="nodes a make-before-break replacement may hold beyond max_nodes while it "
        "overlaps the warned node (0: only below max_nodes); a pool's grant is never exceeded",
    )
    warning_rule: Literal["expected_gain", "always"] = Field(
        "expected_gain",
        description="make_before_break on an early warning: act only when the expected gain "
        "(warning_reclaim_probability x the resize it avoids) beats the surge cost (the "
        "replacement's boot and the swap, paid whether or not the reclaim comes), or always "
        "(docs/make-before-break-rule.md)",
    )
    warning_reclaim_probability: bounded(float, 0, 1) = Field(
        0.5,
        description="the share of early warnings followed by a reclaim within 8 h 42 min, as "
        "the rule's prior (default: a published sample, 15 of 30 rebalance recommendations)",
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
    peer_copy: StrictBool = Field(
        False,
        description="live resize of a model sharded over every rank (pure FSDP, no replica): "
        "each node keeps an in-memory copy of its ring neighbour's shards and steps it with the "
        "neighbour's gradients, so a node lost without notice (or leaving on a notice) costs at "
        "most the step in flight, not a return to the last checkpoint; costs as much memory "
        "again as a rank's own shards, optimizer state and gradients, and one gradient shard "
        "sent per step (docs/sharded.md)",
    )
    opportunistic: StrictBool = Field(True, description="grow onto spare spot capacity up to max")
    progress_report_interval_s: Interval = Field(
        30, description="how often running ranks' progress reaches the workflow"
    )
    capacity_check_interval_s: Interval = Field(
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
        if self.peer_copy and self.resize != "live":
            raise ValueError("peer_copy keeps shards in memory for live resize: set resize: live")
        if self.initial_nodes is not None and not (
            self.min_nodes <= self.initial_nodes <= self.max_nodes
        ):
            raise ValueError(
                f"initial_nodes ({self.initial_nodes}) outside [min_nodes, max_nodes] = "
                f"[{self.min_nodes}, {self.max_nodes}]"
            )
        if self.initial_nodes is not None:  # (else the job aims at a size it never runs at)
            step = self.increment_step or 1
            if self.discrete_sizes is not None and self.initial_nodes not in self.discrete_sizes:
                sizes = ", ".join(map(str, sorted(set(self.discrete_sizes))))
                raise ValueError(
                    f"initial_nodes ({self.initial_nodes}) is not one of discrete_sizes ({sizes})"
                )
            if (self.initial_nodes - self.min_nodes) % step:
                raise ValueError(
                    f"initial_nodes ({self.initial_nodes}) is not min_nodes + k * increment_step "
                    f"({self.min_nodes} + k * {step})"
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
    (the policy and its figures: `workflows/policies/deadline.py`)."""

    at: datetime | None = Field(None, description="finish by this time (ISO 8601, with zone)")
    max_duration_s: PositiveSeconds | None = Field(
        None, description="finish within this many seconds of submission"
    )
    margin_s: Seconds = Field(
        1800, description="slack kept in hand: below it, the job moves to on-demand"
    )
    hysteresis_s: Seconds = Field(
        3600, description="slack beyond the margin needed to go back to spot"
    )
    switch_s: Seconds = Field(
        600, description="how long a move to on-demand takes to train again (launch, load)"
    )
    steps_per_hour: bounded(float, 0, MAX_STEPS, above=True) | None = Field(
        None, description="expected rate at max_nodes, until the job has measured one"
    )

    @model_validator(mode="after")
    def _one_deadline(self) -> DeadlinePolicy:
        if (self.at is None) == (self.max_duration_s is None):
            raise ValueError("give exactly one of at (a time) or max_duration_s")
        if self.at is not None and self.at.tzinfo is None:
            raise ValueError(f"at {self.at.isoformat()} needs a time zone, e.g. 'Z' or '+00:00'")
        if self.at is not None and self.at >= LATEST_DEADLINE:  # (year 9999 overflows sums)
            raise ValueError(f"at {self.at.isoformat()} is not before {LATEST_DEADLINE:%Y-%m-%d}")
        return self


class PoolMembership(Strict):
    """A shared capacity pool the job draws its nodes from (its quota, queue and budgets)."""

    name: str = Field(pattern=NAME_PATTERN, description="the pool (`spotrain pool create`)")
    team: Label | None = Field(None, description="whose budget in the pool the job spends")
    preemptible: StrictBool = Field(
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
    image: str | None = Field(
        None, max_length=MAX_URL_CHARS, description="container image (Kubernetes runtime)"
    )
    command: list[Arg] = Field(
        min_length=1, max_length=MAX_ARGS, description="argv of each node's worker"
    )
    env: dict[str, Arg] = Field(
        default_factory=dict,
        max_length=MAX_ARGS,
        description="plain settings only: secrets belong in the runtime",
    )
    procs_per_node: bounded(int, 1, MAX_PROCS_PER_NODE) = Field(
        1, description="rank processes on each node"
    )
    gpus_per_node: bounded(int, 0, MAX_GPUS_PER_NODE) | None = Field(
        None, description="GPUs each node must have (one rank per GPU)"
    )
    total_gpus: bounded(int, 1, MAX_TOTAL_GPUS) | None = Field(
        None, description="packed onto instance shapes"
    )
    total_steps: bounded(int, 0, MAX_STEPS, above=True) = Field(
        description="the job is done when this many steps are done"
    )
    global_batch_size: bounded(int, 1, MAX_BATCH) | None = Field(
        None, description="split over the ranks, unevenly when the world size does not divide it"
    )
    scale_config: dict[WorldSizeKey, dict[str, Any]] = Field(
        default_factory=dict,
        max_length=MAX_LISTED,
        description="per-world-size overrides passed to ranks (keys: world sizes 1 to "
        f"{MAX_WORLD:,}; JSON values: finite numbers, "
        f"nested at most {MAX_SCALE_CONFIG_DEPTH} deep, {MAX_SCALE_CONFIG_VALUES:,} in all)",
    )
    elastic: ElasticPolicy = Field(default_factory=ElasticPolicy)
    spot: SpotPolicy
    on_demand: OnDemandPolicy = Field(default_factory=OnDemandPolicy)
    checkpoint: str = Field(
        max_length=MAX_URL_CHARS, description="s3://bucket/prefix or file:///path"
    )
    checkpoint_keep: Tries = Field(
        3, description="complete checkpoints kept (the training library deletes older)"
    )
    cleanup: Literal["always", "keep_failed", "never"] = Field(
        "keep_failed",
        description="what the runtime keeps at the end (pods, logs): a failed job's, all, none",
    )
    priority: bounded(int, -MAX_PRIORITY, MAX_PRIORITY) = Field(
        0, description="higher runs first when capacity is short"
    )
    pool: PoolMembership | None = Field(None, description="None: unconstrained by any pool")
    deadline: DeadlinePolicy | None = Field(None, description="None: no deadline, spot first")
    budget_usd: bounded(float, 0, MAX_BUDGET_USD, above=True) | None = Field(
        None,
        description="total spend cap in USD: reaching it pauses the job after a checkpoint "
        "(`spotrain budget` raises it); None: no cap",
    )
    placement: Placement = Field(
        "zone",
        description="zone: every node in one zone (hopping to another when its own has no "
        "spot); region: one region, any zones; any: wherever spot is best, each step's "
        "all-reduce billed where it crosses zones (docs/guides/placement.md)",
    )
    placement_group: StrictBool = Field(
        False,
        description="with placement: zone, on EC2: the nodes in one cluster placement group "
        "(lower latency, more bandwidth between them; capacity errors more often)",
    )
    gradient_bytes: bounded(int, 1, MAX_GRADIENT_BYTES) | None = Field(
        None,
        description="bytes one step all-reduces (4 x parameters in fp32): prices the traffic "
        "of a ring across zones; None: not counted",
    )

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if not re.match(r"^(s3://[^/]+(/.*)?|file:///.+)$", self.checkpoint):
            raise ValueError(
                f"checkpoint {self.checkpoint!r} must be s3://bucket/prefix or file:///path"
            )
        if self.gpus_per_node is not None and self.total_gpus is not None:
            raise ValueError("set gpus_per_node or total_gpus, not both")
        if self.placement_group and self.placement != "zone":
            why = "a cluster placement group is one zone's"  # (and a rule in the CRD)
            raise ValueError(f"placement_group needs placement: zone ({why}), not {self.placement}")
        shapes = [t.gpus for t in self.spot.instance_types]
        if self.gpus_per_node and max(shapes) < self.gpus_per_node:
            raise ValueError(
                f"gpus_per_node ({self.gpus_per_node}) exceeds every instance type's GPUs "
                f"({shapes})"
            )
        if self.total_gpus is not None:
            self._check_packing(max(shapes))
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

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not 0 < len(name) <= MAX_NAME_CHARS or "=" in name:
                raise ValueError(
                    f"name {name[:40]!r} must be 1 to {MAX_NAME_CHARS} characters, without '='"
                )
        return value

    @model_validator(mode="after")
    def _fits_a_payload(self) -> JobSpec:
        size = len(self.model_dump_json())
        if size > MAX_SPEC_BYTES:
            raise ValueError(
                f"the spec is {size:,} bytes as JSON, over {MAX_SPEC_BYTES:,}: it travels in "
                "the job's every workflow payload; pass large inputs in a file the command reads"
            )
        return self

    @field_validator("scale_config")
    @classmethod
    def _json_values(cls, value: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        if problem := json_problem(value):
            raise ValueError(problem)
        return value

    def _check_packing(self, largest: int) -> None:
        """`planner.pack_gpus`'s node count, by arithmetic: packing a refused total (2e6
        GPUs) node by node, or listing its shares in the message, would cost as much as it."""
        total = self.total_gpus or 0
        if largest == 0:
            raise ValueError("total_gpus needs instance types with GPUs")
        full, rest = divmod(total, largest)
        count = full + (1 if rest else 0)
        if count > MAX_NODES:
            raise ValueError(
                f"total_gpus {total} needs {count:,} nodes of {largest} GPUs: a job holds at "
                f"most {MAX_NODES:,} nodes"
            )
        if self.elastic.max_nodes != count:
            shares = [f"{full} x {largest}" if full > 1 else str(largest)] if full else []
            shares += [str(rest)] if rest else []
            raise ValueError(
                f"total_gpus {total} packs onto {count} node(s) using {' + '.join(shares)} "
                f"GPUs: set elastic.max_nodes to {count}"
            )

    def instance_type(self, name: str) -> InstanceType:
        for t in self.spot.instance_types:
            if t.name == name:
                return t
        raise KeyError(name)


def digest(spec: JobSpec) -> str:
    """What names a spec's content, less `elastic.initial_nodes` (the first size only: a
    running job's target moves by scaling, not by it). The operator compares a TrainingJob's
    spec with the one its workflow runs by it: an edit the job cannot apply is never silent."""
    body = spec.model_dump_json(exclude={"elastic": {"initial_nodes"}})
    return hashlib.sha256(body.encode()).hexdigest()[:16]


class SpecError(ValueError):
    """A job spec that does not validate; the message lists every bad field."""


def describe_errors(err: ValidationError, what: str = "job spec", most: int = 20) -> str:
    """Field-named, one line per problem: `elastic.min_nodes: ...`; at most `most` lines, so
    that a spec of 10,000 unknown keys gets a short answer."""
    errors = err.errors(include_input=False, include_url=False)
    lines = []
    for e in errors[:most]:
        where = ".".join(str(p)[:40] for p in e["loc"]) or "(spec)"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}".replace("\r", "\\r").replace("\n", "\\n"))
    if len(errors) > most:
        lines.append(f"... and {len(errors) - most} more")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def parse_spec(data: Any) -> JobSpec:
    """Validate a decoded YAML/JSON object; raise SpecError with every problem named."""
    if not isinstance(data, dict):
        raise SpecError(f"invalid job spec: expected a mapping, got {type(data).__name__}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(describe_errors(err)) from None
