"""Goodput and cost on real spot capacity traces: spotrain's real TrainingJob workflow versus
fixed-size restart baselines (with and without a checkpoint on the notice), all on-demand,
and the oracle, on the same trace and work.

    .venv/bin/python -m bench.goodput [--trace [ZONE=]PATH ...] [--work-node-hours 1000] ...

spotrain's rows come from the real workflow on the time-skipping test server, with the
simulated cloud (capacity = the trace) and runtime (the progress model) of
`activities/simulated.py`. When a zone's capacity falls, the benchmark plays the cloud: it
signals `reclaim` with a `--notice-s` deadline (0: `node_lost` at once, no notice) and takes
the node when the notice runs out. Growth is the workflow's own (its capacity checks). The
baselines are small pure-Python models over the same trace and progress model
(`model.py`); the deadline policies and their sweep are in `deadline_sweep.py`.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedCloud, SimulatedRuntime
from spotrain.workers.worker import workflow_worker
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    GenerationPlan,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)
from spotrain.workflows.job.state import JobResult, JobStatus

from ..common import publish, table
from .args import parse_args
from .harness import RowLog, RunFn, Wedged, check_not_skipped, on_fresh_server
from .live import lognormal_boot, measured_live_pauses, shown_path
from .model import (
    COLUMNS,
    Row,
    Setup,
    all_on_demand,
    fixed_at_available,
    fixed_restart,
    hop_seconds,
    no_capacity,
    one_zone_baselines,
    oracle,
    plot,
    ring_transfer,
    slowdown,
)
from .prices import price_table
from .rebalance import Recommendations

INSTANCE_TYPE = "p3.2xlarge"


WEDGED_AFTER = 3  # sleeps in a row that move server time no more


# --- spotrain: the real workflow on the time-skipping server ---------------------------------


class RecordingRuntime(SimulatedRuntime):
    """The simulated runtime with `setup`'s progress model (a ring across zones slowed by
    `cross_zone_slowdown`) and the product's measured live pauses for its state size,
    recording world size over time. `zone_of`: a node id's zone."""

    def __init__(self, setup: Setup, zone_of: Callable[[str], str]) -> None:
        self.setup, self.zone_of = setup, zone_of
        super().__init__(
            steps_per_hour=setup.steps_per_hour,
            checkpoint_every=setup.checkpoint_every,
            restart_cost_s=setup.restart_cost_s,
            checkpoint_s=setup.checkpoint_s,
            live=measured_live_pauses(setup.state_gb, setup.live_results)[0],
        )
        self.worlds: list[tuple[datetime, int]] = []
        self.rings: list[tuple[datetime, list[str]]] = []  # each generation's nodes, by rank

    def rate(self, plan: GenerationPlan) -> float:
        zones = [self.zone_of(m.node_id) for m in plan.members]
        return super().rate(plan) / slowdown(self.setup, zones)

    def _mark(self, world: int, nodes: list[str] | None = None) -> None:
        now = activity.info().current_attempt_scheduled_time
        self.worlds.append((now, world))
        self.rings.append((now, nodes or []))

    @activity.defn(name=contract.START_GENERATION)
    def start_generation(self, plan: GenerationPlan) -> None:
        super().start_generation(plan)
        self._mark(plan.world_size, [m.node_id for m in plan.members])

    @activity.defn(name=contract.STOP_GENERATION)
    def stop_generation(self, req: StopRequest) -> StopResult:
        result = super().stop_generation(req)
        self._mark(0)
        return result

    @activity.defn(name=contract.WATCH_GENERATION)
    def watch_generation(self, req: WatchRequest) -> WatchResult:
        result = super().watch_generation(req)
        if result.outcome == "completed":
            self._mark(0)
        return result


