"""How a capacity pool shares its quota among jobs, as pure functions: no I/O, no clocks.

The `CapacityPool` workflow asks; this module answers, so every rule is property-tested:

- A job runs at its min or more, or not at all (queued): it never starts below its min.
- Admission goes by priority, then arrival (FIFO) within a priority. A job that does not fit
  holds back every job behind it, so a big job is never starved by small ones slipping past.
- A running job keeps its min, unless a job of higher priority needs it and the job is
  preemptible; then it is paused whole (after a checkpoint). Equal priority never preempts.
- Nodes above the mins go to running jobs by priority and then progress (the job further
  along in training first), only while nobody of higher priority waits, and only while the
  pool's and the job's team's budgets (USD per hour) allow: over budget, a job does not grow.
- Grants never add up to more than the quota, in nodes, GPUs or on-demand nodes.

`allocate` says where the pool should be; `issue` says how far it may go right now: a grant
is lowered at once, but raised only into capacity that no job still holds or may still use.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Quota:
    """A pool's limits; None means no limit of that kind."""

    nodes: int | None = None
    gpus: int | None = None
    on_demand: int | None = None
    cost_per_hour: float | None = None
    team_cost_per_hour: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Claim:
    """What one job asks of the pool, and where it stands."""

    job: str
    priority: int
    arrival: int  # FIFO order within a priority
    min_nodes: int
    max_nodes: int
    gpus_per_node: int = 0
    spot_price: float = 0.0  # USD/h of one spot node
    on_demand_price: float = 0.0  # USD/h of one on-demand node
    min_on_demand: int = 0  # on-demand nodes it cannot run without (its base)
    max_on_demand: int = 0  # on-demand nodes it may use at most (base + fallback)
    all_on_demand: bool = False  # spot disabled: every node is on-demand
    team: str | None = None
    progress: float = 0.0  # fraction of its training done
    preemptible: bool = False  # may be paused whole for a higher priority
    running: bool = False  # admitted: holds (or was granted) its min


@dataclass(frozen=True)
class Grant:
    """Nodes a job may hold, and how many of them may be on-demand."""

    nodes: int = 0
    on_demand: int = 0

    def cost(self, claim: Claim) -> float:
        return (self.nodes - self.on_demand) * claim.spot_price + (
            self.on_demand * claim.on_demand_price
        )


NOTHING = Grant()


def floor(claim: Claim) -> Grant:
    """The least a job runs on."""
    od = claim.min_nodes if claim.all_on_demand else claim.min_on_demand
    return Grant(claim.min_nodes, od)


def never_fits(claim: Claim, quota: Quota) -> str | None:
    """Why the job could never run in this pool, even alone (None: it could)."""
    need = floor(claim)
    if quota.nodes is not None and need.nodes > quota.nodes:
        return f"needs {need.nodes} node(s) at its min; the pool's quota is {quota.nodes}"
    if quota.gpus is not None and need.nodes * claim.gpus_per_node > quota.gpus:
        return (
            f"needs {need.nodes * claim.gpus_per_node} GPU(s) at its min; "
            f"the pool's quota is {quota.gpus}"
        )
    if quota.on_demand is not None and need.on_demand > quota.on_demand:
        return (
            f"needs {need.on_demand} on-demand node(s) at its min; "
            f"the pool's on-demand quota is {quota.on_demand}"
        )
    return None


@dataclass
class _Room:
    """What is left of a quota; a limit of None is unlimited."""

    nodes: float
    gpus: float
    on_demand: float

    @classmethod
    def of(cls, quota: Quota) -> _Room:
        def limit(value: int | None) -> float:
            return math.inf if value is None else value

        return cls(limit(quota.nodes), limit(quota.gpus), limit(quota.on_demand))

    def fits(self, claim: Claim, nodes: int, on_demand: int) -> bool:
        return (
            nodes <= self.nodes
            and nodes * claim.gpus_per_node <= self.gpus
            and on_demand <= self.on_demand
        )

    def take(self, claim: Claim, nodes: int, on_demand: int) -> None:
        self.nodes -= nodes
        self.gpus -= nodes * claim.gpus_per_node
        self.on_demand -= on_demand


def admission_order(claims: Iterable[Claim]) -> list[Claim]:
    """Priority first; within a priority running jobs (never preempted by an equal), then
    arrival."""
    return sorted(claims, key=lambda c: (-c.priority, not c.running, c.arrival))


