"""Make-before-break: replace a warned node before it goes, in one resize instead of two.

Without it, every reclaim costs two resizes: a shrink on the notice, and a growth once the
replacement is ready. With `elastic.early_warning: make_before_break` (a rebalance
recommendation, a scheduled retirement) or `elastic.reclaim_notice: make_before_break`, the
job orders the replacement at once and keeps training at full size; when the replacement is
ready, one resize at a checkpoint moves the membership onto it (N -> N) and the warned node is
released. A reclaim notice whose replacement is not ready by the deadline minus the observed
checkpoint p99 shrinks as before, and the replacement joins later by growth.

The overlap never takes the job above `max_nodes + max_surge_nodes` nodes held, nor above its
pool's grant; it is billed like any node (node-hours from ready until released). Pure
functions like `job_planner`: state in, plan out; the workflow's `Swapper` applies them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from spotrain.workflows.contract import Offer
from spotrain.workflows.job.events import WARNINGS, Reclaim
from spotrain.workflows.job.planner import grace_for_notice
from spotrain.workflows.job.state import JobState, NodeRecord, NodeState, Swap

NOTICE_MARGIN_S = 5.0  # the checkpoint must end this long before the deadline (as a shrink's)


def held_cap(state: JobState) -> int:
    """The most nodes the job may hold while replacements overlap warned nodes."""
    e = state.spec.elastic
    cap = e.max_nodes + e.max_surge_nodes
    if state.spec.pool is not None:
        cap = min(cap, state.grant.nodes if state.grant else 0)
    return cap


def pending(state: JobState) -> list[Swap]:
    """The open swaps: those whose warned node the job still holds."""
    alive = {n.node_id for n in state.nodes if n.alive}
    return [w for w in state.swaps if w.node_id in alive]


def wanted(state: JobState) -> int:
    """Nodes the job wants to hold: what it is allowed, plus a replacement per open swap
    (within `held_cap`)."""
    extra = min(len(pending(state)), max(0, held_cap(state) - state.allowed))
    return state.allowed + extra


def away_from_warned(state: JobState, offers: list[Offer]) -> list[Offer]:
    """Offers outside the pools of open swaps' warned nodes (a rebalance recommendation says
    that pool is at risk), unless no other pool has any: replacements go elsewhere."""
    warned = {(n.instance_type, n.zone) for n in state.nodes if n.node_id in _open_ids(state)}
    elsewhere = [o for o in offers if (o.instance_type, o.zone) not in warned]
    return elsewhere or offers


def _open_ids(state: JobState) -> set[str]:
    return {w.node_id for w in pending(state)}


def spares(state: JobState) -> list[NodeRecord]:
    """Ready nodes outside the generation that no swap warned about: replacements, spot first."""
    warned = {w.node_id for w in state.swaps}
    ready = [
        n
        for n in state.nodes
        if n.state == NodeState.READY and n.slot not in state.members and n.node_id not in warned
    ]
    return sorted(ready, key=lambda n: (n.lifecycle != "spot", n.slot))


def checkpoint_s(state: JobState) -> float:
    """How long a checkpoint takes: the observed p99, else the graceful timeout (the most a
    checkpoint may take) until one was observed."""
    stats = state.checkpoints
    if stats is not None and stats.count:
        return stats.p99_s
    return state.spec.elastic.graceful_shutdown_timeout_s


def swap_by(state: JobState, deadline: datetime) -> datetime:
    """The last moment to start checkpointing off a node reclaimed at `deadline`: later than
    this, waiting for its replacement risks the checkpoint."""
    return deadline - timedelta(seconds=NOTICE_MARGIN_S + checkpoint_s(state))


WarningAction = Literal["pass", "order", "deadline", "known", "no room"]


@dataclass(frozen=True)
class WarningPlan:
    """What a warning or notice does make-before-break. "pass": the usual reclaim path
    decides; "order": a replacement is ordered ahead; "deadline": an open swap learns its
    node's deadline; "known": a repeated warning; "no room": a warning whose overlap would
    exceed the cap for now: its replacement is ordered once a swap or a loss makes room,
    and training goes on meanwhile (a notice without room passes: it shrinks)."""

    action: WarningAction
    swaps: list[Swap]  # the open swaps afterwards
    detail: str = ""


def on_notice(state: JobState, event: Reclaim, now: datetime) -> WarningPlan:
    e = state.spec.elastic
    policy = e.warning_policy if event.kind in WARNINGS else e.reclaim_notice
    node = state.node_by_id(event.node_id)
    open_swaps = pending(state)
    known = next((w for w in open_swaps if w.node_id == event.node_id), None)
    others = [w for w in open_swaps if w.node_id != event.node_id]
    trains = node is not None and node.alive and state.running and node.slot in state.members
    if not trains or event.shrink or (policy != "make_before_break" and known is None):
        return WarningPlan("pass", others if event.shrink else open_swaps)
    name = event.node_id
    unclaimed = len(spares(state)) > len(open_swaps)
    # A scheduled change has its own deadline (its start time): the swap must beat it as a
    # notice's must, and a late replacement shrinks before it.
    dated = event.kind == "reclaim" or (event.kind == "scheduled" and event.deadline is not None)
    if dated:
        left = None if event.deadline is None else (event.deadline - now).total_seconds()
        timeout = e.graceful_shutdown_timeout_s
        if (
            event.deadline is None
            or left is None
            or grace_for_notice(left, timeout, NOTICE_MARGIN_S) <= 0
            or (swap_by(state, event.deadline) <= now and not unclaimed)
        ):
            return WarningPlan("pass", others)  # no time to wait for a replacement: shrink
        if known is not None:
            swap = known.model_copy(update={"deadline": event.deadline})
            return WarningPlan("deadline", [*others, swap], f"{name}: swap by {event.deadline}")
    elif known is not None:
        return WarningPlan("known", open_swaps)
    room = held_cap(state) - wanted(state) >= 1 or unclaimed
    if not room and event.kind == "reclaim":
        return WarningPlan("pass", open_swaps)  # no room for the overlap: shrink
    deadline = event.deadline if dated else None
    swaps = [*open_swaps, Swap(node_id=name, deadline=deadline, since=now)]
    if not room:  # `wanted` orders it once a swap or a loss makes room
        return WarningPlan("no room", swaps, f"{name}: holding {held_cap(state)} node(s) already")
    return WarningPlan("order", swaps, f"replacement ordered ahead of {name}")


def leaving_with(state: JobState, event: Reclaim) -> list[Swap]:
    """The open notices that leave in the same resize as `event`'s shrink: their replacement
    is not ready either (or they would have swapped), and a resize now beats one more later."""
    node = state.node_by_id(event.node_id)
    trains = node is not None and node.alive and state.running and node.slot in state.members
    if event.kind != "reclaim" or not trains:
        return []
    return [w for w in pending(state) if w.deadline is not None and w.node_id != event.node_id]


@dataclass(frozen=True)
class SwapStep:
    """What open swaps need now: `pairs` (warned member, ready replacement) swap in one
    resize, checkpointing within `grace` (as many as are ready: while more replacements are
    launching, it waits for them until a notice cannot wait); `late` notices shrink as
    usual; `wake`: when the next open notice's replacement becomes late."""

    pairs: list[tuple[NodeRecord, NodeRecord]] = field(default_factory=list)
    late: list[Swap] = field(default_factory=list)
    swaps: list[Swap] = field(default_factory=list)  # still open afterwards
    grace: float = 0.0
    wake: datetime | None = None


