"""Every decision over one job's state, as pure functions: the state and inputs in, a plan out.

The TrainingJob workflow waits, calls activities and applies these plans; it decides nothing
itself. No I/O, no clocks (the caller passes `now`), no randomness, no mutation of the state
given: so each rule is unit- and property-tested without a Temporal server. The primitives
they build on (allowed sizes, member order, spot pool ranking, GPU packing) are in `planner`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from spotrain.workflows.contract import (
    GenerationPlan,
    Member,
    PoolGrant,
    PoolReport,
    ScaleIn,
    WatchResult,
)
from spotrain.workflows.job import planner
from spotrain.workflows.job.events import Event, Lost, Reclaim
from spotrain.workflows.job.orders import next_need
from spotrain.workflows.job.state import JobState, NodeRecord, NodeState, Phase
from spotrain.workflows.policies import deadline
from spotrain.workflows.spec import JobSpec

# --- starting a generation ---------------------------------------------------------------------


def sizes(spec: JobSpec) -> list[int]:
    e = spec.elastic
    return planner.allowed_sizes(e.min_nodes, e.max_nodes, e.increment_step, e.discrete_sizes)


@dataclass(frozen=True)
class NextGeneration:
    """Start `members` now, or (None) wait until `wake` (None: until something happens)."""

    members: list[int] | None
    hold_until: datetime | None  # the job's hold afterwards
    wake: datetime | None = None
    why: str = ""
    too_few: bool = False  # not even the smallest allowed size is ready


def next_generation(
    state: JobState, now: datetime, *, launching: bool, survivors_first: bool = False
) -> NextGeneration:
    """The largest allowed membership the ready nodes fill, unless it is short of what the job
    may hold and a hold is on: the first gang start waits `scaling_timeout_s` for the other
    nodes ordered, and after a loss `faulty_scale_down_timeout_s` for a replacement.
    `survivors_first` (live resize): parked survivors holding the state re-form at once, with
    the joiners whose ranks got a head start, when they fill an allowed size; a node with no
    rank yet joins later, by a growth with a head start, so nobody waits on a process start."""
    ready = [n for n in state.nodes if n.state == NodeState.READY]
    if survivors_first and state.held:
        kept = [n for n in ready if n.slot in state.members or n.slot in state.prepared]
        size = planner.best_size(
            len(kept), sizes(state.spec), cap=min(state.allowed, state.ceiling)
        )
        if size is not None:
            candidates = [planner.Candidate(n.slot, n.lifecycle, n.base) for n in kept]
            return NextGeneration(planner.choose_members(state.members, candidates, size), None)
    size = planner.best_size(len(ready), sizes(state.spec), cap=min(state.allowed, state.ceiling))
    hold = state.hold_until
    if size is not None and size < state.allowed:
        if hold is None and state.generation == 0 and launching:
            hold = now + timedelta(seconds=state.spec.elastic.scaling_timeout_s)
        if hold is not None and now < hold:
            why = (
                "gang start: the other nodes ordered may still arrive"
                if state.generation == 0
                else "a replacement may still arrive (faulty_scale_down_timeout_s)"
            )
            return NextGeneration(None, hold, min(hold, state.next_check or hold), why)
    if size is None:
        return NextGeneration(
            None, hold, state.next_check, "too few nodes ready: next capacity check", too_few=True
        )
    candidates = [planner.Candidate(n.slot, n.lifecycle, n.base) for n in ready]
    return NextGeneration(planner.choose_members(state.members, candidates, size), None)


def generation_plan(state: JobState, next_members: list[int] | None = None) -> GenerationPlan:
    """What the runtime starts for the state's (new) generation: its members in rank order,
    and the `scale_config` entry of its world size. `next_members`: the plan of the generation
    after the running one, on those slots (a live resize's head start)."""
    spec = state.spec
    if next_members is None:
        nodes, generation = state.member_nodes, state.generation
    else:
        nodes, generation = [state.node(m) for m in next_members], state.generation + 1
    world = sum(n.procs for n in nodes)
    return GenerationPlan(
        job=spec.name,
        generation=generation,
        members=[Member(node_id=n.node_id or "", address=n.address, procs=n.procs) for n in nodes],
        command=spec.command,
        env=spec.env,
        image=spec.image,
        job_type=spec.type,
        checkpoint=spec.checkpoint,
        checkpoint_keep=spec.checkpoint_keep,
        scale_config={str(k): v for k, v in spec.scale_config.get(world, {}).items()},
        global_batch_size=spec.global_batch_size,
        total_steps=spec.total_steps,
        gpus_per_proc=1 if (spec.gpus_per_node or spec.total_gpus) else 0,
        graceful_shutdown_s=spec.elastic.graceful_shutdown_timeout_s,
        resize=spec.elastic.resize,
        collective_timeout_s=spec.elastic.collective_timeout_s,
        peer_copy=spec.elastic.peer_copy,
    )


def swap_back(state: JobState) -> tuple[list[NodeRecord], int]:
    """Return to spot: on-demand fallback nodes left out of the new generation are released,
    and the target drops by as many. ([] and the same target: nothing to give back.)"""
    spare = [
        n
        for n in state.nodes
        if n.state == NodeState.READY and n.fallback and n.slot not in state.members
    ]
    if not spare or not state.spec.on_demand.return_to_spot or deadline.on_demand(state.deadline):
        return [], state.target
    return spare, max(state.spec.elastic.min_nodes, state.target - len(spare))


# --- a running generation ----------------------------------------------------------------------

Verdict = Literal["completed", "fault", "carry on"]


def watch_verdict(state: JobState, w: WatchResult, now: datetime) -> tuple[Verdict, str]:
    """What a watch's answer means (after its progress is booked): done, a fault (a rank
    failed, or no progress for `stall_timeout_s`) and why, or nothing to do."""
    if w.outcome == "completed":
        return "completed", ""
    if w.outcome == "failed":
        return "fault", w.detail or f"exit codes {w.exit_codes}"
    stall = state.spec.elastic.stall_timeout_s
    if state.progress_at and (now - state.progress_at).total_seconds() > stall:
        return "fault", f"stalled: no progress for {stall:.0f}s at step {state.step}"
    return "carry on", ""


def restarts_exhausted(state: JobState, detail: str) -> str | None:
    """Why the job fails, once more generations in a row failed than `max_restarts` allows."""
    limit = state.spec.elastic.max_restarts
    if state.restarts <= limit:
        return None
    return (
        f"{state.restarts} failed generations in a row (max_restarts={limit}); last fault: {detail}"
    )


def growth_plan(state: JobState) -> list[int] | None:
    """The bigger (or, returning to spot, all-spot) membership ready nodes allow now, if any."""
    if not state.running:
        return None
    ready = [n for n in state.nodes if n.state == NodeState.READY]
    size = planner.best_size(len(ready), sizes(state.spec), cap=state.ceiling)
    if size is None or size < len(state.members):
        return None
    candidates = [planner.Candidate(n.slot, n.lifecycle, n.base) for n in ready]
    plan = planner.choose_members(state.members, candidates, size)
    swaps_back = state.spec.on_demand.return_to_spot and set(plan) != set(state.members)
    return plan if size > len(state.members) or swaps_back else None


def growth_since(state: JobState, now: datetime) -> datetime | None:
    """The growth debounce's start, once nodes changed: `now` if growth just became possible,
    else as it was."""
    if state.grow_since is None and growth_plan(state) is not None:
        return now
    return state.grow_since


def growth_timer(
    state: JobState, now: datetime | None, *, restore_at_once: bool = True
) -> tuple[datetime | None, datetime | None]:
    """(debounce start, when to grow): growth waits `scaling_timeout_s` after it became
    possible, so nodes arriving one by one join in one resize; both are None once it is no
    longer possible (the next chance starts afresh). A debounce not started yet starts `now`:
    a node that became ready while no generation ran (during a gang start) changed nothing
    later, and the job stayed short of it for good (None: the rule before). Growth that
    brings the job back to the nodes it wants (a replacement ready) is due at once: nothing
    more is coming to wait for, and the node bills while it idles (`restore_at_once` False:
    the rule before)."""
    since = state.grow_since if now is None else growth_since(state, now)
    plan = None if since is None else growth_plan(state)
    if since is None or plan is None:
        return None, None
    if restore_at_once and len(state.members) < state.allowed <= len(plan):
        return since, since
    return since, since + timedelta(seconds=state.spec.elastic.scaling_timeout_s)


# --- events ------------------------------------------------------------------------------------

ReclaimAction = Literal["ignore", "ignore rebalance", "ignore scheduled", "gone", "lost", "resize"]


@dataclass(frozen=True)
class ReclaimPlan:
    action: ReclaimAction
    grace: float = 0.0
    leaving: list[NodeRecord] = field(default_factory=list)  # members leaving in one resize
    absorbed: list[Event] = field(default_factory=list)  # queued events this resize covers


def reclaim_plan(state: JobState, event: Reclaim, now: datetime) -> ReclaimPlan:
    """A notice: ignore it (unknown or gone node, an unwanted rebalance, a scheduled change
    with `early_warning: ignore`), book a node that
    does not train as gone, treat one with no time left as lost, or checkpoint within the
    notice and shrink, taking every member already reclaimed or lost with it (one resize)."""
    node = state.node_by_id(event.node_id)
    if node is None or not node.alive:
        return ReclaimPlan("ignore")
    if event.kind == "rebalance" and state.spec.elastic.warning_policy != "shrink":
        return ReclaimPlan("ignore rebalance")
    if event.kind == "scheduled" and state.spec.elastic.warning_policy == "ignore":
        return ReclaimPlan("ignore scheduled")  # (make_before_break passing it: shrink)
    timeout = state.spec.elastic.graceful_shutdown_timeout_s
    left = None if event.deadline is None else (event.deadline - now).total_seconds()
    grace = planner.grace_for_notice(
        timeout if left is None else left, timeout, margin=0 if left is None else 5
    )
    if node.slot not in state.members or not state.running:
        return ReclaimPlan("gone", grace)
    if grace <= 0:
        return ReclaimPlan("lost", grace)
    leaving, absorbed = [node], []
    for other in state.inbox:
        match other:
            case Reclaim(kind="reclaim", node_id=node_id) | Lost(node_id=node_id):
                n = state.node_by_id(node_id)
            case _:
                continue
        if n is not None and n.alive and n.slot in state.members and n not in leaving:
            leaving.append(n)
            absorbed.append(other)
    return ReclaimPlan("resize", grace, leaving, absorbed)


@dataclass(frozen=True)
class AfterLoss:
    reclaim: bool  # counts as a reclaim survived
    owe: bool  # a replacement is owed (replace policy, or a base node)
    target: int


def after_loss(state: JobState, node: NodeRecord, reason: str) -> AfterLoss:
    """A lost node is replaced (`reclaim_policy: replace`, and always a base node), or the
    job's target shrinks by one, never below `min_nodes` (`drop`)."""
    owe = state.spec.elastic.reclaim_policy == "replace" or node.base
    return AfterLoss(
        reclaim=reason == "reclaimed" or node.lifecycle == "spot",
        owe=owe,
        target=state.target if owe else max(state.spec.elastic.min_nodes, state.target - 1),
    )


def replacement_hold(state: JobState, now: datetime) -> datetime | None:
    """After a loss, wait up to `faulty_scale_down_timeout_s` for a replacement before
    restarting smaller (`replace`); with `drop`, the hold stays as it was."""
    if state.spec.elastic.reclaim_policy != "replace":
        return state.hold_until
    return now + timedelta(seconds=state.spec.elastic.faulty_scale_down_timeout_s)


def removal_order(state: JobState) -> list[NodeRecord]:
    """Live nodes, the first to remove first: nodes outside the generation, then the highest
    ranks."""
    in_rank_order = [n for n in state.member_nodes if n.alive] + [
        n for n in state.nodes if n.alive and n.slot not in state.members
    ]
    return list(reversed(in_rank_order))


@dataclass(frozen=True)
class ScaleDown:
    victims: list[NodeRecord]
    target: int

    @property
    def names(self) -> list[str]:
        return [n.node_id or f"slot-{n.slot}" for n in self.victims]


def scale_in_plan(state: JobState, count: int | None, node_ids: list[str] | None) -> ScaleDown:
    """The nodes a scale-in removes (the named ones, or the `count` highest ranks) and the
    target after it, never below `min_nodes`."""
    names = {n.node_id or f"slot-{n.slot}": n for n in reversed(removal_order(state))}
    victims = [names[v] for v in planner.scale_in_victims(list(names), count, node_ids)]
    return ScaleDown(victims, max(state.spec.elastic.min_nodes, state.target - len(victims)))


def scale_out_error(state: JobState, count: int) -> str | None:
    limit = state.spec.elastic.max_nodes
    if state.target + count > limit:
        return f"cannot scale out to {state.target + count} nodes: max_nodes is {limit}"
    return None


def scale_in_error(state: JobState, req: ScaleIn) -> str | None:
    if (req.count is None) == (req.node_ids is None):
        return "give either count or node_ids"
    alive = {n.node_id for n in state.nodes if n.alive and n.node_id}
    unknown = sorted(set(req.node_ids or []) - alive)
    if unknown:
        return f"unknown or gone node(s): {', '.join(unknown)}"
    removing = req.count or len(req.node_ids or [])
    if state.target - removing < state.spec.elastic.min_nodes:
        return (
            f"cannot scale in to {state.target - removing} nodes: "
            f"min_nodes is {state.spec.elastic.min_nodes}"
        )
    return None


# --- periodic capacity checks ------------------------------------------------------------------


@dataclass(frozen=True)
class CapacityCheck:
    grow: bool  # opportunistic growth back to the ceiling
    swap: int  # on-demand fallback nodes to swap back to spot (0: none)

    @property
    def wants_spot(self) -> bool:
        return self.grow or self.swap > 0


def capacity_check(state: JobState, *, launching: bool) -> CapacityCheck | None:
    """What a capacity check looks for on the spot market: room to grow (`opportunistic`),
    and spot to replace fallback nodes with (`return_to_spot`, once no launch is in flight
    and no spare spot node is already waiting to take over). None: no orders at all (paused,
    or spot disabled)."""
    spec = state.spec
    if state.phase == Phase.PAUSED or not spec.spot.enabled:
        return None
    if deadline.on_demand(state.deadline):  # no spot wanted: reconcile on-demand only
        return CapacityCheck(grow=False, swap=0)
    fallbacks = sum(1 for n in state.nodes if n.alive and n.fallback)
    spare_spot = any(
        n.state == NodeState.READY and n.lifecycle == "spot" and n.slot not in state.members
        for n in state.nodes
    )
    swap = spec.on_demand.return_to_spot and not launching and not spare_spot
    return CapacityCheck(
        grow=spec.elastic.opportunistic and state.target < state.ceiling,
        swap=fallbacks if swap else 0,
    )


def target_with_spot(state: JobState, check: CapacityCheck) -> int:
    """The target once spot offers are found: the ceiling for growth, plus one spot node per
    fallback node to swap (each leaves once the spot one has taken its place)."""
    target = state.ceiling if check.grow else state.target
    if check.swap:
        target = min(state.ceiling + check.swap, target + check.swap)
    return target


# --- capacity pool -----------------------------------------------------------------------------


@dataclass(frozen=True)
class GrantPlan:
    """How a job applies its pool's grant."""

    target: int
    preempt: bool  # below its min: checkpoint, release everything, queue
    admit: bool  # it was queued and may now run: order `owed` nodes
    owed: int
    victims: list[NodeRecord]  # nodes to give back (checkpointing first if they train)


def grant_plan(state: JobState, grant: PoolGrant) -> GrantPlan:
    """Shrink to the grant, on-demand nodes first when over the on-demand allowance, then the
    highest ranks, never the on-demand base; pause whole below the min; or order more."""
    target = max(state.target, min(state.ceiling, grant.nodes))
    allowed = target if state.spec.pool is None else min(target, grant.nodes)
    alive = [n for n in state.nodes if n.alive]
    extra_on_demand = max(0, sum(n.lifecycle == "on-demand" for n in alive) - grant.on_demand)
    removable = [n for n in removal_order(state) if not n.base]
    victims = [n for n in removable if n.lifecycle == "on-demand"][:extra_on_demand]
    victims += [n for n in removable if n not in victims][
        : max(0, len(alive) - grant.nodes - len(victims))
    ]
    return GrantPlan(
        target=target,
        preempt=grant.nodes < state.spec.elastic.min_nodes,
        admit=state.phase == Phase.QUEUED,
        owed=allowed - state.spec.on_demand.base_nodes,
        victims=victims,
    )


def pool_report(state: JobState) -> PoolReport:
    """The job's claim and holdings, as its pool sees them (`seq` is numbered on sending)."""
    spec, pool = state.spec, state.spec.pool
    assert pool is not None
    types = spec.spot.instance_types
    alive = [n for n in state.nodes if n.alive]
    on_demand_cap = spec.elastic.max_nodes if spec.on_demand.fallback else 0
    if spec.on_demand.max_nodes is not None:
        on_demand_cap = min(on_demand_cap, spec.on_demand.max_nodes)
    return PoolReport(
        job=spec.name,
        seq=0,
        claiming=state.phase.claims_capacity,
        priority=spec.priority,
        team=pool.team,
        preemptible=pool.preemptible,
        min_nodes=max(spec.elastic.min_nodes, spec.on_demand.base_nodes),
        max_nodes=state.ceiling,
        gpus_per_node=next_need(state)[0]
        if spec.total_gpus is None
        else max(t.gpus for t in types),
        spot_price=max(t.spot_price or t.on_demand_price for t in types),
        on_demand_price=max(t.on_demand_price for t in types),
        min_on_demand=spec.on_demand.base_nodes,
        max_on_demand=max(spec.on_demand.base_nodes, on_demand_cap),
        all_on_demand=not spec.spot.enabled,
        progress=math.floor(20 * state.step / spec.total_steps) / 20,
        holding=len(alive),
        holding_on_demand=sum(n.lifecycle == "on-demand" for n in alive),
        allowance=state.grant.nodes if state.grant else 0,
        allowance_on_demand=state.grant.on_demand if state.grant else 0,
        grant_seq=state.grant.seq if state.grant else 0,
    )
