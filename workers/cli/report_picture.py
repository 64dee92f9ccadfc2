"""The job picture (`spotrain report NAME --plot FILE.png`, and the page `--html` writes): a
job's life on spot capacity in four panels sharing the time axis, read from its report alone.

1. the world size that trained (a live resize does not drop to 0);
2. nodes by lifecycle, spot and on-demand;
3. progress: steps per second, each generation's average (from the step it resumed from to
   the step its stop recorded);
4. cumulative cost against the same node-hours bought all on-demand (node-hours of each
   lifecycle at its average price, so the line ends at the job's cost).

Markers across all panels say why the picture changes: reclaim notices, nodes lost without
notice, growth, pauses and faults. The legend sits outside the panels, beside them.
"""

from __future__ import annotations

import io
import re
from dataclasses import dataclass
from typing import Any

from spotrain.workers.cli.report import LIFECYCLES, Report, nodes_over_time, trained_world

# Why the picture changes, by timeline entry: (label, colour, line style).
MARKERS = {
    "notice": ("reclaim notice", "tab:orange", "--"),
    "lost": ("lost without notice", "tab:red", "-"),
    "growth": ("growth", "tab:green", ":"),
    "scale in": ("scale-in", "tab:pink", "--"),
    "pause": ("paused", "tab:gray", "-."),
    "resume": ("resumed", "tab:gray", ":"),
    "fault": ("fault", "black", "-"),
}
# The data lines' colours, none a marker's (each legend entry tells one thing).
WORLD, STEPS, SPENT, ALL_ON_DEMAND = "tab:blue", "tab:purple", "tab:brown", "tab:olive"
NODES = {"spot": "tab:cyan", "on-demand": "tab:olive"}
RESUME = re.compile(r"(?:resume from step|^step) (\d+)")


def seconds(report: Report) -> list[float]:
    start = report.timeline[0].time
    return [(e.time - start).total_seconds() for e in report.timeline]


# Entries marked by their event alone.
BY_EVENT = {"scale in": "scale in", "paused": "pause", "resumed": "resume", "fault": "fault"}


def stopped_for_notice(event: str, detail: str) -> list[str] | None:
    """The nodes a generation stopped for, if it stopped for a reclaim notice ("reclaim notice
    for i-0, i-1; resume from step 9")."""
    if event.startswith("generation ") and detail.startswith("reclaim notice for "):
        return detail.split(";")[0].removeprefix("reclaim notice for ").split(", ")
    return None


def marker(event: str, detail: str, world: int, before: int, noticed: list[str]) -> str | None:
    """Which marker a timeline entry gets, if any (`world`: the trained world size after it,
    `before`: the last one that trained before it; `noticed`: the nodes the last generation
    stopped for a notice named, whose notices that stop already marks)."""
    if stopped_for_notice(event, detail) is not None:
        return "notice"
    if event == "node gone":
        if not detail.endswith(": reclaimed"):
            return "lost"
        node = detail.removesuffix(": reclaimed").rsplit(" ", 1)[-1]
        return None if node in noticed else "notice"  # a node not training yet
    if event == "generation started" and world > before > 0:
        return "growth"
    return BY_EVENT.get(event)


def markers(report: Report) -> list[tuple[float, str]]:
    """(seconds since submission, kind) of every marked entry."""
    out, before = [], 0  # the last world size that trained (a restart drops to 0 between)
    noticed: list[str] = []
    for t, e, world in zip(
        seconds(report), report.timeline, trained_world(report.timeline), strict=True
    ):
        if kind := marker(e.event, e.detail, world, before, noticed):
            out.append((t, kind))
        noticed = stopped_for_notice(e.event, e.detail) or noticed
        before = world or before
    return out


@dataclass
class Segment:
    """One generation's training: from `start` to `end` seconds, `rate` steps per second."""

    start: float
    end: float
    rate: float