@dataclass
class Run:
    """One policy's job: the benchmark plays the cloud (the trace) around it."""

    env: WorkflowEnvironment
    setup: Setup
    cloud: SimulatedCloud
    runtime: RecordingRuntime
    task_queue: str
    t0: datetime
    rebalance: Recommendations | None = None  # sent ahead of drops (`setup.rebalance`)

    async def elapsed_s(self) -> float:
        return (await self.env.get_current_time() - self.t0).total_seconds()

    async def sleep_until(self, offset: float) -> None:
        """Skip server time to `offset`, a tick at a time: while a sleep skips, the test
        server may skip over a workflow task left pending (after workflow tasks timed out on
        a starved worker), and the task starts only once the sleep ends; one long sleep to
        the next drop left a 1-node job unseen for hours (`harness.skipped_over`). A
        sleep the SDK times out (CANCELLED) is retried while server time still moves; the
        test server wedged on a workflow task ("invalid history builder state for action")
        moves it no more: that raises `Wedged`."""
        stuck = 0
        while (wait := offset - (before := await self.elapsed_s())) > 0:
            try:
                await self.env.sleep(min(wait, self.setup.tick_s))
            except RPCError as err:
                if err.status != RPCStatusCode.CANCELLED:  # how the SDK reports its timeout
                    raise
                stuck = stuck + 1 if await self.elapsed_s() <= before else 0
                if stuck >= WEDGED_AFTER:
                    raise Wedged(f"server time stuck at {before:.0f} s") from err

    def _zones(self) -> dict[str, str]:
        return {node_id: n.info.zone for node_id, n in self.cloud.nodes.items()}

    async def start(self, spec: dict[str, Any]) -> WorkflowHandle[Any, JobResult]:
        return await self.env.client.start_workflow(
            "TrainingJob", spec, id=spec["name"], task_queue=self.task_queue, result_type=JobResult
        )

    async def drive(
        self,
        handle: WorkflowHandle[Any, Any],
        controller: Callable[[float], Any] | None = None,
    ) -> bool:
        """Reclaim nodes as the trace drops until the job closes (True), or until the
        controller returns None (False): it takes over from there."""
        horizon = 10 * max(t.span_s for t in self.setup.traces)
        drops = [(o, t.zone) for t in self.setup.traces for o in t.drops(horizon)]
        events = [(o, "drop", z, o) for o, z in drops]
        if self.rebalance is not None:
            events += [(w, "warn", z, o) for w, z, o in self.rebalance.warnings(drops)]
        events += [(0.0, "check", "", 0.0)] if controller else []
        heapq.heapify(events)
        reclaiming: set[str] = set()
        while events:
            offset, kind, what, at = heapq.heappop(events)
            await self.sleep_until(offset)
            if (await handle.describe()).status != WorkflowExecutionStatus.RUNNING:
                return True
            if kind == "warn" and self.rebalance is not None:
                await self._recommend(handle, what, (offset, at), reclaiming)
            elif kind == "drop":
                for node_id in self._victims(what, offset, reclaiming):
                    reclaiming.add(node_id)
                    if self.rebalance is not None:
                        self.rebalance.reclaimed(node_id, offset)
                    if self.setup.notice_s > 0:
                        deadline = await self.env.get_current_time() + timedelta(
                            seconds=self.setup.notice_s
                        )
                        notice = {"node_id": node_id, "deadline": deadline.isoformat()}
                        await handle.signal("reclaim", notice | {"event_id": f"r-{node_id}"})
                        gone = offset + self.setup.notice_s
                        heapq.heappush(events, (gone, "gone", node_id, gone))
                    else:
                        await self._take(handle, node_id)
            elif kind == "gone":
                await self._take(handle, what)
            elif controller is not None:
                next_check = await controller(offset)
                if next_check is None:
                    return False
                heapq.heappush(events, (next_check, "check", "", next_check))
        await handle.terminate("the trace ran out before the job finished")
        raise RuntimeError(f"{handle.id} did not finish within 10 spans of the trace")

    async def _recommend(
        self,
        handle: WorkflowHandle[Any, Any],
        zone: str,
        when: tuple[float, float],
        reclaiming: set[str],
    ) -> None:
        """Recommendations now to the nodes the drop will take (`when`: now, the drop), and
        false ones to the job's other spot nodes (`rebalance.py`)."""
        assert self.rebalance is not None
        now, drop_at = when
        doomed = self._victims(zone, drop_at, reclaiming)
        spot = [n for z in self.cloud.zones for n in self._spot(z, reclaiming)]
        for node_id in self.rebalance.send(doomed, spot, now):
            notice = {"node_id": node_id, "kind": "rebalance"}
            await handle.signal("reclaim", notice | {"event_id": f"w-{node_id}"})

    def _spot(self, zone: str, reclaiming: set[str]) -> list[str]:
        return [
            n.node_id
            for n in self.cloud.running()
            if n.lifecycle == "spot" and n.zone == zone and n.node_id not in reclaiming
        ]

    def _victims(self, zone: str, offset: float, reclaiming: set[str]) -> list[str]:
        """The spot nodes above the zone's capacity at `offset`: those a true recommendation
        named first, then the newest."""
        doomed = self.rebalance.doomed if self.rebalance is not None else set()
        held = sorted(
            self._spot(zone, reclaiming),
            key=lambda node_id: (node_id in doomed, node_id),
            reverse=True,
        )
        return held[: max(0, len(held) - self.setup.capacity(zone, offset))]

    async def _take(self, handle: WorkflowHandle[Any, Any], node_id: str) -> None:
        """The node is gone now; the job hears it as the EC2 state change event."""
        if self.cloud.nodes[node_id].info.state != "gone":
            self.cloud.reclaim(node_id)
            await handle.signal("node_lost", {"node_id": node_id, "event_id": f"l-{node_id}"})

    async def drain(self, handle: WorkflowHandle[Any, Any]) -> None:
        """Checkpoint and stop the running generation through the public signal path: a
        reclaim notice for every member. (The `pause` update would be the natural call, but
        the time-skipping test server fails workflow tasks after it: "invalid history
        builder state for action".)"""
        status = await handle.query("status", result_type=JobStatus)
        if status.phase != "Running":
            return
        deadline = await self.env.get_current_time() + timedelta(seconds=120)
        for node in status.nodes:
            if node.rank is not None and node.node_id:
                notice = {"node_id": node.node_id, "deadline": deadline.isoformat()}
                await handle.signal("reclaim", notice | {"event_id": f"drain-{node.node_id}"})
        generation = self.runtime.jobs[handle.id].generations[status.generation]
        while not generation.stopped:
            await asyncio.sleep(0.05)

    async def finish(self, handle: WorkflowHandle[Any, JobResult]) -> tuple[JobResult, float]:
        """The job's result and its wall time in hours of server time. A job that closed
        long after its work completed sat on a wedged workflow task while the benchmark
        skipped time, and one whose history shows a workflow task skipped over sat unseen
        for a while: `Wedged` (its wall time would be the server's, not the job's)."""
        result = await handle.result()
        desc = await handle.describe()
        assert desc.close_time is not None
        done = max((e.time for e in result.timeline if e.event == "completed"), default=None)
        if done is not None and (desc.close_time - done).total_seconds() > 2 * self.setup.tick_s:
            raise Wedged(f"closed {desc.close_time - done} after completing")
        await check_not_skipped(self.env.client, handle.id, handle.first_execution_run_id)
        return result, (desc.close_time - self.t0).total_seconds() / 3600

    def row(self, policy: str, wall_h: float, result: JobResult, began: float) -> Row:
        """The policy's outcome; `began`: time.monotonic() when the run began. Paid
        node-hours include the boots, which the job does not see (its nodes count from
        ready)."""
        gens = sorted(
            (g for job in self.runtime.jobs.values() for g in job.generations.values()),
            key=lambda g: g.started_at,
        )
        stepped = {h[0] for job in self.runtime.jobs.values() for h in job.history if h[3] > h[2]}
        hops = hop_seconds(  # (the timeline keeps its last 400 entries: hops_timed says)
            [e.time for e in result.timeline if e.event == "zone hop"],
            [t for t, world in self.runtime.worlds if world == 0],
            [
                g.started_at + timedelta(seconds=g.startup_s)
                for g in gens
                if g.plan.generation in stepped
            ],
        )
        return Row(
            policy,
            "workflow",
            wall_h,
            result.node_hours["spot"] + self.cloud.boot_hours["spot"],
            result.node_hours["on-demand"] + self.cloud.boot_hours["on-demand"],
            steps_lost=result.steps_lost,
            resizes=result.resizes,
            reclaims=result.reclaims,
            swapped=result.swapped,
            hops=result.hops,
            hop_s=hops[0],
            hop_move_s=hops[1],
            transfer=ring_transfer(
                self.runtime.rings,
                {i: n.info.zone for i, n in self.cloud.nodes.items()},
                self.setup,
            ),
            run_s=time.monotonic() - began,
            series=[((t - self.t0).total_seconds() / 3600, w) for t, w in self.runtime.worlds],
            startup_s=sum(g.startup_s for g in gens[1:]),
            **self._recommendations(),
        )

    def _recommendations(self) -> dict[str, int]:
        if self.rebalance is None:
            return {}
        counts = self.rebalance.report()
        return {
            "recommended": counts["recommended"],
            "recommended_false": counts["false"],
            "recommended_taken": counts["followed_by_reclaim"],
        }


