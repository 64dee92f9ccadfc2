"""A simulated cloud and training runtime: the real activity interface, modelled behaviour.

Time is the Temporal server's clock as seen by each activity (the time it was scheduled), so
under the time-skipping test server hours of training pass in milliseconds and the model
stays consistent with the workflow's own timers. Used by the workflow tests and by the
goodput benchmark, where capacity follows a recorded spot trace.

The training model: a generation of world size W makes `steps_per_hour(W)` progress after a
start-up; a checkpoint is taken every `checkpoint_every` steps, and on an elastic event
(graceful stop) at the current step. Both resize modes of `elastic.resize`:

- restart: every generation starts up in `restart_cost_s`; a hard stop loses what came after
  the last checkpoint. The checkpoint on an elastic event takes `checkpoint_s`: one that does
  not fit in the stop's grace fails (the stop is forced, the job resumes from the last
  periodic one), and the next generation starts loading only once it is written.
- live: the ranks that stay park holding their step, and the next generation resumes from it
  after the `LivePauses` pause for its kind of resize (growth, shrink on notice, loss without
  notice), not a restart. A loss costs only the step in flight (the fraction past the last
  whole step); the notice's checkpoint is written in the background (it counts once it fits
  in the grace, and nothing waits for it). Joiners get their head start from
  `prepare_generation`; one that had none pays a process start (`restart_cost_s`) as well.

The job's checkpoint location is real all the same: the runtime registers the same
`check_checkpoint` as the others, so a finished job's location fails a simulated job too.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from temporalio import activity
from temporalio.exceptions import ApplicationError

from spotrain.activities.checkpoint_check import check_checkpoint
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    CleanupRequest,
    DescribeRequest,
    GenerationPlan,
    LaunchRequest,
    NodeInfo,
    Offer,
    ReleaseRequest,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)
from spotrain.workflows.spec import SpotPolicy

# (instance type, zone, time) -> how many more nodes that pool can give now
CapacityFn = Callable[[str, str, datetime], int]


def _now() -> datetime:
    return activity.info().current_attempt_scheduled_time


@dataclass
class SimNode:
    info: NodeInfo
    job: str
    launched_at: datetime
    ready_at: datetime


BOOTING = "Booting"  # launch_node's retryable error while its node boots


class SimulatedCloud:
    """Spot pools with capacity from a function of time (a trace), on-demand always available."""

    ID_FORMAT = "sim-{:05d}"  # node ids (a subclass may name them as EC2 does)

    def __init__(
        self,
        zones: list[str] | None = None,
        capacity: CapacityFn | None = None,
        spot_price: float = 0.97,
        boot_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.zones = zones or ["us-east-1a", "us-east-1b"]
        self.capacity = capacity or (lambda _t, _z, _when: 1_000_000)
        self.spot_price = spot_price
        self.boot_s = boot_s  # a launched node's boot to ready, drawn per node
        self.nodes: dict[str, SimNode] = {}
        self.booting: dict[tuple[str, int, int], str] = {}  # (job, slot, attempt) -> node
        self.boot_hours: dict[str, float] = {"spot": 0.0, "on-demand": 0.0}  # paid, not ready
        self.launches: list[LaunchRequest] = []  # every launch that created a node
        self.changes: list[tuple[str, int]] = []  # (job, +1 launched / -1 gone), in order
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _spot_in_use(self, itype: str, zone: str) -> int:
        return sum(
            1
            for n in self.nodes.values()
            if n.info.state != "gone"
            and n.info.lifecycle == "spot"
            and (n.info.instance_type, n.info.zone) == (itype, zone)
        )

    @activity.defn(name=contract.FIND_OFFERS)
    def find_offers(self, policy: SpotPolicy) -> list[Offer]:
        zones = policy.zones or self.zones
        with self._lock:
            free = {
                (t.name, z): self.capacity(t.name, z, _now()) - self._spot_in_use(t.name, z)
                for t in policy.instance_types
                for z in zones
            }
            return [
                Offer(instance_type=t, zone=z, price=self.spot_price, capacity=n)
                for (t, z), n in free.items()
                if n > 0 and (policy.max_price is None or self.spot_price <= policy.max_price)
            ]

    @activity.defn(name=contract.LAUNCH_NODE)
    def launch_node(self, req: LaunchRequest) -> NodeInfo:
        """Like EC2's, it returns once the node is ready: while it boots, the activity fails
        with a retry due when the boot ends, so the boot passes in server time."""
        with self._lock:
            for n in self.nodes.values():  # idempotent: the slot's node, if it exists
                if n.job == req.job and n.info.slot == req.slot and n.info.state == "ready":
                    return n.info
            if (node_id := self.booting.get((req.job, req.slot, req.attempt))) is not None:
                return self._boot(self.nodes[node_id], (req.job, req.slot, req.attempt))
            zone = req.zone or self.zones[0]
            if req.lifecycle == "spot" and self.capacity(
                req.instance_type, zone, _now()
            ) <= self._spot_in_use(req.instance_type, zone):
                raise ApplicationError(
                    f"InsufficientInstanceCapacity: no spot {req.instance_type} in {zone}",
                    type=contract.CAPACITY_ERROR,
                    non_retryable=True,
                )
            info = NodeInfo(
                node_id=self.ID_FORMAT.format(next(self._ids)),
                slot=req.slot,
                lifecycle=req.lifecycle,
                instance_type=req.instance_type,
                zone=zone,
                state="requested",
            )
            ready_at = _now() + timedelta(seconds=max(0.0, self.boot_s()))
            node = SimNode(info=info, job=req.job, launched_at=_now(), ready_at=ready_at)
            self.nodes[info.node_id] = node
            self.launches.append(req)
            self.changes.append((req.job, +1))
            return self._boot(node, (req.job, req.slot, req.attempt))

    def _boot(self, node: SimNode, key: tuple[str, int, int]) -> NodeInfo:
        """The node once ready; until then a retryable error; a capacity error if the cloud
        took it back while it booted (EC2's "ended before it ran")."""
        now = _now()
        if key in self.booting:
            # A retry of the wait below runs no sooner than the delay it was given, so the
            # boot is over. (The time-skipping test server reports a retried attempt's time
            # as when the attempt before it failed: read as now, the node was still booting
            # and waited its boot out a second time, unbilled and untrained.)
            now = max(now, node.ready_at)
        if node.info.state == "requested" and now < node.ready_at:
            self.booting[key] = node.info.node_id
            raise ApplicationError(
                f"{node.info.node_id} is booting",
                type=BOOTING,
                next_retry_delay=node.ready_at - now,
            )
        self.booting.pop(key, None)
        booted = min(now, node.ready_at) - node.launched_at
        self.boot_hours[node.info.lifecycle] += booted.total_seconds() / 3600
        if node.info.state == "gone":
            raise ApplicationError(
                f"{node.info.node_id} ended before it ran: {node.info.reason}",
                type=contract.CAPACITY_ERROR,
                non_retryable=True,
            )
        node.info.state = "ready"
        return node.info

    @activity.defn(name=contract.DESCRIBE_NODES)
    def describe_nodes(self, req: DescribeRequest) -> list[NodeInfo]:
        with self._lock:
            if not req.node_ids:  # every node of the job, as EC2's tag lookup gives
                return [n.info for n in self.nodes.values() if n.job == req.job]
            gone = NodeInfo(
                node_id="", slot=-1, lifecycle="spot", instance_type="", zone="", state="gone"
            )
            return [
                self.nodes[i].info
                if i in self.nodes
                else gone.model_copy(update={"node_id": i, "reason": "not-found"})
                for i in req.node_ids
            ]

    @activity.defn(name=contract.RELEASE_NODES)
    def release_nodes(self, req: ReleaseRequest) -> list[str]:
        with self._lock:
            owned = [i for i, n in self.nodes.items() if n.job == req.job and req.asks_for(i)]
            for node_id in owned:
                self._gone(node_id, "terminated")
            return owned

    def reclaim(self, node_id: str) -> None:
        """The cloud takes a spot node back (the caller signals the job, as a webhook would)."""
        with self._lock:
            self._gone(node_id, "reclaimed")

    def _gone(self, node_id: str, reason: str) -> None:
        node = self.nodes[node_id]
        if node.info.state != "gone":
            node.info.state, node.info.reason = "gone", reason
            self.changes.append((node.job, -1))

    def peak(self, jobs: set[str]) -> int:
        """The most nodes `jobs` held at once, over every launch and release so far."""
        held = most = 0
        with self._lock:
            for job, change in self.changes:
                if job in jobs:
                    held += change
                    most = max(most, held)
        return most

    def running(self, job: str | None = None) -> list[NodeInfo]:
        with self._lock:
            return [
                n.info
                for n in self.nodes.values()
                if n.info.state != "gone" and (job is None or n.job == job)
            ]

    def activities(self) -> list[Callable[..., object]]:
        return [self.find_offers, self.launch_node, self.describe_nodes, self.release_nodes]


@dataclass(frozen=True)
class LivePauses:
    """Live resize's training pause, seconds, by kind of resize (the benchmark passes the
    product's measured figures; growth includes the state's hand-over to the joiners)."""

    growth_s: float = 0.2
    shrink_s: float = 0.3
    loss_s: float = 0.3


@dataclass
class SimGeneration:
    plan: GenerationPlan
    started_at: datetime
    start_step: int
    startup_s: float  # start-up (restart) or pause (live resize) before its first step
    stopped: bool = False
    failure: str | None = None
    stalled_at: datetime | None = None


@dataclass
class SimJob:
    checkpoint_step: int = 0
    done: bool = False
    generations: dict[int, SimGeneration] = field(default_factory=dict)
    written_at: datetime | None = None  # when the last checkpoint on an elastic event is durable
    held_step: int | None = None  # live resize: the step the parked ranks hold
    held_kind: str = "shrink"  # live resize: what parked them ("shrink" on notice, or "loss")
    held_nodes: set[str] = field(default_factory=set)  # the nodes of the parked ranks
    # live resize: the start-up (or pause) the parked ranks still had before their first step
    held_starting_s: float = 0.0
    prepared: set[str] = field(default_factory=set)  # joiners given a head start
    history: list[tuple[int, int, int, int]] = field(default_factory=list)  # gen, world, from, to


class SimulatedRuntime:
    """Training whose progress is modelled from the server clock (see the module docstring)."""

    def __init__(
        self,
        steps_per_hour: Callable[[int], float] = lambda world: 3600.0 * world,
        checkpoint_every: int = 100,
        restart_cost_s: float = 60.0,
        checkpoint_s: float = 0.0,
        live: LivePauses | None = None,
    ) -> None:
        self.steps_per_hour = steps_per_hour
        self.checkpoint_every = checkpoint_every
        self.restart_cost_s = restart_cost_s
        self.checkpoint_s = checkpoint_s
        self.live = live or LivePauses()
        self.jobs: dict[str, SimJob] = {}
        self._lock = threading.Lock()

    def _job(self, name: str) -> SimJob:
        return self.jobs.setdefault(name, SimJob())

    def _step(self, gen: SimGeneration, at: datetime) -> int:
        """The step the generation has reached at `at` (capped at the job's total)."""
        until = gen.stalled_at or at
        working = max(0.0, (until - gen.started_at).total_seconds() - gen.startup_s)
        done = math.floor(working / 3600 * self.rate(gen.plan))
        return min(gen.plan.total_steps, gen.start_step + done)

    def rate(self, plan: GenerationPlan) -> float:
        """Steps an hour the generation `plan` makes: `steps_per_hour` of its world size (the
        goodput benchmark slows a ring that crosses zones)."""
        return self.steps_per_hour(plan.world_size)

    def _periodic_checkpoint(self, gen: SimGeneration, step: int) -> int:
        if step >= gen.plan.total_steps:
            return step
        return max(gen.start_step, step - step % self.checkpoint_every)

    def live_pause_s(self, job: SimJob, plan: GenerationPlan) -> float:
        """A live resume's pause: growth if it has joiners (plus a process start for those
        without a head start), else the kind of stop that parked its ranks."""
        joiners = {m.node_id for m in plan.members} - job.held_nodes
        if not joiners:
            return self.live.shrink_s if job.held_kind == "shrink" else self.live.loss_s
        cold = bool(joiners - job.prepared)
        return self.live.growth_s + (self.restart_cost_s if cold else 0.0)

    @activity.defn(name=contract.START_GENERATION)
    def start_generation(self, plan: GenerationPlan) -> None:
        with self._lock:
            job = self._job(plan.job)
            if plan.generation in job.generations:  # idempotent
                return
            if plan.resize == "live" and job.held_step is not None:  # resume from memory
                # ranks parked while still starting (a cold restart's import, say) finish it
                # first: the resize's own pause does not cut it short
                pause = max(self.live_pause_s(job, plan), job.held_starting_s)
                gen = SimGeneration(plan, _now(), job.held_step, pause)
            else:  # from the checkpoint, once written
                start = max(_now(), job.written_at or _now())
                gen = SimGeneration(plan, start, job.checkpoint_step, self.restart_cost_s)
            job.generations[plan.generation] = gen
            job.held_step, job.prepared = None, set()

    @activity.defn(name=contract.PREPARE_GENERATION)
    def prepare_generation(self, plan: GenerationPlan) -> None:
        """Live resize's head start: the joiners boot and build beside the training."""
        with self._lock:
            self._job(plan.job).prepared |= {m.node_id for m in plan.members}

    @activity.defn(name=contract.STOP_GENERATION)
    def stop_generation(self, req: StopRequest) -> StopResult:
        with self._lock:
            job = self._job(req.job)
            gen = job.generations.get(req.generation)
            if gen is None or gen.stopped:
                return StopResult(acked_ranks=[], checkpoint_step=job.checkpoint_step)
            step = self._step(gen, _now())
            healthy = gen.failure is None and gen.stalled_at is None
            acks = req.graceful and healthy and self.checkpoint_s <= req.grace_s
            reached = step if acks else self._periodic_checkpoint(gen, step)
            if acks:
                job.written_at = _now() + timedelta(seconds=self.checkpoint_s)
            job.checkpoint_step = max(job.checkpoint_step, reached)
            job.history.append((req.generation, gen.plan.world_size, gen.start_step, step))
            gen.stopped = True
            held = None
            survivors = {m.node_id for m in gen.plan.members} - set(req.lost_node_ids)
            # the ranks left park, holding the step they reached; a world lost whole holds
            # nothing: it goes back to the last checkpoint
            if req.live and healthy and survivors:
                held = step
                job.held_step, job.held_kind = step, "shrink" if req.graceful else "loss"
                job.held_nodes = survivors
                running_s = (_now() - gen.started_at).total_seconds()
                job.held_starting_s = max(0.0, gen.startup_s - running_s)
            ranks = list(range(gen.plan.world_size)) if acks or held is not None else []
            return StopResult(
                acked_ranks=ranks,
                checkpoint_step=job.checkpoint_step,
                forced=not (acks or (held is not None and req.graceful)),
                step=step,
                held_step=held,
                done=step >= gen.plan.total_steps,
            )

    @activity.defn(name=contract.WATCH_GENERATION)
    def watch_generation(self, req: WatchRequest) -> WatchResult:
        """Answers at once: the workflow paces its watches by the report interval."""
        with self._lock:
            job = self._job(req.job)
            gen = job.generations.get(req.generation)
            if gen is None or gen.stopped:
                return WatchResult(outcome="failed", detail="generation not running")
            step = self._step(gen, _now())
            checkpoint = self._periodic_checkpoint(gen, step)
            job.checkpoint_step = max(job.checkpoint_step, checkpoint)
            if gen.failure:
                return WatchResult(
                    outcome="failed", step=step, detail=gen.failure, exit_codes={0: 1}
                )
            if step >= gen.plan.total_steps:
                job.done = True
                gen.stopped = True
                job.history.append((req.generation, gen.plan.world_size, gen.start_step, step))
                return WatchResult(outcome="completed", step=step, checkpoint_step=step)
            return WatchResult(outcome="progress", step=step, checkpoint_step=job.checkpoint_step)

    @activity.defn(name=contract.CLEANUP_JOB)
    def cleanup_job(self, req: CleanupRequest) -> None:
        with self._lock:
            for gen in self._job(req.job).generations.values():
                gen.stopped = True

    # --- fault injection for tests -----------------------------------------------------------

    def fail(self, job: str, detail: str = "rank 0 exited with code 1") -> None:
        """The running generation's next watch reports a crashed rank."""
        with self._lock:
            for gen in self._job(job).generations.values():
                if not gen.stopped:
                    gen.failure = detail

    def stall(self, job: str, at: datetime) -> None:
        """The running generation stops making progress at `at` (a hang)."""
        with self._lock:
            for gen in self._job(job).generations.values():
                if not gen.stopped:
                    gen.stalled_at = at

    def running_generations(self, job: str) -> list[int]:
        with self._lock:
            return [g for g, gen in self._job(job).generations.items() if not gen.stopped]

    def activities(self) -> list[Callable[..., object]]:
        return [
            check_checkpoint,
            self.start_generation,
            self.prepare_generation,
            self.stop_generation,
            self.watch_generation,
            self.cleanup_job,
        ]
