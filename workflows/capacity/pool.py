"""The `CapacityPool` workflow: one shared quota of nodes, GPUs and dollars per hour, and the
queue of jobs that draw on it.

A pool is a long-lived entity workflow (id `pool:NAME`). Jobs that name it in their spec
signal `report` with their claim and what they hold; the pool answers each with a `grant`
signal: how many nodes (and of them on-demand) the job may hold now. The job shrinks
gracefully when its grant goes down (the checkpoint-then-scale-in path of `scale_in`), pauses
whole when it goes to zero, and grows when it goes up. The rules live in the pure
`allocation` module; this workflow keeps the books and makes sure that at no instant the
nodes jobs hold or may still use add up to more than the quota: a grant is raised only once
every lowered one has been acknowledged (or the job's report shows the nodes released).

All of it is workflow state: a controller crash or redeploy changes nothing.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field, model_validator
from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.capacity import allocation
    from spotrain.workflows.capacity.allocation import Claim, Grant
    from spotrain.workflows.contract import Message, PoolGrant, PoolReport
    from spotrain.workflows.history import history_is_long
    from spotrain.workflows.spec import NAME_PATTERN

TIMELINE_KEPT = 200


POOL_ID_PREFIX = "pool:"  # job names are DNS labels: a pool's id never collides with a job's


def pool_workflow_id(name: str) -> str:
    return POOL_ID_PREFIX + name


class PoolConfig(Message):
    """A pool's quota and budgets: the workflow's input, changed later with `configure`."""

    name: str = Field(pattern=NAME_PATTERN)
    max_nodes: int | None = Field(None, ge=0, description="None: no limit")
    max_gpus: int | None = Field(None, ge=0)
    max_on_demand_nodes: int | None = Field(None, ge=0)
    max_cost_per_hour: float | None = Field(None, ge=0, description="USD/h: caps growth")
    team_budgets: dict[str, float] = Field(
        default_factory=dict, description="team -> USD/h: caps that team's jobs' growth"
    )
    liveness_check_s: float = Field(
        300, gt=0, description="while jobs queue, how often to check that holders still run"
    )

    @model_validator(mode="after")
    def _budgets(self) -> PoolConfig:
        bad = sorted(team for team, cap in self.team_budgets.items() if cap < 0)
        if bad:
            raise ValueError(f"team_budgets must not be negative: {', '.join(bad)}")
        return self

    @property
    def quota(self) -> allocation.Quota:
        return allocation.Quota(
            nodes=self.max_nodes,
            gpus=self.max_gpus,
            on_demand=self.max_on_demand_nodes,
            cost_per_hour=self.max_cost_per_hour,
            team_cost_per_hour=self.team_budgets,
        )


class Allowance(BaseModel):
    nodes: int = 0
    on_demand: int = 0

    @property
    def grant(self) -> Grant:
        return Grant(self.nodes, self.on_demand)

    @classmethod
    def of(cls, grant: Grant) -> Allowance:
        return cls(nodes=grant.nodes, on_demand=grant.on_demand)


class Member(BaseModel):
    """The pool's book on one job."""

    report: PoolReport
    arrival: int
    issued: Allowance = Field(default_factory=Allowance)
    issued_seq: int = 0
    unacked: list[PoolGrant] = Field(
        default_factory=list, description="grants sent that the job has not reported applying"
    )

    def claim(self) -> Claim:
        r = self.report
        return Claim(
            job=r.job,
            priority=r.priority,
            arrival=self.arrival,
            min_nodes=r.min_nodes,
            max_nodes=r.max_nodes,
            gpus_per_node=r.gpus_per_node,
            spot_price=r.spot_price,
            on_demand_price=r.on_demand_price,
            min_on_demand=r.min_on_demand,
            max_on_demand=r.max_on_demand,
            all_on_demand=r.all_on_demand,
            team=r.team,
            progress=r.progress,
            preemptible=r.preemptible,
            running=self.issued.nodes >= r.min_nodes,
        )

    def committed(self) -> Grant:
        """The most the job holds or may still use: what it holds, the allowance it acts
        on, and any grant it may not have applied yet."""
        r = self.report
        nodes = max([r.holding, r.allowance, self.issued.nodes, *(g.nodes for g in self.unacked)])
        od = max(
            [
                r.holding_on_demand,
                r.allowance_on_demand,
                self.issued.on_demand,
                *(g.on_demand for g in self.unacked),
            ]
        )
        return Grant(nodes, od)


class PoolEvent(BaseModel):
    time: datetime
    event: str
    detail: str = ""