def next_step(state: JobState, now: datetime) -> SwapStep:
    open_swaps = pending(state)
    if not state.running:
        return SwapStep(swaps=open_swaps)
    timeout = state.spec.elastic.graceful_shutdown_timeout_s

    def grace(w: Swap) -> float:
        if w.deadline is None:
            return timeout
        return grace_for_notice((w.deadline - now).total_seconds(), timeout, NOTICE_MARGIN_S)

    held = {n.node_id: n for n in state.nodes if n.alive}
    members = [w for w in open_swaps if held[w.node_id].slot in state.members]
    urgent_first = sorted(members, key=lambda w: (w.deadline is None, w.deadline or now, w.since))
    doable = [w for w in urgent_first if grace(w) > 0]
    ready = spares(state)
    # Replacements still launching join the same resize, unless a notice cannot wait.
    launching = any(n.state == NodeState.REQUESTED for n in state.nodes)
    due = any(w.deadline is not None and swap_by(state, w.deadline) <= now for w in doable)
    pairs = list(zip(doable, ready, strict=False))
    if pairs and (not launching or len(ready) >= len(doable) or due):
        return SwapStep(
            pairs=[(held[w.node_id], spare) for w, spare in pairs],
            swaps=open_swaps,
            grace=min(grace(w) for w, _ in pairs),
        )
    late = [w for w in members if w.deadline is not None and swap_by(state, w.deadline) <= now]
    waiting = [swap_by(state, w.deadline) for w in members if w.deadline and w not in late]
    return SwapStep(
        late=late,
        swaps=[w for w in open_swaps if w not in late],
        wake=min(waiting, default=None),
    )