MAKE_BEFORE_BREAK = {"early_warning": "make_before_break", "reclaim_notice": "make_before_break"}
# the make-before-break twins: the product's (a warning weighed by its rule), and with
# `--rebalance` one that acts on every warning, as before the rule
TWINS: dict[str, dict[str, Any]] = {
    " +mbb": MAKE_BEFORE_BREAK,
    " +mbb always": MAKE_BEFORE_BREAK | {"warning_rule": "always"},
}


def job_spec(
    setup: Setup,
    name: str,
    deadline: dict[str, Any] | None = None,
    mbb: dict[str, Any] | None = None,
    **on_demand: Any,
) -> dict[str, Any]:
    """The benchmark's job; progress and capacity checks at the trace's tick keep the
    workflow's tasks per simulated hour few. `mbb`: the make-before-break policy (a `TWINS`
    value; else the defaults: a warning is ignored, a notice shrinks)."""
    tick = setup.tick_s
    policy = mbb | {"max_surge_nodes": setup.max_surge_nodes} if mbb else {}
    return {
        "deadline": deadline,
        "name": name,
        "command": ["simulated"],
        "total_steps": setup.total_steps,
        "checkpoint": "file:///tmp/spotrain-bench",
        "elastic": {
            "min_nodes": setup.min_nodes,
            "max_nodes": setup.max_nodes,
            "graceful_shutdown_timeout_s": setup.grace_s,
            "scaling_timeout_s": 60,
            "faulty_scale_down_timeout_s": 120,
            "progress_report_interval_s": tick,
            "capacity_check_interval_s": tick,
            "stall_timeout_s": 4 * tick + setup.restart_cost_s,
            "resize": setup.resize,
        }
        | policy,
        "spot": {
            "instance_types": [
                {
                    "name": INSTANCE_TYPE,
                    "gpus": 1,
                    "on_demand_price": setup.on_demand_price,
                    "spot_price": setup.spot_price,
                }
            ],
            "zones": [t.zone for t in setup.traces],
        },
        "on_demand": {"fallback": False} | on_demand,
        "placement": setup.placement,
        "gradient_bytes": workflow_gradient_bytes(setup),
    }


