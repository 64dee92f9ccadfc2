"""`spotrain report NAME`: what a job did and what it cost, as text, JSON, a picture or a page.

A finished job is explained from its `JobResult` (timeline, cost by lifecycle); a running or
cancelled one from the `status` and `timeline` queries (cost so far). Both become one
`Report`, so every output format renders the same facts.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field
from rich.console import Console, Group
from rich.table import Table

from spotrain.workflows.job.checkpoints import CheckpointReport, describe
from spotrain.workflows.job.state import JobAccounts, JobResult, JobStatus, Phase, TimelineEntry
from spotrain.workflows.policies import deadline
from spotrain.workflows.policies.deadline import DeadlineState

LIFECYCLES = ("spot", "on-demand")


class Cost(BaseModel):
    """USD. By-lifecycle figures and savings are known only once the job has finished."""

    total: float
    spot: float | None = None
    on_demand: float | None = None
    all_on_demand: float | None = None
    savings: float | None = None
    budget: float | None = Field(None, description="the job's spend cap, if it has one")
    transfer: float = Field(0.0, description="the rings' traffic across zones (in `total`)")
    transfer_gb: float = Field(0.0, description="GB sent across zones")


class Report(BaseModel):
    """The `--json` shape of `spotrain report`."""

    name: str
    phase: Phase
    finished: bool
    failure: str | None
    generations: int
    reclaims: int
    faults: int
    resizes: int
    steps_done: int
    total_steps: int | None
    steps_lost: int
    node_hours: dict[str, float] | None
    cost: Cost
    checkpoints: CheckpointReport | None = None
    deadline: DeadlineState | None = None
    timeline: list[TimelineEntry]

    @classmethod
    def _from_accounts(cls, a: JobAccounts, **progress: Any) -> Report:
        return cls(
            name=a.name,
            phase=a.phase,
            finished=a.phase.is_final,
            failure=a.failure,
            reclaims=a.reclaims,
            faults=a.faults,
            resizes=a.resizes,
            steps_lost=a.steps_lost,
            node_hours=a.node_hours,
            cost=Cost(
                total=a.total_cost,
                spot=a.cost.get("spot", 0.0),
                on_demand=a.cost.get("on-demand", 0.0),
                all_on_demand=a.all_on_demand_cost,
                savings=a.savings if a.all_on_demand_cost else None,  # (no node ran)
                budget=a.budget_usd,
                transfer=a.transfer.cost,
                transfer_gb=a.transfer.zone_gb,
            ),
            checkpoints=a.checkpoints,
            deadline=a.deadline,
            timeline=a.timeline,
            **progress,
        )

    @classmethod
    def from_result(cls, r: JobResult) -> Report:
        return cls._from_accounts(
            r, generations=r.generations, steps_done=r.steps_done, total_steps=None
        )

    @classmethod
    def from_status(cls, s: JobStatus) -> Report:
        return cls._from_accounts(
            s, generations=s.generation, steps_done=s.step, total_steps=s.total_steps
        )


def _usd(value: float | None) -> str:
    return "-" if value is None else f"${value:,.2f}"


def tables(report: Report) -> Group:
    """The terminal rendering: summary, timeline, cost."""
    steps = f"{report.steps_done}" + (f"/{report.total_steps}" if report.total_steps else "")
    summary = (
        f"[bold]{report.name}[/] {report.phase}"
        f"{'' if report.finished else ' (running: cost so far)'}\n"
        f"generations {report.generations}, reclaims {report.reclaims}, faults "
        f"{report.faults}, resizes {report.resizes}, steps {steps}, lost to reclaims "
        f"{report.steps_lost}" + (f"\n[red]failure: {report.failure}[/]" if report.failure else "")
    )
    if report.checkpoints:
        summary += "\n" + describe(report.checkpoints)
    if report.deadline:
        summary += "\n" + deadline.describe(report.deadline)
    timeline = Table("time", "gen", "world", "event", "detail", title="timeline")
    for e, world in zip(report.timeline, trained_world(report.timeline), strict=True):
        timeline.add_row(
            e.time.strftime("%H:%M:%S"), str(e.generation), str(world), e.event, e.detail
        )
    cost = Table("", "node-hours", "cost", title="cost")
    hours = report.node_hours or {}
    cost.add_row("spot", f"{hours.get('spot', 0):.3f}" if hours else "-", _usd(report.cost.spot))
    cost.add_row(
        "on-demand",
        f"{hours.get('on-demand', 0):.3f}" if hours else "-",
        _usd(report.cost.on_demand),
    )
    if report.cost.transfer_gb:
        gb = f"{report.cost.transfer_gb:,.1f} GB"
        cost.add_row("across zones", gb, _usd(report.cost.transfer))
    cost.add_row("total", "", _usd(report.cost.total))
    cost.add_row("all on-demand", "", _usd(report.cost.all_on_demand))
    savings = report.cost.savings
    cost.add_row("savings", "", "-" if savings is None else f"{savings:.0%}")
    if report.cost.budget is not None:
        cost.add_row("budget", "", _usd(report.cost.budget))
    return Group(summary, timeline, cost)


def print_report(report: Report, console: Console) -> None:
    console.print(tables(report))


def nodes_over_time(report: Report) -> dict[str, list[int]]:
    """Live nodes by lifecycle after each timeline entry: +1 on "node ready", -1 on "node
    released" / "node gone" (entries whose detail starts with the lifecycle)."""
    live = dict.fromkeys(LIFECYCLES, 0)
    series: dict[str, list[int]] = {k: [] for k in LIFECYCLES}
    for e in report.timeline:
        lifecycle = e.detail.split(" ", 1)[0]
        if lifecycle in live:
            if e.event == "node ready":
                live[lifecycle] += 1
            elif e.event in ("node released", "node gone"):
                live[lifecycle] = max(0, live[lifecycle] - 1)
        for k in LIFECYCLES:
            series[k].append(live[k])
    return series


