"""Stragglers: ranks whose steps take far longer than their own history predicts, and ranks
that stopped stepping while their peers go on. Pure decisions over the step times every rank
leaves in the store (workers/elastic/step_times.py), which the runtimes' watch carries to the
workflow as `RankSteps`.

A rank is slow when its recent step time is more than `slowdown` times its usual one (the
median of its first steps after the warm-up) AND, if it has peers, more than `slowdown` times
the median of their recent step times: a job-wide slowdown (a slower data source, a bigger
batch) slows every rank alike and points at no node. A rank is hung when it reported no step
for `stall_timeout_s` while some peer did, or, once the whole job stalled, when it is stuck in
its own work (`elastic.busy()`) while a peer waits outside its own. A slow rank's node is
replaced once it stayed slow `patience_s`; a hung rank's at once (it already waited the stall
timeout).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from spotrain.workflows.spec import StragglerPolicy

if TYPE_CHECKING:  # (the job's state holds this module's Straggler)
    from spotrain.workflows.job.state import NodeRecord


class RankSteps(BaseModel):
    """One rank's step times as a watch read them from the store."""

    rank: int
    step: int
    since_step_s: float = Field(description="seconds since its last report, when read")
    recent_s: float | None = Field(None, description="median of its latest step times")
    usual_s: float | None = Field(None, description="median of its first steps' times")
    busy_s: float | None = Field(
        None, description="seconds in its own work since it last stepped, if stuck in it"
    )

    @classmethod
    def of(cls, rank: int, record: dict[str, Any], now: float) -> RankSteps:
        """From the store's record (epoch `time`), its age as of `now` (epoch seconds)."""
        return cls(
            rank=rank,
            step=record["step"],
            since_step_s=max(0.0, now - record["time"]),
            recent_s=record.get("recent_s"),
            usual_s=record.get("usual_s"),
            busy_s=None if record.get("busy_since") is None else now - record["busy_since"],
        )


class Straggler(BaseModel):
    """A flagged rank of the running generation, and the node it runs on."""

    generation: int
    rank: int
    node_id: str
    since: datetime = Field(description="flagged since (the patience counts from here)")
    why: str
    hung: bool = False


def slow_ranks(ranks: list[RankSteps], slowdown: float) -> dict[int, str]:
    """rank -> why, for ranks slower than `slowdown` times their own usual step time and
    (with peers) than their peers' recent median."""
    recent = {r.rank: r.recent_s for r in ranks if r.recent_s is not None}
    found = {}
    for r in ranks:
        if r.recent_s is None or not r.usual_s:
            continue
        own = r.recent_s / r.usual_s
        peers = [s for rank, s in recent.items() if rank != r.rank]
        typical = statistics.median(peers) if peers else None
        if own <= slowdown or (typical is not None and r.recent_s <= slowdown * typical):
            continue
        why = f"steps take {r.recent_s:.3g}s, {own:.1f}x its usual {r.usual_s:.3g}s"
        if typical:
            why += f" and {r.recent_s / typical:.1f}x its peers' {typical:.3g}s"
        found[r.rank] = why
    return found


def hung_ranks(ranks: list[RankSteps], stall_s: float, job_stalled: bool) -> dict[int, str]:
    """rank -> why, for ranks with no step for `stall_s` while some peer stepped within it;
    and, once the whole job stalled, a rank stuck in its own work while a peer waits outside
    its own (in lockstep training: in the collective the stuck rank never reaches)."""
    stepping = sum(r.since_step_s <= stall_s for r in ranks)
    waiting = sum(r.busy_s is None for r in ranks)
    found = {}
    for r in ranks:
        if stepping and r.since_step_s > stall_s:
            found[r.rank] = (
                f"no step for {r.since_step_s:.0f}s (at step {r.step}) while "
                f"{stepping} peer(s) step"
            )
        elif job_stalled and r.busy_s is not None and waiting:
            found[r.rank] = (
                f"stuck in its own work for {r.busy_s:.0f}s (at step {r.step}) while "
                f"{waiting} peer(s) wait"
            )
    return found


def rank_nodes(members: list[NodeRecord]) -> list[str]:
    """Each rank's node, by rank: the runtime numbers ranks node by node in member order,
    `procs` to a node (so with two to a node, rank 3 runs on the second node)."""
    return [n.node_id or "" for n in members for _ in range(n.procs)]


@dataclass(frozen=True)
class Assessment:
    flags: list[Straggler]  # the generation's stragglers now
    raised: list[Straggler]  # flagged by this watch
    cleared: list[Straggler]  # no longer slow or hung
    replace: list[str]  # node ids to replace now, in rank order


def assess(
    policy: StragglerPolicy,
    stall_s: float,
    generation: int,
    ranks: list[RankSteps],
    rank_nodes: list[str],
    flags: list[Straggler],
    now: datetime,
    job_stalled: bool = False,
) -> Assessment:
    """The running generation's stragglers after a watch (`rank_nodes`: each rank's node;
    `job_stalled`: no progress for `stall_s`), carrying over when each was first flagged; the
    nodes due for replacement."""
    before = {f.rank: f for f in flags if f.generation == generation}
    hung = hung_ranks(ranks, stall_s, job_stalled)
    found = slow_ranks(ranks, policy.slowdown) | hung
    current = [
        Straggler(
            generation=generation,
            rank=rank,
            node_id=rank_nodes[rank],
            since=before[rank].since if rank in before else now,
            why=why,
            hung=rank in hung,
        )
        for rank, why in sorted(found.items())
        if rank < len(rank_nodes)
    ]
    due = [f for f in current if f.hung or (now - f.since).total_seconds() >= policy.patience_s]
    return Assessment(
        flags=current,
        raised=[f for f in current if f.rank not in before],
        cleared=[f for f in before.values() if f.rank not in found],
        replace=list(dict.fromkeys(f.node_id for f in due)) if policy.replace else [],
    )