def workflow_gradient_bytes(setup: Setup) -> int:
    """The gradient size to give the job, so that the traffic it weighs (when gathering its
    nodes in one zone) is the traffic billed here: it sees its simulated steps
    (`steps_per_hour` of its world), the rows are billed at `sync_steps_per_s`. The two agree
    at `max_nodes`; on fewer nodes the job sees less than is billed."""
    simulated_per_s = setup.steps_per_hour(setup.max_nodes) / 3600
    return round(setup.gradient_gb * 1e9 * setup.sync_steps_per_s / simulated_per_s)


@asynccontextmanager
async def new_run(env: WorkflowEnvironment, setup: Setup) -> AsyncIterator[Run]:
    """A worker with a fresh trace-driven cloud and runtime on its own task queue."""
    t0 = await env.get_current_time()
    cloud = SimulatedCloud(
        zones=[t.zone for t in setup.traces],
        capacity=lambda _type, zone, when: setup.capacity(zone, (when - t0).total_seconds()),
        spot_price=setup.spot_price,
        boot_s=lognormal_boot(setup.boot_median_s, setup.boot_sigma, setup.seed),
    )
    runtime = RecordingRuntime(setup, lambda node_id: cloud.nodes[node_id].info.zone)
    run = Run(env, setup, cloud, runtime, uuid.uuid4().hex, t0)
    if setup.rebalance:
        run.rebalance = Recommendations(
            setup.rebalance_fp_rate,
            setup.rebalance_lead_min_s,
            setup.rebalance_lead_max_s,
            setup.seed,
        )
    with ThreadPoolExecutor(max_workers=8) as pool:
        async with workflow_worker(
            env.client,
            run.task_queue,
            cloud.activities() + run.runtime.activities(),
            activity_executor=pool,
        ):
            yield run


async def spotrain(
    env: WorkflowEnvironment,
    setup: Setup,
    policy: str,
    deadline: dict[str, Any] | None = None,
    mbb: dict[str, Any] | None = None,
    **on_demand: Any,
) -> Row:
    began = time.monotonic()
    async with new_run(env, setup) as run:
        name = f"bench-{uuid.uuid4().hex[:8]}"
        handle = await run.start(job_spec(setup, name, deadline, mbb, **on_demand))
        await run.drive(handle)
        result, wall_h = await run.finish(handle)
    return run.row(policy, wall_h, result, began)


# --- the benchmark ---------------------------------------------------------------------------


