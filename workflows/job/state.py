"""Everything a TrainingJob knows, as one serialisable model.

The workflow keeps all of its state in `JobState` so that continue-as-new can carry it whole,
and so that `status` and the final `JobResult` are plain views of it.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from spotrain.workflows.contract import Lifecycle, PoolGrant, StopResult, WatchResult
from spotrain.workflows.job.checkpoints import CheckpointReport, CheckpointStats, report
from spotrain.workflows.job.events import Event
from spotrain.workflows.policies.budget import BudgetState
from spotrain.workflows.policies.deadline import DeadlineState
from spotrain.workflows.policies.locality import ring_crossing
from spotrain.workflows.policies.stragglers import Straggler
from spotrain.workflows.spec import JobSpec, digest


class Phase(StrEnum):
    """Where a job stands (also the `SpotrainPhase` search attribute)."""

    QUEUED = "Queued"  # waiting for its capacity pool to admit it
    PENDING = "Pending"
    RUNNING = "Running"
    RESIZING = "Resizing"
    PAUSED = "Paused"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    @property
    def is_final(self) -> bool:
        """The job has ended and holds nothing."""
        return self in (Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED)

    @property
    def claims_capacity(self) -> bool:
        """A job in this phase claims nodes from its pool (a paused or ended one does not)."""
        return not self.is_final and self != Phase.PAUSED


class NodeState(StrEnum):
    REQUESTED = "requested"  # ordered, launching
    READY = "ready"
    GONE = "gone"  # taken by the cloud or lost
    RELEASED = "released"  # given back by the job

    @property
    def is_alive(self) -> bool:
        """Held by the job (ordered or running): it counts, and it costs once ready."""
        return self in (NodeState.REQUESTED, NodeState.READY)


SEEN_EVENTS_KEPT = 2000
UPDATE_ANSWERS_KEPT = 200
TIMELINE_KEPT = 400


class NodeRecord(BaseModel):
    """One slot's node: ordered, running, or ended (and why)."""

    slot: int
    attempt: int = 1
    lifecycle: Lifecycle
    instance_type: str
    zone: str | None = None
    node_id: str | None = None
    address: str = ""
    state: NodeState = NodeState.REQUESTED
    reason: str | None = None
    base: bool = Field(False, description="on-demand base node: never reclaimed or swapped")
    fallback: bool = Field(False, description="on-demand bought because spot was short")
    procs: int = 1
    price: float = Field(description="USD per hour while it runs")
    on_demand_price: float
    ready_at: datetime | None = None
    ended_at: datetime | None = None

    @property
    def alive(self) -> bool:
        return self.state.is_alive

    def hours(self, now: datetime) -> float:
        """Billed hours: from running until released or gone."""
        if self.ready_at is None:
            return 0.0
        end = self.ended_at or now
        return max(0.0, (end - self.ready_at).total_seconds() / 3600)


class Swap(BaseModel):
    """A warned node whose replacement the job ordered ahead (make-before-break)."""

    node_id: str
    deadline: datetime | None = Field(None, description="a reclaim notice's; None: a warning")
    since: datetime


class JobFailed(Exception):
    """The job cannot go on (max restarts, no way to get nodes); the message says why."""


class TimelineEntry(BaseModel):
    time: datetime
    generation: int
    world_size: int
    event: str
    detail: str = ""


class PendingScaleOut(BaseModel):
    """A timed scale-out waiting for its nodes (at most one at a time)."""

    seq: int  # the update's number: its answer is keyed by it
    count: int
    target: int  # the target it asked for
    back_to: int  # the target before, restored on timeout
    ceiling_before: int
    due: datetime