def allocate(claims: list[Claim], quota: Quota) -> dict[str, Grant]:
    """Where the pool should be: each job's grant (NOTHING: queued, or preempted)."""
    room = _Room.of(quota)
    grants = {c.job: NOTHING for c in claims}

    # 1. Mins. A running job that may not be preempted keeps its min whatever arrives.
    for c in claims:
        if c.running and not c.preemptible:
            grants[c.job] = floor(c)
            room.take(c, *_pair(floor(c)))
    someone_waits = False
    for c in admission_order(claims):
        if grants[c.job] != NOTHING or (someone_waits and not c.running):
            continue
        need = floor(c)
        if room.fits(c, *_pair(need)):
            grants[c.job] = need
            room.take(c, *_pair(need))
        elif not c.running:
            someone_waits = True  # no queue jumping behind it

    # 2. Above the mins: by priority, then progress, while nobody more urgent waits and the
    # budgets allow. Each extra node is spot, unless the job runs on on-demand only.
    waiting = [c.priority for c in claims if grants[c.job] == NOTHING]
    top_waiting = max(waiting, default=None)
    growers = sorted(
        (
            c
            for c in claims
            if grants[c.job] != NOTHING and (top_waiting is None or c.priority >= top_waiting)
        ),
        key=lambda c: (-c.priority, -c.progress, c.arrival),
    )
    budget = _Budget(quota, claims, grants)
    for c in growers:
        while grants[c.job].nodes < c.max_nodes:
            more = Grant(1, 1 if c.all_on_demand else 0)
            price = c.on_demand_price if c.all_on_demand else c.spot_price
            if not (room.fits(c, *_pair(more)) and budget.allows(c, price)):
                break
            room.take(c, *_pair(more))
            budget.spend(c, price)
            grants[c.job] = _add(grants[c.job], more)

    # 3. On-demand fallback allowance for spot jobs, in the same order and under the budgets.
    for c in growers:
        if c.all_on_demand:
            continue
        while grants[c.job].on_demand < min(c.max_on_demand, grants[c.job].nodes):
            extra = c.on_demand_price - c.spot_price
            if not (room.fits(c, 0, 1) and budget.allows(c, extra)):
                break
            room.take(c, 0, 1)
            budget.spend(c, extra)
            grants[c.job] = _add(grants[c.job], Grant(0, 1))
    return grants


class _Budget:
    """Cost per hour of the grants so far, against the pool's and each team's cap."""

    def __init__(self, quota: Quota, claims: list[Claim], grants: Mapping[str, Grant]) -> None:
        self.quota = quota
        self.pool = sum(grants[c.job].cost(c) for c in claims)
        self.teams: dict[str | None, float] = {}
        for c in claims:
            self.teams[c.team] = self.teams.get(c.team, 0.0) + grants[c.job].cost(c)

    def allows(self, claim: Claim, more: float) -> bool:
        cap = self.quota.cost_per_hour
        team_cap = self.quota.team_cost_per_hour.get(claim.team or "")
        return (cap is None or self.pool + more <= cap + 1e-9) and (
            team_cap is None or self.teams[claim.team] + more <= team_cap + 1e-9
        )

    def spend(self, claim: Claim, more: float) -> None:
        self.pool += more
        self.teams[claim.team] += more


def issue(
    claims: list[Claim],
    ideal: Mapping[str, Grant],
    issued: Mapping[str, Grant],
    committed: Mapping[str, Grant],
    quota: Quota,
) -> dict[str, Grant]:
    """The grants to send now. `committed`: per job, the most it holds or may still use (its
    holding, the allowance it acts on, any grant it has not yet acknowledged). A grant goes
    down at once; it goes up only into room the other jobs' commitments leave, and a queued
    job is admitted only once its whole min fits."""
    new = {c.job: _min(issued.get(c.job, NOTHING), ideal[c.job]) for c in claims}
    usage = {c.job: _max(committed.get(c.job, NOTHING), new[c.job]) for c in claims}
    by_job = {c.job: c for c in claims}
    for c in admission_order(claims):
        want = ideal[c.job]
        if want.nodes <= new[c.job].nodes and want.on_demand <= new[c.job].on_demand:
            continue
        room = _Room.of(quota)
        for other, used in usage.items():
            if other != c.job:
                room.take(by_job[other], *_pair(used))
        mine = usage[c.job]
        nodes = max(new[c.job].nodes, min(want.nodes, _most(room, c)))
        od = max(new[c.job].on_demand, min(want.on_demand, nodes, room.on_demand))
        if nodes < c.min_nodes or od < floor(c).on_demand:
            continue  # not admitted until its min fits whole
        new[c.job] = Grant(nodes, od)
        usage[c.job] = _max(mine, new[c.job])
    return new


def _most(room: _Room, claim: Claim) -> int:
    """The most nodes the job may hold in the room the other jobs leave."""
    most = room.nodes
    if claim.gpus_per_node:
        most = min(most, room.gpus // claim.gpus_per_node)
    return claim.max_nodes if most == math.inf else int(min(most, claim.max_nodes))


def usage_total(claims: Iterable[Claim], used: Mapping[str, Grant]) -> dict[str, float]:
    """Nodes, GPUs, on-demand nodes and cost per hour that `used` adds up to."""
    total = {"nodes": 0.0, "gpus": 0.0, "on_demand": 0.0, "cost_per_hour": 0.0}
    for c in claims:
        g = used.get(c.job, NOTHING)
        total["nodes"] += g.nodes
        total["gpus"] += g.nodes * c.gpus_per_node
        total["on_demand"] += g.on_demand
        total["cost_per_hour"] += g.cost(c)
    return total


def _pair(g: Grant) -> tuple[int, int]:
    return g.nodes, g.on_demand


def _add(a: Grant, b: Grant) -> Grant:
    return Grant(a.nodes + b.nodes, a.on_demand + b.on_demand)


def _min(a: Grant, b: Grant) -> Grant:
    return Grant(min(a.nodes, b.nodes), min(a.on_demand, b.on_demand))


def _max(a: Grant, b: Grant) -> Grant:
    return Grant(max(a.nodes, b.nodes), max(a.on_demand, b.on_demand))