def spotrain_runs(
    setup: Setup, deadline: bool, mbb: bool = True, only: tuple[str, ...] = ()
) -> list[tuple[str, RunFn]]:
    """spotrain's policies (those named in `only`, if any), each followed by its
    make-before-break twins (`mbb`; the second only with rebalance recommendations), then the
    deadline policies."""
    policies: list[tuple[str, dict[str, Any]]] = [
        ("spotrain elastic", {}),
        ("spotrain +fallback", {"fallback": True}),
        ("spotrain +od-base", {"base_nodes": setup.base_nodes}),
    ]
    twins: list[tuple[str, dict[str, Any] | None]] = [("", None)]
    if mbb:
        twins += list(TWINS.items())[: 2 if setup.rebalance else 1]
    runs: list[tuple[str, RunFn]] = [
        (
            name + suffix,
            lambda env, name=name + suffix, twin=twin, opts=opts: spotrain(
                env, setup, name, None, twin, **opts
            ),
        )
        for name, opts in policies
        if not only or name.removeprefix("spotrain ") in only
        for suffix, twin in twins
    ]
    if deadline:
        from .deadline_sweep import deadline_runs  # (it builds on this module)

        runs += deadline_runs(setup)
    return runs


async def benchmark(
    setup: Setup,
    deadline: bool = True,
    mbb: bool = True,
    modes: tuple[str, ...] = ("live",),
    log: RowLog | None = None,
    only: tuple[str, ...] = (),
) -> list[Row]:
    """Every policy on the same trace and work: the baselines, then spotrain's runs in each
    resize mode of `modes` (the first unmarked, the others' policies marked with theirs),
    each on a fresh time-skipping server (a test-server wedge in one run cannot hold up the
    next); each row goes to `log` as it completes, and so does each policy abandoned."""
    rows = [
        oracle(setup),
        all_on_demand(setup),
        fixed_restart(setup),
        fixed_restart(setup, on_notice=True),
        fixed_at_available(setup),
        *one_zone_baselines(setup),
    ]
    log = log or RowLog(None)
    for row in rows:
        log.write(row.report(setup, rows[0].wall_h, no_capacity(setup, row.wall_h)))
    for mode in modes:
        at = replace(setup, resize=mode)
        for policy, run in spotrain_runs(at, deadline, mbb, only):
            name = policy + ("" if mode == modes[0] else f" ({mode})")
            row = await on_fresh_server(at, name, run)
            if row is None:
                log.abandon(name)
                continue
            row.policy = name
            log.write(row.report(setup, rows[0].wall_h, no_capacity(setup, row.wall_h)))
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    setup, args = parse_args(argv, __doc__.split("\n\n")[0])
    logging.getLogger("temporalio").setLevel(logging.ERROR)  # capacity errors are expected
    began = time.monotonic()
    pauses, pauses_from = measured_live_pauses(setup.state_gb, setup.live_results)
    print(
        f"live pauses for {setup.state_gb} GB of state from {pauses_from.name}: {pauses}",
        file=sys.stderr,
    )
    modes = ("live", "restart") if args.resize == "both" else (args.resize,)
    log = RowLog(args.out / "goodput_rows.jsonl")
    only = tuple(p for p in args.only.split(",") if p)
    rows = asyncio.run(benchmark(setup, not args.no_deadline, not args.no_mbb, modes, log, only))
    sweep = None
    if args.deadline_factors:
        from .deadline_sweep import sweep as deadline_sweep  # (it builds on this module)

        factors = [float(f) for f in args.deadline_factors.split(",")]
        sweep = asyncio.run(deadline_sweep(setup, factors))
    oracle_h = rows[0].wall_h
    report = {
        "setup": {k: v for k, v in vars(setup).items() if k != "traces"}
        | {
            "traces": [f"{t.zone}: {len(t.data)} x {t.gap_s:.0f} s" for t in setup.traces],
            "deadline_h": setup.deadline_s() / 3600,
            "total_steps": setup.total_steps,
            "live_pauses": asdict(pauses),
            "live_pauses_from": shown_path(pauses_from),
        },
        "prices": [vars(p) for p in args.prices],  # per trace: what its nodes cost, and why
        "load_average": os.getloadavg(),
        "rows": [r.report(setup, oracle_h, no_capacity(setup, r.wall_h)) for r in rows],
        "abandoned": log.abandoned,
        "deadline_sweep": sweep,
        "bench_s": time.monotonic() - began,
    }
    publish(report, report["rows"], COLUMNS, args.out / "goodput.json")
    print()
    print(price_table(args.prices))
    if sweep is not None:
        from .deadline_sweep import SWEEP_COLUMNS

        print()
        print(table(sweep["rows"], SWEEP_COLUMNS))
    plot(setup, rows, args.out / "goodput_world_size.png")
    log.done()
    return report
