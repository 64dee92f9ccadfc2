"""The job picture from a made-up timeline: which entries get which marker, the steps-per-second
panel, cumulative cost against all on-demand, the legend outside the panels, and the HTML page
carrying the picture inside it."""

from __future__ import annotations

import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spotrain.workers.cli import report_picture
from spotrain.workers.cli.report import Cost, Report, to_html
from spotrain.workflows.job.state import Phase, TimelineEntry

T0 = datetime(2026, 11, 25, tzinfo=UTC)


def at(s: float, event: str, world: int, detail: str = "") -> TimelineEntry:
    return TimelineEntry(
        time=T0 + timedelta(seconds=s), generation=1, world_size=world, event=event, detail=detail
    )


def report() -> Report:
    """4 spot nodes from 0 s; a notice at 100 s (live: 4 -> 3); a node lost without notice at
    200 s (restart, 3 -> 2); growth back to 3 at 260 s; paused at 300 s; resumed; a fault."""
    ready = [at(0, "node ready", 0, f"spot m5.large us-east-1a i-{n}") for n in range(4)]
    timeline = [
        *ready,
        at(10, "generation started", 4, "4 node(s), world size 4 (was 0)"),
        at(
            100,
            "generation parked (live resize)",
            4,
            "reclaim notice for i-0; resume from step 900",
        ),
        at(100, "node gone", 4, "spot i-0: reclaimed"),
        at(101, "generation started", 3, "3 node(s), world size 3 (was 4)"),
        at(200, "generation stopped", 0, "i-1 lost; resume from step 1400"),
        at(200, "node gone", 0, "spot i-1: lost"),
        at(210, "generation started", 2, "2 node(s), world size 2 (was 3)"),
        at(250, "node ready", 2, "spot m5.large us-east-1b i-4"),
        at(255, "generation checkpointed", 0, "grow: 2 -> 3 node(s); resume from step 1600"),
        at(260, "generation started", 3, "3 node(s), world size 3 (was 2)"),
        at(300, "generation checkpointed", 0, "pause; resume from step 1800"),
        at(300, "paused", 0, "by the user"),
        at(400, "resumed", 0),
        at(410, "generation started", 3, "3 node(s), world size 3 (was 0)"),
        at(450, "fault", 0, "rank 2 exited 1"),
        at(460, "generation started", 3, "3 node(s), world size 3 (was 0)"),
        at(560, "completed", 0, "step 2400"),
    ]
    return Report(
        name="pic",
        phase=Phase.SUCCEEDED,
        finished=True,
        failure=None,
        generations=6,
        reclaims=2,
        faults=1,
        resizes=4,
        steps_done=2400,
        total_steps=None,
        steps_lost=100,
        node_hours={"spot": 0.5, "on-demand": 0.0},
        cost=Cost(total=0.05, spot=0.05, on_demand=0.0, all_on_demand=0.15, savings=2 / 3),
        timeline=timeline,
    )


def test_markers_say_why_the_picture_changes() -> None:
    assert report_picture.markers(report()) == [
        (100.0, "notice"),
        (200.0, "lost"),
        (260.0, "growth"),
        (300.0, "pause"),
        (400.0, "resume"),
        (450.0, "fault"),
    ]


def test_a_scale_in_and_a_notice_for_a_node_not_training_yet_are_marked() -> None:
    """A notice for a node that was still booting stops no generation: its `node gone` is
    the only entry to mark; one for a training member is marked once, at its stop."""
    r = report()
    r.timeline = [
        at(0, "generation started", 2, "2 node(s), world size 2 (was 0)"),
        at(50, "node gone", 2, "spot i-9: reclaimed"),  # ordered, not a member yet
        at(80, "generation checkpointed", 2, "reclaim notice for i-0, i-1; resume from step 9"),
        at(80, "node gone", 2, "spot i-0: reclaimed"),
        at(80, "node gone", 2, "spot i-1: reclaimed"),
        at(90, "scale in", 0, "removing i-2; target 1 nodes"),
    ]
    assert report_picture.markers(r) == [(50.0, "notice"), (80.0, "notice"), (90.0, "scale in")]


def test_progress_is_each_generations_steps_per_second() -> None:
    segments = [(s.start, s.end, round(s.rate, 3)) for s in report_picture.progress(report())]
    assert segments == [
        (10.0, 100.0, 10.0),  # 0 -> 900 in 90 s
        (101.0, 200.0, round(500 / 99, 3)),
        (210.0, 255.0, round(200 / 45, 3)),
        (260.0, 300.0, 5.0),
        (460.0, 560.0, 6.0),  # the generation that faulted recorded no step: left out
    ]


def test_cumulative_cost_ends_at_the_jobs_cost_and_all_on_demand() -> None:
    r = report()
    paid, all_on_demand = report_picture.cumulative_cost(r) or ([], [])
    hours = sum(n for n in [4 * 100, 3 * 100, 2 * 50, 3 * 310]) / 3600  # node-seconds held
    assert paid[-1] == pytest.approx(0.05 / 0.5 * hours)
    assert all_on_demand[-1] == pytest.approx(3 * paid[-1])
    assert paid == sorted(paid)  # never goes down
    r.node_hours = None
    assert report_picture.cumulative_cost(r) is None


def test_the_picture_has_four_panels_and_the_legend_outside_them(tmp_path: Path) -> None:
    fig = report_picture.figure(report())
    try:
        axes = fig.get_axes()
        assert [ax.get_ylabel() for ax in axes] == ["world size", "nodes", "steps / s", "USD"]
        (legend,) = fig.legends
        labels = [t.get_text() for t in legend.get_texts()]
        for label in ("reclaim notice", "lost without notice", "growth", "paused", "fault"):
            assert label in labels
        assert {"world size", "spot nodes", "cost so far", "all on-demand"} <= set(labels)
        assert "steps/s (generation average)" in labels
        looks = [(h.get_color(), h.get_linestyle()) for h in legend.legend_handles]
        assert len(set(looks)) == len(looks), dict(zip(labels, looks, strict=True))
        fig.canvas.draw()
        box = legend.get_window_extent()
        assert all(box.x0 >= ax.get_window_extent().x1 for ax in axes)  # beside, not over
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
    assert report_picture.png(report()).startswith(b"\x89PNG")


def test_the_html_page_carries_its_picture(monkeypatch: pytest.MonkeyPatch) -> None:
    page = to_html(report())
    assert '<img src="data:image/png;base64,iVBOR' in page and 'src="pic' not in page
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert "no picture: pip install" in to_html(report())