class JobState(BaseModel):
    spec: JobSpec
    phase: Phase = Phase.PENDING
    generation: int = 0
    members: list[int] = Field(default_factory=list, description="slots in rank order")
    running: bool = False
    nodes: list[NodeRecord] = Field(default_factory=list)
    next_slot: int = Field(0, description="slots are never reused: they key idempotent launches")
    retired: dict[str, float] = Field(
        default_factory=dict, description="node-hours and cost of nodes pruned from `nodes`"
    )
    target: int = Field(description="nodes the job wants to hold")
    ceiling: int = Field(description="most nodes it may grow to (user scaling moves it)")
    owed: int = Field(0, description="nodes that may fall back to on-demand if spot is short")
    step: int = 0
    checkpoint_step: int = 0
    generation_checkpoint: int = 0
    progress_at: datetime | None = None
    restarts: int = 0
    reclaims: int = 0
    faults: int = 0
    resizes: int = 0
    steps_lost: int = 0
    seen_events: list[str] = Field(default_factory=list)
    update_answers: dict[str, str] = Field(
        default_factory=dict,
        description="scale updates' ids -> their answers: a repeat in a later run (after "
        "continue-as-new) is answered from here, not acted on again",
    )
    inbox: list[Event] = Field(default_factory=list)
    timeline: list[TimelineEntry] = Field(default_factory=list)
    submitted_at: datetime | None = None
    hold_until: datetime | None = None
    held: bool = Field(False, description="the last stop parked its ranks, holding the state")
    finished: bool = Field(
        False, description="the ranks finished the job as they were stopped: nothing is left"
    )
    prepared: list[int] = Field(
        default_factory=list, description="slots whose ranks got a head start (live resize)"
    )
    grow_since: datetime | None = None
    next_check: datetime | None = None
    failure: str | None = None
    runs: int = 1
    spot_prices: dict[str, float] = Field(
        default_factory=dict,
        description="'type@zone' -> the market price the provider last offered: what a spot "
        "node costs when the spec gives no spot_price",
    )
    grant: PoolGrant | None = Field(None, description="what its pool lets it hold (pool jobs)")
    grant_seen: int = Field(0, description="the newest grant received: repeats are ignored")
    pool_reports: int = Field(0, description="reports sent to the pool, numbering them")
    checkpoints: CheckpointStats | None = None
    losses: int = Field(0, description="running generations lost without notice")
    swaps: list[Swap] = Field(
        default_factory=list, description="warned nodes with a replacement ordered ahead"
    )
    swapped: int = Field(0, description="warned nodes swapped out in one resize each time")
    scale_outs: int = Field(0, description="timed scale-outs asked for, numbering them")
    pending_scale_out: PendingScaleOut | None = None
    scale_out_answer: tuple[int, str] | None = Field(
        None, description="the last timed scale-out's outcome, by number"
    )
    deadline: DeadlineState | None = Field(None, description="the deadline policy's state")
    budget: BudgetState | None = Field(None, description="the spend cap (None: no cap)")
    paused_reason: str | None = Field(None, description="why the job was last paused")
    stragglers: list[Straggler] = Field(
        default_factory=list, description="slow or hung ranks of the running generation"
    )
    home_zone: str | None = Field(None, description="the zone it last bought in (placement)")
    last_hop_at: datetime | None = Field(None, description="when the job last changed zone")
    hops: int = Field(0, description="zone (or region) changes (placement)")
    dry_pools: dict[str, datetime] = Field(
        default_factory=dict, description="'type@zone' -> when a launch there found no capacity"
    )
    transfer: Transfer = Field(
        default_factory=lambda: Transfer(), description="the rings' traffic across zones"
    )
    steps_per_hour: float | None = Field(
        None,
        description="the pace since the progress seen before (or the generation's start): "
        "what a ring across zones costs an hour (placement)",
    )

    @classmethod
    def new(cls, spec: JobSpec) -> JobState:
        initial = spec.elastic.initial_nodes or spec.elastic.max_nodes
        return cls(
            spec=spec,
            target=initial,
            ceiling=spec.elastic.max_nodes,
            owed=initial - spec.on_demand.base_nodes,
            budget=BudgetState(cap_usd=spec.budget_usd) if spec.budget_usd else None,
        )

    def node(self, slot: int) -> NodeRecord:
        return next(n for n in self.nodes if n.slot == slot)

    def node_by_id(self, node_id: str) -> NodeRecord | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    @property
    def member_nodes(self) -> list[NodeRecord]:
        return [self.node(slot) for slot in self.members]

    @property
    def world_size(self) -> int:
        return sum(n.procs for n in self.member_nodes) if self.running else 0

    @property
    def allowed(self) -> int:
        """Nodes the job may hold now: its target, within its pool's grant if it has a pool."""
        if self.spec.pool is None:
            return self.target
        return min(self.target, self.grant.nodes if self.grant else 0)

    def note_progress(self, w: WatchResult, now: datetime) -> None:
        """Book what a watch saw: steps, and a checkpoint (durable progress ends a run of
        failed generations)."""
        if w.checkpoint_step is not None and w.checkpoint_step > self.checkpoint_step:
            self.checkpoint_step = w.checkpoint_step
            if self.checkpoint_step > self.generation_checkpoint:
                self.restarts = 0
        if w.step is not None and w.step > self.step:
            if self.progress_at is not None and now > self.progress_at:
                hours = (now - self.progress_at).total_seconds() / 3600
                self.steps_per_hour = (w.step - self.step) / hours
            self.bill_steps(w.step)
            self.step = w.step
            self.progress_at = now

    def bill_steps(self, step: int) -> None:
        """Add the traffic that the running generation's steps since `self.step` sent across
        zones (`spec.gradient_bytes` per step's all-reduce, over a ring in rank order): the
        bill counts every step run, a step later lost and redone twice."""
        if not self.running or step <= self.step or self.spec.gradient_bytes is None:
            return
        zones = [n.zone or "" for n in self.member_nodes]
        per_step = ring_crossing(zones, self.spec.gradient_bytes, self.spec.spot.regions)
        k = step - self.step
        t = self.transfer
        self.transfer = Transfer(
            zone_gb=t.zone_gb + k * per_step.zone_gb,
            region_gb=t.region_gb + k * per_step.region_gb,
            cost=t.cost + k * per_step.cost,
        )

    def spend(self, now: datetime) -> float:
        """USD so far: the nodes' hours at their prices, and the traffic across zones."""
        return sum(self.costs(now)[1].values()) + self.transfer.cost

    def note_stopped(self, result: StopResult) -> None:
        """The generation stopped: the job resumes from its latest checkpoint, and the steps
        done since are lost: counted from the step the ranks reached (the runtime's word),
        not the last one a watch saw, which lags it by up to a report interval."""
        reached = (result.step or self.spec.total_steps) if result.done else result.step
        if reached is not None:
            self.bill_steps(reached)
        self.running = False
        if result.done:  # (a resize decided just as the last step ran: nothing was lost)
            self.finished = True
            self.step = max(self.step, result.step or self.spec.total_steps)
            return
        if result.step is not None:
            self.step = max(self.step, result.step)
        if result.checkpoint_step is not None:
            self.checkpoint_step = max(self.checkpoint_step, result.checkpoint_step)
        resume = self.checkpoint_step
        self.held = result.held_step is not None
        if result.held_step is not None:  # live resize: the survivors' memory
            resume = max(resume, result.held_step)
        if self.step > resume:
            self.steps_lost += self.step - resume
        self.step = resume

    def note_checkpoints(self, stats: CheckpointStats, now: datetime) -> str | None:
        """New checkpoint stats: on the timeline when one was skipped as unloadable, and when
        checkpoints first stop fitting in a reclaim notice (that warning is returned, to log)."""
        known = set(self.checkpoints.skipped) if self.checkpoints else set()
        warned = self.checkpoint_report(now)
        self.checkpoints = stats
        for step in sorted(set(stats.skipped) - known):
            self.record(now, "checkpoint skipped", f"step {step} did not load")
        warning = self.checkpoint_report(now).warning
        if not warning or (warned and warned.warning):
            return None
        self.record(now, "checkpoints too slow", warning)
        return warning

    def remember(self, event_id: str | None) -> bool:
        """False if this event id was seen before (signals carry no dedupe id of their own)."""
        if event_id is None:
            return True
        if event_id in self.seen_events:
            return False
        self.seen_events = [*self.seen_events[-(SEEN_EVENTS_KEPT - 1) :], event_id]
        return True

    def remember_answer(self, update_id: str, answer: str) -> str:
        """Keep an update's answer under its id (Temporal answers a repeated id only within
        the run that saw it first; continue-as-new carries this to the next)."""
        kept = list(self.update_answers.items())[-(UPDATE_ANSWERS_KEPT - 1) :]
        self.update_answers = {**dict(kept), update_id: answer}
        return answer

    def record(self, now: datetime, event: str, detail: str = "") -> None:
        entry = TimelineEntry(
            time=now,
            generation=self.generation,
            world_size=self.world_size,
            event=event,
            detail=detail,
        )
        self.timeline = [*self.timeline[-(TIMELINE_KEPT - 1) :], entry]

    def prune(self, now: datetime) -> None:
        """Fold ended nodes into the `retired` totals (which accumulate), so that state, and
        every activation, stays small however many reclaims a long job survives. The last
        generation's members stay on record even if gone: the next generation is planned
        from them (rank order, the world size it replaces)."""
        kept = [n for n in self.nodes if n.alive or n.slot in self.members]
        ended = [n for n in self.nodes if n not in kept]
        hours, cost, all_on_demand = self.costs(now, ended)
        self.retired = {
            **{f"hours:{k}": v for k, v in hours.items()},
            **{f"cost:{k}": v for k, v in cost.items()},
            "all_on_demand": all_on_demand,
        }
        self.nodes = kept

    def costs(
        self, now: datetime, nodes: list[NodeRecord] | None = None
    ) -> tuple[dict[str, float], dict[str, float], float]:
        """(node-hours by lifecycle, cost by lifecycle, cost had every node been on-demand):
        the retired totals plus `nodes` (default: every node still on record)."""
        r = self.retired
        hours = {k: r.get(f"hours:{k}", 0.0) for k in ("spot", "on-demand")}
        cost = {k: r.get(f"cost:{k}", 0.0) for k in ("spot", "on-demand")}
        all_on_demand = r.get("all_on_demand", 0.0)
        for n in self.nodes if nodes is None else nodes:
            h = n.hours(now)
            hours[n.lifecycle] += h
            cost[n.lifecycle] += h * n.price
            all_on_demand += h * n.on_demand_price
        return hours, cost, all_on_demand

    def status(self, now: datetime) -> JobStatus:
        """The `status` query's answer: where the job stands, its nodes (those ended within
        the hour too) and the timeline's last 20 entries."""
        rank = {slot: i for i, slot in enumerate(self.members)} if self.running else {}
        accounts = self.accounts(now)
        return JobStatus(
            **accounts,
            generation=self.generation,
            world_size=self.world_size,
            target_nodes=self.target,
            step=self.step,
            total_steps=self.spec.total_steps,
            checkpoint_step=self.checkpoint_step,
            cost_so_far=round(accounts["total_cost"], 4),
            pool=self.spec.pool.name if self.spec.pool else None,
            pool_grant=self.grant.nodes if self.grant else None,
            paused_reason=self.paused_reason if self.phase == Phase.PAUSED else None,
            spec_digest=digest(self.spec),
            nodes=[
                NodeView(
                    node_id=n.node_id,
                    slot=n.slot,
                    lifecycle=n.lifecycle,
                    instance_type=n.instance_type,
                    zone=n.zone,
                    state=n.state,
                    reason=n.reason,
                    price=n.price,
                    rank=rank.get(n.slot),
                )
                for n in self.nodes
                if n.alive or n.ended_at is None or n.ended_at > now - timedelta(hours=1)
            ],
            timeline=self.timeline[-20:],
            stragglers=[
                f for f in self.stragglers if self.running and f.generation == self.generation
            ],
        )

    def result(self, now: datetime) -> JobResult:
        """What the job returns when it ends."""
        return JobResult(
            **self.accounts(now),
            generations=self.generation,
            steps_done=self.step,
            continued_as_new=self.runs - 1,
            timeline=self.timeline,
        )

    def accounts(self, now: datetime) -> dict[str, Any]:
        """What `status` and the final result both report: outcome counts and cost."""
        hours, cost, all_on_demand = self.costs(now)
        total = sum(cost.values()) + self.transfer.cost
        return {
            "name": self.spec.name,
            "phase": self.phase,
            "failure": self.failure,
            "reclaims": self.reclaims,
            "faults": self.faults,
            "resizes": self.resizes,
            "swapped": self.swapped,
            "steps_lost": self.steps_lost,
            "hops": self.hops,
            "node_hours": {k: round(v, 6) for k, v in hours.items()},
            "cost": {k: round(v, 6) for k, v in cost.items()},
            "transfer": self.transfer.rounded(),
            "total_cost": round(total, 6),
            "all_on_demand_cost": round(all_on_demand, 6),
            "savings": round(1 - total / all_on_demand, 6) if all_on_demand else 0.0,
            "checkpoints": self.checkpoint_report(now),
            # (as data: the workflow sandbox may hold its own copy of the model's class)
            "deadline": self.deadline.model_dump() if self.deadline else None,
            "budget_usd": self.budget.cap_usd if self.budget else None,
        }

    def checkpoint_report(self, now: datetime) -> CheckpointReport | None:
        return report(
            self.checkpoints,
            self.spec.elastic.graceful_shutdown_timeout_s,
            self.losses,
            (now - self.submitted_at).total_seconds() if self.submitted_at else 0.0,
        )