def progress(report: Report) -> list[Segment]:
    """Each generation's average steps per second, from the step it resumed from to the step
    the next one resumes from, as the workflow recorded them at its stop (or the job's last
    step, when it completed): steps a restart redoes do not count. A generation still
    running has no stop yet and is left out."""
    out: list[Segment] = []
    begun: float | None = None
    step = 0
    for t, e in zip(seconds(report), report.timeline, strict=True):
        found = RESUME.search(e.detail)
        if e.event == "generation started":
            begun = t
        elif (
            begun is not None
            and found
            and (e.event.startswith("generation ") or e.event == "completed")
        ):
            reached = int(found.group(1))
            if t > begun and reached >= step:
                out.append(Segment(begun, t, (reached - step) / (t - begun)))
            begun = None
        if found and e.event != "generation started":
            step = int(found.group(1))
    return out


def cumulative_cost(report: Report) -> tuple[list[float], list[float]] | None:
    """(cost so far, cost had every node-hour so far been on-demand) at each timeline entry,
    or None when the report has no node-hours by lifecycle."""
    hours = report.node_hours or {}
    costs = {"spot": report.cost.spot, "on-demand": report.cost.on_demand}
    total_hours = sum(hours.values())
    if not total_hours or any(costs[k] is None for k in LIFECYCLES):
        return None
    price = {k: (costs[k] or 0.0) / hours[k] if hours.get(k) else 0.0 for k in LIFECYCLES}
    on_demand_price = (report.cost.all_on_demand or 0.0) / total_hours
    x, nodes = seconds(report), nodes_over_time(report)
    paid, all_on_demand = [0.0], [0.0]
    for i in range(1, len(x)):
        dt_h = (x[i] - x[i - 1]) / 3600
        held = {k: nodes[k][i - 1] for k in LIFECYCLES}
        paid.append(paid[-1] + dt_h * sum(held[k] * price[k] for k in LIFECYCLES))
        all_on_demand.append(all_on_demand[-1] + dt_h * sum(held.values()) * on_demand_price)
    return paid, all_on_demand


def figure(report: Report) -> Any:
    """The matplotlib figure (the caller has checked that matplotlib imports)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = seconds(report)
    fig, (world, nodes, rate, cost) = plt.subplots(
        4, 1, sharex=True, figsize=(11, 9), layout="constrained"
    )
    world.step(
        x, trained_world(report.timeline), where="post", color=WORLD, lw=2, label="world size"
    )
    world.set_ylabel("world size")
    world.set_title(
        f"{report.name}: {report.phase}, {report.reclaims} reclaim(s), "
        f"{report.steps_done} steps, {report.steps_lost} lost"
    )
    for lifecycle, counts in nodes_over_time(report).items():
        nodes.step(
            x, counts, where="post", color=NODES[lifecycle], label=f"{lifecycle} nodes", lw=2
        )
    nodes.set_ylabel("nodes")
    for s in progress(report):
        rate.hlines(s.rate, s.start, s.end, color=STEPS, lw=2)
    rate.plot([], [], color=STEPS, lw=2, label="steps/s (generation average)")
    rate.set_ylabel("steps / s")
    rate.set_ylim(bottom=0)
    spent = cumulative_cost(report)
    if spent is not None:
        cost.plot(x, spent[0], color=SPENT, lw=2, label="cost so far")
        cost.plot(x, spent[1], color=ALL_ON_DEMAND, lw=1.5, ls="--", label="all on-demand")
    cost.set_ylabel("USD")
    cost.set_xlabel("seconds since submission")
    seen: set[str] = set()
    for t, kind in markers(report):
        label, colour, style = MARKERS[kind]
        for ax in (world, nodes, rate, cost):
            ax.axvline(t, color=colour, ls=style, lw=1, alpha=0.8)
        if kind not in seen:
            world.plot([], [], color=colour, ls=style, lw=1, label=label)
            seen.add(kind)
    handles, labels = [], []
    for ax in (world, nodes, rate, cost):
        h, lab = ax.get_legend_handles_labels()
        handles += h
        labels += lab
    fig.legend(handles, labels, loc="outside right upper", fontsize="small")
    return fig


def png(report: Report) -> bytes:
    import matplotlib.pyplot as plt

    fig = figure(report)
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out.getvalue()
