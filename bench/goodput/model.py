"""The goodput benchmark's setup (trace, job, progress model, prices), its result rows and
their plot, and the baselines: small pure-Python models over the same trace, progress model,
restart cost and lost-work rule as spotrain's runs (bench/goodput/)."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from spotrain.workflows.policies.locality import ring_crossing

from ..common import REPO, Trace
from .rebalance import FP_RATE, LEAD_MAX_S, LEAD_MIN_S

Series = list[tuple[float, int]]  # (hours since start, world size) at each change


@dataclass(frozen=True)
class Setup:
    """One benchmark: the trace, the job (size, work, progress model) and the prices."""

    traces: list[Trace]
    max_nodes: int = 16
    min_nodes: int = 1
    base_nodes: int = 4
    work_node_hours: float = 400.0  # about 3 min of benchmark here; 1000: about 8 min
    steps_per_node_hour: float = 3600.0
    scaling_efficiency: float = 1.0
    checkpoint_minutes: float = 30.0
    restart_cost_s: float = 120.0  # restart mode: each generation's processes start and load
    resize: str = "live"  # spotrain's elastic.resize (the product's default); or "restart"
    # spotrain's placement. "any" (the committed tables): a job spans the traces' zones, its
    # traffic across them unbilled, as the oracle and baselines do (issue 49 prices it).
    placement: str = "any"
    gradient_gb: float = 0.4  # what one step all-reduces: 100M fp32 parameters
    sync_steps_per_s: float = 1.0  # the job's steps (each an all-reduce) a second
    # a step of a ring that crosses zones takes this many times as long (stated, not
    # measured: EC2 caps one flow at 5 Gbps outside a cluster placement group, 10 inside)
    cross_zone_slowdown: float = 1.0
    state_gb: float = 0.8  # model + optimizer state: 100M params, fp32 with SGD momentum
    live_results: str = ""  # live mode's pauses: a bench.live_resize results file ("": ours)
    boot_median_s: float = 60.0  # a launched node's boot to ready: lognormal, this median
    boot_sigma: float = 0.5  # ... and this sigma of its log (p90: 1.9x the median)
    seed: int = 1  # the boot delays' draws
    notice_s: float = 120.0
    checkpoint_s: float = field(default_factory=lambda: measured_checkpoint_s())
    grace_s: float = 60.0  # the job's graceful_shutdown_timeout_s
    rebalance: bool = False  # rebalance recommendations ahead of drops, false ones too
    rebalance_fp_rate: float = FP_RATE  # share never followed by a reclaim (sample: 15 of 30)
    rebalance_lead_min_s: float = LEAD_MIN_S  # a true one's lead: log-uniform, 17 min ...
    rebalance_lead_max_s: float = LEAD_MAX_S  # ... to 8 h 42 min (the published sample)
    max_surge_nodes: int = 1  # make-before-break rows: the overlap may exceed max_nodes by this
    # USD per node-hour (AWS p3.2xlarge's); the command line sets both from the traces'
    # cloud and GPU (prices.py) or its --spot-price / --on-demand-price
    spot_price: float = 0.9701
    on_demand_price: float = 3.06
    deadline_h: float | None = None
    deadline_margin_s: float = 600.0  # the product policy's margin_s
    run_timeout_s: float = 900.0  # real seconds a spotrain run may take before it counts as wedged
    wedge_s: float = 60.0  # real seconds with neither server time nor CPU moving: a wedge

    @property
    def tick_s(self) -> float:
        return min(t.gap_s for t in self.traces)

    @property
    def total_steps(self) -> int:
        return round(self.work_node_hours * self.steps_per_node_hour)

    @property
    def checkpoint_every(self) -> int:
        """Steps between periodic checkpoints: `checkpoint_minutes` at the full size."""
        return max(1, round(self.steps_per_hour(self.max_nodes) * self.checkpoint_minutes / 60))

    def steps_per_hour(self, world: int) -> float:
        """Each doubling of the world runs at `scaling_efficiency` of ideal."""
        if world <= 0:
            return 0.0
        return self.steps_per_node_hour * world * self.scaling_efficiency ** math.log2(world)

    @property
    def start_s(self) -> float:
        """A start on fresh nodes: their boot (the median), then the processes' start-up."""
        return self.boot_median_s + self.restart_cost_s

    def notice_checkpoint_fits(self) -> bool:
        """The checkpoint on a reclaim notice completes before the node goes: within the
        grace the workflow gives it (the notice less 5 s, at most `grace_s`)."""
        return self.checkpoint_s <= min(self.grace_s, self.notice_s - 5)

    def capacity(self, zone: str, offset_s: float) -> int:
        return next(t.at(offset_s) for t in self.traces if t.zone == zone)

    def available(self, offset_s: float) -> int:
        """Spot nodes a job of at most `max_nodes` could hold, over all zones."""
        return min(self.max_nodes, sum(t.at(offset_s) for t in self.traces))

    def on_demand_hours(self) -> float:
        return self.start_s / 3600 + self.total_steps / self.steps_per_hour(self.max_nodes)

    def deadline_policy(self) -> dict[str, Any]:
        """The job spec's `deadline` for spotrain's own policy: a switch costs a restart and
        the notice's grace."""
        return {
            "max_duration_s": self.deadline_s(),
            "margin_s": self.deadline_margin_s,
            "switch_s": self.restart_cost_s + self.grace_s,
            "hysteresis_s": 4 * self.tick_s,
        }

    def deadline_s(self) -> float:
        """The deadline: `deadline_h`, else 1.25x the all-on-demand time."""
        return 3600 * (self.deadline_h or 1.25 * self.on_demand_hours())

    def segments(self) -> Iterator[tuple[float, float, int]]:
        """(start s, end s, nodes available) between consecutive tick boundaries, endless."""
        start = 0.0
        while True:
            end = min((start // t.gap_s + 1) * t.gap_s for t in self.traces)
            yield start, end, self.available(start)
            start = end


def measured_checkpoint_s() -> float:
    """The checkpoint on notice's default duration: bench/checkpoint.py's median time to
    durable of a synchronous save to S3 (what a checkpoint on notice is), from its latest
    results; 11.2 s, its figure of 2026-11-24, without them."""
    path = REPO / "bench" / "results" / "checkpoint.json"
    if path.exists():
        for row in json.loads(path.read_text())["rows"]:
            if (row["target"], row["mode"]) == ("s3", "sync"):
                return float(row["durable_median_s"])
    return 11.2


COLUMNS = [  # the table's, of Row.report's
    "policy",
    "engine",
    "wall_h",
    "wall_vs_oracle",
    "cost",
    "cost_vs_on_demand",
    "usd_per_work_nh",
    "goodput",
    "spot_node_h",
    "on_demand_node_h",
    "steps_lost",
    "swapped",
    "hops_per_day",
    "hop_s_p50",
    "hop_s_max",
    "hop_move_s_max",
    "transfer_usd",
    "cost_with_transfer",
    "recommended",
    "recommended_false",
    "recommended_taken",
    "resizes_per_reclaim",
    "pause_s_per_reclaim",
    "pause_s_per_reclaim_with_capacity",
    "deadline_hit",
    "run_s",
    "retries",
]


@dataclass(frozen=True)
class Transfer:
    zone_gb: float = 0.0
    usd: float = 0.0

    def __add__(self, other: Transfer) -> Transfer:
        return Transfer(self.zone_gb + other.zone_gb, self.usd + other.usd)


def slowdown(setup: Setup, zones: Sequence[str]) -> float:
    """How many times as long a step of a ring over `zones` (one per node) takes."""
    return setup.cross_zone_slowdown if len(set(zones)) > 1 else 1.0


def sent(setup: Setup, zones: Sequence[str], seconds: float) -> Transfer:
    """What a ring over `zones` (one per node, in rank order) sends across zones and regions
    in `seconds` of training: `sync_steps_per_s` steps a second (fewer when slowed), each a
    ring all-reduce of `gradient_gb` (the product's rule, workflows/policies/locality.py), at
    EC2's prices."""
    step = ring_crossing(list(zones), int(setup.gradient_gb * 1e9), [])
    steps = setup.sync_steps_per_s * seconds / slowdown(setup, zones)
    return Transfer(step.zone_gb * steps, step.cost * steps)


def ring_transfer(
    rings: Sequence[tuple[datetime, list[str]]], zone_of: Mapping[str, str], setup: Setup
) -> Transfer:
    """What a job's rings sent across zones, from each generation's nodes in rank order
    (`rings`: when each started, or ended with no nodes)."""
    total = Transfer()
    for (start, nodes), (end, _) in itertools.pairwise(rings):
        total += sent(setup, [zone_of[n] for n in nodes], (end - start).total_seconds())
    return total


def hop_seconds(
    hops: Sequence[datetime], stops: Sequence[datetime], trains: Sequence[datetime]
) -> tuple[list[float], list[float]]:
    """Each hop's time not training: from the last stop of training at or before the hop
    (a hop that pays stops it; a job left with no node hops once the last one is gone, and
    may have waited for capacity since), and from the hop itself (issue 49's target: at most
    a checkpoint, a boot and a start-up), to the first step after it. `trains`: when each
    generation that made a step made its first."""
    down, moving = [], []
    for at in hops:
        before = [t for t in stops if t <= at]
        after = [t for t in trains if t >= at]
        if before and after:
            down.append((min(after) - max(before)).total_seconds())
            moving.append((min(after) - at).total_seconds())
    return down, moving


def spread(setup: Setup, offset_s: float, nodes: int) -> list[str]:
    """The zones of `nodes` nodes a job spanning the traces' zones holds at `offset_s`, in
    rank order: the zones offering most first, each filled before the next (so the ring
    crosses once per zone it adds)."""
    zones: list[str] = []
    for trace in sorted(setup.traces, key=lambda t: -t.at(offset_s)):
        zones += [trace.zone] * max(0, min(trace.at(offset_s), nodes - len(zones)))
    return zones


@dataclass
class Row:
    """One policy's outcome: the table's columns plus its world size over time."""

    policy: str
    engine: str
    wall_h: float
    spot_node_h: float
    on_demand_node_h: float
    steps_lost: int = 0
    resizes: int = 0
    reclaims: int = 0  # nodes taken by the cloud while the job held them
    swapped: int = 0  # warned nodes replaced make-before-break (one resize each)
    hops: int = 0  # moves to another zone (spotrain with --placement zone)
    hop_s: list[float] = field(default_factory=list)  # each timed hop: stop to first step
    hop_move_s: list[float] = field(default_factory=list)  # ... from the hop to its first step
    transfer: Transfer = field(default_factory=Transfer)  # sent across zones, GB and USD
    run_s: float = 0.0
    retries: int = 0  # runs of this policy abandoned on a wedged test server
    series: Series = field(default_factory=list)
    startup_s: float = 0.0  # start-ups (restart) and pauses (live) after the first start
    recommended: int = 0  # nodes sent a rebalance recommendation
    recommended_false: int = 0  # ... though no drop was due to take them
    recommended_taken: int = 0  # ... that the cloud took within the longest lead

    def idle(self) -> list[tuple[float, float]]:
        """(from h, to h) spans with no generation running, after the first start."""
        starts = [t for t, w in self.series if w > 0]
        return [
            (a[0], b[0])
            for a, b in itertools.pairwise([*self.series, (self.wall_h, 0)])
            if a[1] == 0 and starts and a[0] >= starts[0] and b[0] > a[0]
        ]

    def pause_h(self, no_capacity: Sequence[tuple[float, float]] = ()) -> float:
        """Hours not training between the first start and the end: no generation running,
        plus each later start-up or pause; less the time within `no_capacity` spans (when
        the trace offered no node at all: nothing could train)."""
        idle = sum(b - a for a, b in self.idle()) - overlap_h(self.idle(), no_capacity)
        return idle + self.startup_s / 3600

    def report(
        self, setup: Setup, oracle_wall_h: float, no_capacity: Sequence[tuple[float, float]] = ()
    ) -> dict[str, Any]:
        """The row's columns; `no_capacity`: the spans the trace offered no node (`no_capacity`
        up to at least this row's end), left out of the second pause figure."""
        cost = self.spot_node_h * setup.spot_price + self.on_demand_node_h * setup.on_demand_price
        od = setup.on_demand_hours() * setup.max_nodes * setup.on_demand_price
        return {
            "policy": self.policy,
            "engine": self.engine,
            "wall_h": self.wall_h,
            "wall_vs_oracle": self.wall_h / oracle_wall_h,
            "cost": cost,
            "cost_vs_on_demand": cost / od,
            "usd_per_work_nh": cost / setup.work_node_hours,
            "goodput": setup.work_node_hours / (self.spot_node_h + self.on_demand_node_h),
            "spot_node_h": self.spot_node_h,
            "on_demand_node_h": self.on_demand_node_h,
            "steps_lost": self.steps_lost,
            "resizes": self.resizes,
            "reclaims": self.reclaims,
            "swapped": self.swapped,
            "hops_per_day": 24 * self.hops / self.wall_h if self.wall_h else 0.0,
            "hops_timed": len(self.hop_s),
            "hop_s_p50": statistics.median(self.hop_s) if self.hop_s else None,
            "hop_s_max": max(self.hop_s, default=None),
            "hop_s": [round(s, 1) for s in self.hop_s],
            "hop_move_s_p50": statistics.median(self.hop_move_s) if self.hop_move_s else None,
            "hop_move_s_max": max(self.hop_move_s, default=None),
            "hop_move_s": [round(s, 1) for s in self.hop_move_s],
            "transfer_gb": self.transfer.zone_gb,
            "transfer_usd": self.transfer.usd,
            "cost_with_transfer": cost + self.transfer.usd,
            "recommended": self.recommended,
            "recommended_false": self.recommended_false,
            "recommended_taken": self.recommended_taken,
            "resizes_per_reclaim": self.resizes / self.reclaims if self.reclaims else None,
            "pause_s_per_reclaim": 3600 * self.pause_h() / self.reclaims if self.reclaims else None,
            "pause_s_per_reclaim_with_capacity": (
                3600 * self.pause_h(no_capacity) / self.reclaims if self.reclaims else None
            ),
            "deadline_hit": self.wall_h * 3600 <= setup.deadline_s(),
            "run_s": self.run_s,
            "retries": self.retries,
        }


def overlap_h(spans: Sequence[tuple[float, float]], others: Sequence[tuple[float, float]]) -> float:
    """Total length of the intersection of two sets of disjoint spans."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in others)


def no_capacity(setup: Setup, until_h: float) -> list[tuple[float, float]]:
    """(from h, to h) spans up to `until_h` when the traces offered no node at all, read from
    the traces themselves. (The oracle's idle spans, used before, end where the oracle
    finishes: a row that ran on past it had every later hour counted as one with capacity,
    so a 1-node trace's hours-long outages read as pauses spotrain chose.)"""
    spans: list[tuple[float, float]] = []
    for start, end, avail in setup.segments():
        if start >= until_h * 3600:
            break
        if avail > 0:
            continue
        a, b = start / 3600, min(end / 3600, until_h)
        if spans and spans[-1][1] == a:
            spans[-1] = (spans[-1][0], b)
        else:
            spans.append((a, b))
    return spans


# --- baselines: pure-Python models over the same trace and progress model -------------------


def oracle(setup: Setup) -> Row:
    """Every node-hour the trace offers, no restart cost, no loss, and one boot (the first,
    at the median): no policy does better. Over several zones it spans them (`spread`),
    paying for the bytes its ring sends across and its slower steps."""
    steps, paid, moved, series = 0.0, 0.0, Transfer(), []
    for start, end, avail in setup.segments():
        series.append((start / 3600, avail))
        zones = spread(setup, start, avail)
        rate = setup.steps_per_hour(avail) / 3600 / slowdown(setup, zones)
        begin = max(start, min(end, setup.boot_median_s))  # (the first nodes still boot)
        if rate and steps + rate * (end - begin) >= setup.total_steps:
            finish = begin + (setup.total_steps - steps) / rate
            paid += avail * (finish - start) / 3600
            moved += sent(setup, zones, finish - begin)
            return Row("oracle", "model", finish / 3600, paid, 0.0, series=series, transfer=moved)
        steps += rate * (end - begin)
        paid += avail * (end - start) / 3600
        moved += sent(setup, zones, end - begin)


def fixed_restart(setup: Setup, on_notice: bool = False, hop: bool = False) -> Row:
    """Needs all N nodes; any loss stops everything (work since the last checkpoint is
    lost) until N are back, then it restarts from that checkpoint (boot, then start-up), as
    non-elastic managed spot does. `on_notice`: it checkpoints on the reclaim notice too (a
    SIGTERM handler), saving the work when the checkpoint fits in the notice, by the same
    rule as spotrain. Over several zones it spans them (as `spread` places its N at each
    start), or with `hop` it runs in one zone and, when that zone cannot hold all N,
    restarts in the first zone that can (its own first), as SkyPilot's managed spot fails
    over between zones."""
    n = setup.max_nodes

    def place(start: float, avail: int, last: list[str], running: bool) -> Placed:
        if hop and running:  # it runs in its zone
            avail = setup.capacity(last[0], start)
        if running and avail >= n:
            return last, avail
        if not hop:
            return (spread(setup, start, n) if avail >= n else []), avail
        room = [trace.zone for trace in setup.traces if trace.at(start) >= n]
        home = last[0] if last and last[0] in room else (room or [""])[0]
        return ([home] * n if room else []), avail

    policy = "fixed +notice ckpt" if on_notice else "fixed-restart"
    return restarting(setup, policy + (" (hops zones)" if hop else ""), place, on_notice, hop)


def fixed_at_available(setup: Setup, on_notice: bool = True) -> Row:
    """A non-elastic job run at the size the market gives, as its user would resubmit it:
    all the nodes on offer (at most max_nodes, at least min_nodes, spanning the traces'
    zones), and every change of that size stops it and restarts it from a checkpoint at the
    new size (boot, then start-up). A drop loses the work since the last periodic checkpoint
    (unless `on_notice` saves it, by fixed-restart's rule); a rise checkpoints first, so it
    loses nothing but still pays the restart."""

    def place(start: float, avail: int, last: list[str], running: bool) -> Placed:
        size = avail if avail >= setup.min_nodes else 0
        if running and size == len(last):
            return last, avail
        return spread(setup, start, size), avail

    policy = "fixed at available" + (" +notice ckpt" if on_notice else "")
    return restarting(setup, policy, place, on_notice)


# (zones of the nodes to run on now, one per node: [] to stop; nodes still there of those
# the model runs on), given when, the spot nodes on offer, the zones of its last run, and
# whether that run still goes
Placed = tuple[list[str], int]
Place = Callable[[float, int, list[str], bool], Placed]


def restarting(setup: Setup, policy: str, place: Place, on_notice: bool, hop: bool = False) -> Row:
    """A job that restarts from a checkpoint whenever `place` moves it: a drop goes back to
    the last periodic checkpoint (or, `on_notice`, to the step a checkpoint on the notice
    saved, when it fits), a rise checkpoints first; each start pays a boot and a start-up.
    `hop`: a start in another zone than the last run's counts as a hop, timed from the stop
    before it to its first step (boot and start-up)."""
    every = setup.checkpoint_every
    saves = on_notice and setup.notice_s > 0 and setup.notice_checkpoint_fits()
    started: float | None = None
    start_step, checkpoint, lost, restarts, reclaimed, hops, paid = 0, 0, 0, 0, 0, 0, 0.0
    zones: list[str] = []
    rate, moved, series, stopped = 0.0, Transfer(), [], 0.0
    hop_s: list[float] = []
    hop_move_s: list[float] = []
    for start, end, avail in setup.segments():
        want, still_there = place(start, avail, zones, started is not None)
        if started is not None and want != zones:  # stop, back to a checkpoint
            step = start_step + math.floor(max(0.0, start - started - setup.start_s) * rate)
            grows = len(want) > len(zones)
            checkpoint = step if saves or grows else max(start_step, step - step % every)
            lost += step - checkpoint
            reclaimed += max(0, len(zones) - still_there)
            started, stopped = None, start
            series.append((start / 3600, 0))
        if started is None and want:
            if hop and zones and want[0] != zones[0]:
                hops += 1
                hop_s.append(start - stopped + setup.start_s)
                hop_move_s.append(setup.start_s)  # (it moves as soon as a zone has room)
            zones, started, start_step = want, start, checkpoint
            rate = setup.steps_per_hour(len(zones)) / 3600 / slowdown(setup, zones)
            restarts += 1
            series.append((start / 3600, len(zones)))
        if started is None:
            continue
        finish = started + setup.start_s + (setup.total_steps - start_step) / rate
        training_from = max(start, started + setup.start_s)
        moved += sent(setup, zones, max(0.0, min(end, finish) - training_from))
        if finish <= end:
            paid += len(zones) * (finish - start) / 3600
            series.append((finish / 3600, 0))
            return Row(
                policy,
                "model",
                finish / 3600,
                paid,
                0.0,
                lost,
                restarts - 1,
                reclaimed,
                hops=hops,
                hop_s=hop_s,
                hop_move_s=hop_move_s,
                transfer=moved,
                series=series,
                startup_s=(restarts - 1) * setup.start_s,
            )
        paid += len(zones) * (end - start) / 3600


def all_on_demand(setup: Setup) -> Row:
    hours = setup.on_demand_hours()
    series = [(0.0, setup.max_nodes), (hours, 0)]
    return Row("on-demand", "model", hours, 0.0, setup.max_nodes * hours, series=series)


def plot(setup: Setup, rows: list[Row], path: Path) -> None:
    """World size over time per policy, over the capacity the trace offers (grey)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end_h = max(r.wall_h for r in rows)
    fig, axes = plt.subplots(len(rows), 1, sharex=True, figsize=(11, 1.4 * len(rows) + 1))
    offered = list(itertools.takewhile(lambda s: s[0] <= end_h * 3600, setup.segments()))
    for ax, row in zip(axes, rows, strict=True):
        ax.fill_between(
            [s[0] / 3600 for s in offered],
            [s[2] for s in offered],
            step="post",
            color="0.85",
            label="spot offered",
        )
        times = [t for t, _ in row.series] + [row.wall_h]
        worlds = [w for _, w in row.series] + [0]
        ax.step(times, worlds, where="post", color="C0", label="world size")
        ax.set_ylim(0, setup.max_nodes * 1.1)
        ax.set_ylabel(row.policy, rotation=0, ha="right", va="center", fontsize=8)
        ax.axvline(setup.deadline_s() / 3600, color="C3", lw=0.8, ls="--")
    axes[-1].set_xlabel("hours (dashed: deadline)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def one_zone_baselines(setup: Setup) -> list[Row]:
    """With `--placement zone` over several zones' traces, the oracle and the fixed job that
    checkpoints on the notice held to one zone too: the zone where the oracle finishes first
    (hindsight, which flatters them), so spotrain in one zone is compared with its peers. The
    fixed job only if that zone ever offers all `max_nodes` at once; and the fixed job that
    hops between zones, as spotrain does (if any zone ever offers them all)."""
    if setup.placement != "zone" or len(setup.traces) < 2:
        return []
    best = min(setup.traces, key=lambda t: oracle(replace(setup, traces=[t])).wall_h)
    one = replace(setup, traces=[best])
    rows = [oracle(one)]
    if max(best.data) >= setup.max_nodes:  # (else the fixed job never starts there)
        rows.append(fixed_restart(one, on_notice=True))
    for row in rows:
        row.policy += f" (one zone: {best.zone})"
    if any(max(t.data) >= setup.max_nodes for t in setup.traces):
        rows.append(fixed_restart(setup, on_notice=True, hop=True))
    return rows