class Transfer(BaseModel):
    """Bytes the job's rings sent across zones (of them, across regions), and what EC2 bills
    for them (workflows/policies/locality.py)."""

    zone_gb: float = 0.0
    region_gb: float = 0.0
    cost: float = 0.0

    def rounded(self) -> Transfer:
        return Transfer(
            zone_gb=round(self.zone_gb, 3),
            region_gb=round(self.region_gb, 3),
            cost=round(self.cost, 6),
        )


class NodeView(BaseModel):
    node_id: str | None
    slot: int
    lifecycle: Lifecycle
    instance_type: str
    zone: str | None
    state: NodeState
    reason: str | None
    price: float
    rank: int | None


class JobAccounts(BaseModel):
    """Outcome counts and cost, as of now (status) or at the end (result)."""

    name: str
    phase: Phase
    failure: str | None = None
    reclaims: int
    faults: int
    resizes: int
    swapped: int = Field(0, description="warned nodes replaced make-before-break")
    steps_lost: int
    hops: int = Field(0, description="moves to another zone (placement)")
    node_hours: dict[str, float]
    cost: dict[str, float]
    transfer: Transfer = Field(
        default_factory=lambda: Transfer(), description="traffic across zones: GB and USD"
    )
    total_cost: float = Field(description="the nodes' cost and the transfer's")
    all_on_demand_cost: float
    savings: float = Field(description="fraction saved versus all on-demand")
    checkpoints: CheckpointReport | None = None
    deadline: DeadlineState | None = Field(
        None, description="deadline jobs: the deadline, mode, slack at each check, switches"
    )
    budget_usd: float | None = Field(None, description="the spend cap (None: no cap)")
    timeline: list[TimelineEntry]


class JobStatus(JobAccounts):
    """The `status` query's answer (the timeline's last 20 entries)."""

    generation: int
    world_size: int
    target_nodes: int
    step: int
    total_steps: int
    checkpoint_step: int
    cost_so_far: float
    nodes: list[NodeView]
    pool: str | None = None
    pool_grant: int | None = Field(None, description="nodes its pool lets it hold now")
    paused_reason: str | None = Field(None, description="while paused: why")
    stragglers: list[Straggler] = Field(
        default_factory=list, description="slow or hung ranks of the running generation"
    )
    spec_digest: str | None = Field(None, description="spec.digest of the spec the job runs")


class JobResult(JobAccounts):
    """What a finished job returns (and what `spotrain report` explains)."""

    generations: int
    steps_done: int
    continued_as_new: int