LIVE_STOP = "generation parked (live resize)"
LIVE_RESIZE_ENDS = {"completed", "paused", "preempted", "fault"}  # (no next generation)


def trained_world(timeline: list[TimelineEntry]) -> list[int]:
    """The world size at each entry as training saw it: a live resize parks the ranks for a
    fraction of a second and they train on at the new size, so from its stop to the next
    generation's start the generation before still counts (not 0, as for a restart)."""
    out, live, last = [], False, 0
    for e in timeline:
        if e.event == LIVE_STOP:
            live = True
        elif e.event.startswith("generation ") or e.event in LIVE_RESIZE_ENDS:
            live = False
        out.append(last if live else e.world_size)
        if not live:
            last = e.world_size
    return out


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to install it."""


def _matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'spotrain[report]' (or pip install matplotlib)"
        ) from None


def plot(report: Report, path: Path) -> None:
    """The job picture (workers/cli/report_picture.py): world size, nodes by lifecycle, steps per
    second and cumulative cost over time, with notices, losses, growth, pauses and faults
    marked."""
    if not report.timeline:
        raise ValueError(f"job {report.name} has no timeline yet")
    _matplotlib()
    from spotrain.workers.cli import report_picture

    path.write_bytes(report_picture.png(report))


def to_html(report: Report, image: Path | None = None) -> str:
    """A self-contained page to share: the job picture embedded (the PNG at `image` if there
    is one, else drawn now; none without matplotlib or a timeline), then the same summary,
    timeline and cost tables as the terminal."""
    console = Console(record=True, width=120, file=io.StringIO())  # only the export is kept
    console.print(tables(report))
    body = console.export_html(inline_styles=True, code_format="<pre>{code}</pre>")
    picture = b""
    if image is not None and image.is_file():
        picture = image.read_bytes()
    elif report.timeline:
        try:
            _matplotlib()
            from spotrain.workers.cli import report_picture

            picture = report_picture.png(report)
        except PlotUnavailable:
            picture = b""
    img = (
        f'<img src="data:image/png;base64,{base64.b64encode(picture).decode()}" '
        'alt="the job picture" style="max-width:100%">'
        if picture
        else "<p>(no picture: pip install 'spotrain[report]')</p>"
    )
    title = html.escape(f"spotrain report: {report.name}")
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title></head>"
        f"<body><h1>{title}</h1>{img}{body}</body></html>"
    )