class PoolState(BaseModel):
    config: PoolConfig
    members: dict[str, Member] = Field(default_factory=dict)
    next_arrival: int = 0
    next_seq: int = 1
    peak: dict[str, float] = Field(
        default_factory=dict, description="the most ever committed, per resource"
    )
    timeline: list[PoolEvent] = Field(default_factory=list)
    runs: int = 1

    def record(self, now: datetime, event: str, detail: str = "") -> None:
        entry = PoolEvent(time=now, event=event, detail=detail)
        self.timeline = [*self.timeline[-(TIMELINE_KEPT - 1) :], entry]


class PoolJobView(BaseModel):
    job: str
    state: Literal["running", "queued", "shrinking"]
    priority: int
    team: str | None
    arrival: int
    min_nodes: int
    max_nodes: int
    granted: int
    granted_on_demand: int
    holding: int
    holding_on_demand: int
    progress: float


class PoolStatus(BaseModel):
    """The `status` query's answer."""

    config: PoolConfig
    usage: dict[str, float] = Field(description="committed now: nodes, gpus, on_demand, cost")
    peak: dict[str, float]
    jobs: list[PoolJobView]
    timeline: list[PoolEvent]


@workflow.defn(name="CapacityPool")
class CapacityPool:
    @workflow.init
    def __init__(self, config: PoolConfig, carried: PoolState | None = None) -> None:
        self.s = carried or PoolState(config=config)
        self._dirty = True

    @workflow.run
    async def run(self, config: PoolConfig, carried: PoolState | None = None) -> None:
        s = self.s
        if carried is None:
            s.record(workflow.now(), "created", self._describe_quota())
        while True:
            try:
                await workflow.wait_condition(lambda: self._dirty, timeout=self._liveness_timeout())
            except TimeoutError:
                await self._check_liveness()
            self._dirty = False
            await self._rebalance()
            if history_is_long():
                await workflow.wait_condition(workflow.all_handlers_finished)
                if not self._dirty:
                    s.runs += 1
                    workflow.continue_as_new(args=[s.config, s])

    # --- the interface jobs and users call ---------------------------------------------------

    @workflow.signal(name="report")
    def report(self, r: PoolReport) -> None:
        s = self.s
        member = s.members.get(r.job)
        if member is not None and r.seq <= member.report.seq:
            return  # stale
        if not r.claiming:
            if member is not None:
                del s.members[r.job]
                s.record(workflow.now(), "left", r.job)
                self._dirty = True
            return
        if member is None:
            member = Member(report=r, arrival=s.next_arrival)
            s.next_arrival += 1
            s.members[r.job] = member
            s.record(
                workflow.now(),
                "claim",
                f"{r.job}: {r.min_nodes}..{r.max_nodes} nodes, priority {r.priority}",
            )
        member.report = r
        member.unacked = [g for g in member.unacked if g.seq > r.grant_seq]
        self._dirty = True

    @workflow.update(name="configure")
    def configure(self, config: PoolConfig) -> str:
        self.s.config = config
        self.s.record(workflow.now(), "configured", self._describe_quota())
        self._dirty = True
        return f"pool {config.name}: {self._describe_quota()}"

    @configure.validator
    def _check_configure(self, config: PoolConfig) -> None:
        if config.name != self.s.config.name:
            raise ValueError(f"this is pool {self.s.config.name!r}, not {config.name!r}")

    @workflow.query(name="status")
    def status(self) -> PoolStatus:
        s = self.s
        jobs = []
        for m in sorted(s.members.values(), key=lambda m: m.arrival):
            r = m.report
            state = "queued" if m.issued.nodes < r.min_nodes else "running"
            if r.holding > m.issued.nodes:
                state = "shrinking"
            jobs.append(
                PoolJobView(
                    job=r.job,
                    state=state,
                    priority=r.priority,
                    team=r.team,
                    arrival=m.arrival,
                    min_nodes=r.min_nodes,
                    max_nodes=r.max_nodes,
                    granted=m.issued.nodes,
                    granted_on_demand=m.issued.on_demand,
                    holding=r.holding,
                    holding_on_demand=r.holding_on_demand,
                    progress=r.progress,
                )
            )
        return PoolStatus(
            config=s.config, usage=self._usage(), peak=s.peak, jobs=jobs, timeline=s.timeline
        )

    # --- keeping the books -------------------------------------------------------------------

    async def _rebalance(self) -> None:
        """Work out where the pool should be, issue what may be issued now, tell the jobs."""
        s = self.s
        quota = s.config.quota
        members = list(s.members.values())
        claims = [m.claim() for m in members]
        refusals = {c.job: allocation.never_fits(c, quota) for c in claims}
        fitting = [c for c in claims if refusals[c.job] is None]
        ideal = allocation.allocate(fitting, quota)
        new = allocation.issue(
            fitting,
            ideal,
            {m.report.job: m.issued.grant for m in members},
            {m.report.job: m.committed() for m in members},
            quota,
        )
        sends = []
        for m in members:
            job = m.report.job
            if refusals[job] is not None:
                sends.append(self._refuse(m, str(refusals[job])))
            elif new[job] != m.issued.grant:
                sends.append(self._grant(m, new[job]))
        if sends:
            await asyncio.gather(*sends)
        self._note_usage()

    async def _grant(self, m: Member, grant: Grant) -> None:
        s = self.s
        before, job = m.issued.grant, m.report.job
        message = PoolGrant(seq=s.next_seq, nodes=grant.nodes, on_demand=grant.on_demand)
        s.next_seq += 1
        m.issued, m.issued_seq = Allowance.of(grant), message.seq
        m.unacked.append(message)
        s.record(
            workflow.now(),
            _verb(before, grant, m.report.min_nodes),
            f"{job}: {before.nodes} -> {grant.nodes} node(s), {grant.on_demand} on-demand",
        )
        await self._send(job, message)

    async def _refuse(self, m: Member, why: str) -> None:
        del self.s.members[m.report.job]
        self.s.record(workflow.now(), "refused", f"{m.report.job}: {why}")
        msg = PoolGrant(seq=self.s.next_seq, nodes=0, on_demand=0, refused=why)
        self.s.next_seq += 1
        await self._send(m.report.job, msg)

    async def _send(self, job: str, grant: PoolGrant) -> None:
        """Signal the job; a job that has ended is struck off (its nodes are released)."""
        try:
            await workflow.get_external_workflow_handle(job).signal("grant", grant)
        except ApplicationError as err:
            if job in self.s.members:
                del self.s.members[job]
                self.s.record(workflow.now(), "gone", f"{job}: {err.message}")
                self._dirty = True

    def _liveness_timeout(self) -> timedelta | None:
        """While someone queues, holders are checked now and then: a job that was terminated
        (no cleanup runs) must not keep its share forever."""
        queued = any(m.issued.nodes < m.report.min_nodes for m in self.s.members.values())
        return timedelta(seconds=self.s.config.liveness_check_s) if queued else None

    async def _check_liveness(self) -> None:
        holders = [m for m in self.s.members.values() if m.issued.nodes]
        # The current grant again: a job ignores a grant it has seen (same seq).
        await asyncio.gather(
            *(
                self._send(
                    m.report.job,
                    PoolGrant(seq=m.issued_seq, nodes=m.issued.nodes, on_demand=m.issued.on_demand),
                )
                for m in holders
            )
        )

    def _usage(self) -> dict[str, float]:
        members = list(self.s.members.values())
        return allocation.usage_total(
            [m.claim() for m in members], {m.report.job: m.committed() for m in members}
        )

    def _note_usage(self) -> None:
        s = self.s
        usage = self._usage()
        s.peak = {k: max(v, s.peak.get(k, 0.0)) for k, v in usage.items()}
        running = [m.report.job for m in s.members.values() if m.issued.nodes]
        queued = [m.report.job for m in s.members.values() if not m.issued.nodes]
        workflow.set_current_details(
            f"**{usage['nodes']:.0f}** nodes in use ({self._describe_quota()}), "
            f"${usage['cost_per_hour']:.2f}/h\n\n"
            f"running: {', '.join(running) or '-'}\n\nqueued: {', '.join(queued) or '-'}"
        )

    def _describe_quota(self) -> str:
        c = self.s.config
        parts = [
            f"{label} {value}"
            for label, value in (
                ("max nodes", c.max_nodes),
                ("max GPUs", c.max_gpus),
                ("max on-demand", c.max_on_demand_nodes),
                ("max $/h", c.max_cost_per_hour),
            )
            if value is not None
        ]
        parts += [f"team {t} max $/h {v}" for t, v in sorted(c.team_budgets.items())]
        return ", ".join(parts) or "no limits"


def _verb(before: Grant, after: Grant, min_nodes: int) -> str:
    """What a grant change does to the job, for the pool's timeline."""
    if before.nodes < min_nodes <= after.nodes:
        return "admit"
    if after.nodes > before.nodes:
        return "grow"
    if after.nodes == 0:
        return "preempt"
    return "shrink" if after.nodes < before.nodes else "on-demand allowance"
