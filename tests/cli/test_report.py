"""Job reports rendered from a real finished job (dev server, simulated cloud and runtime, one
reclaim with notice): the cost table's arithmetic, the plot as a real picture, the HTML page,
and a clear message when matplotlib is missing."""

from __future__ import annotations

import asyncio
import io
import re
import socket
import sys
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path

import matplotlib.image
import pytest
import pytest_asyncio
from rich.console import Console
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.cli.report import (
    PlotUnavailable,
    Report,
    plot,
    print_report,
    to_html,
    trained_world,
)
from spotrain.workers.metrics import JobMetrics
from spotrain.workflows.job.state import JobResult, JobStatus, TimelineEntry
from tests.jobs import fast_runtime, fast_spec, simulated

FINAL_STATUS: list[JobStatus] = []  # the finished job's `status`, for the metrics test


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def finished(dev_env: WorkflowEnvironment) -> JobResult:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec(total_steps=150))
        while (status := await sim.status(handle)).world_size != 4:
            await asyncio.sleep(0.1)
        victim = next(n.node_id for n in status.nodes if n.rank == 1)
        deadline = datetime.now(UTC) + timedelta(seconds=30)
        await handle.signal("reclaim", {"node_id": victim, "deadline": deadline, "event_id": "r1"})
        result = await handle.result()
        FINAL_STATUS.append(await sim.status(handle))
        return result


def test_report_of_a_finished_job(finished: JobResult) -> None:
    report = Report.from_result(finished)
    assert (report.phase, report.finished, report.reclaims) == ("Succeeded", True, 1)
    cost = report.cost
    assert cost.spot is not None and cost.on_demand is not None
    assert cost.total == pytest.approx(cost.spot + cost.on_demand)
    assert cost.all_on_demand is not None and cost.all_on_demand > cost.total
    console = Console(file=io.StringIO(), width=200)
    print_report(report, console)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "generation checkpointed" in text and "reclaim notice for" in text
    assert "savings" in text and f"{cost.savings:.0%}" in text


def test_plot_is_a_real_picture(finished: JobResult, tmp_path: Path) -> None:
    path = tmp_path / "job.png"
    plot(Report.from_result(finished), path)
    assert path.stat().st_size > 20_000
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] >= 500 and pixels.shape[1] >= 900
    assert pixels[..., :3].std() > 0.05  # lines, labels and markers, not a blank canvas


def test_html_page_is_self_contained(finished: JobResult) -> None:
    page = to_html(Report.from_result(finished), Path("job.png"))
    assert page.startswith("<!doctype html>") and finished.name in page
    assert '<img src="data:image/png;base64,' in page and "generation started" in page
    assert 'src="job.png"' not in page  # the picture is in the page, not beside it


def test_plot_without_matplotlib_says_how_to_install(
    finished: JobResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(PlotUnavailable, match="pip install"):
        plot(Report.from_result(finished), tmp_path / "job.png")
    assert not (tmp_path / "job.png").exists()


def scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("spotrain_"):
            key, value = line.rsplit(" ", 1)
            key = re.sub(r',?service_name="[^"]*"', "", key).replace("{,", "{").replace("{}", "")
            values[key] = float(value)
    return values


def test_job_metrics_on_the_prometheus_endpoint(finished: JobResult) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=address)))
    metrics = JobMetrics(runtime.metric_meter)
    status = FINAL_STATUS[0]
    metrics.observe([status])
    metrics.observe([status])  # a second look at the same totals adds nothing
    values = scrape(address)
    assert values["spotrain_reclaims"] == 1
    assert values["spotrain_resizes"] == status.resizes >= 2  # the reclaim, then growing back
    assert values["spotrain_resize_duration_seconds_count"] == status.resizes
    assert values['spotrain_nodes{lifecycle="spot"}'] == 0  # a finished job holds nothing
    assert values["spotrain_cost_rate_usd_per_hour"] == 0


def test_a_live_resize_shows_the_world_that_trained_not_a_stop() -> None:
    """A live resize parks the ranks for a fraction of a second: the report and the picture
    go from 4 straight to 3, where a restart drops to 0 until the next generation starts."""
    t = datetime(2026, 11, 25, tzinfo=UTC)

    def at(i: int, event: str, world: int) -> TimelineEntry:
        return TimelineEntry(
            time=t + timedelta(seconds=i), generation=1, world_size=world, event=event, detail=""
        )

    timeline = [
        at(0, "generation started", 4),
        at(1, "generation parked (live resize)", 0),
        at(2, "gone", 0),
        at(3, "generation started", 3),
        at(4, "generation checkpointed", 0),
        at(5, "generation started", 3),
        at(6, "generation parked (live resize)", 0),
        at(7, "completed", 0),
    ]
    assert trained_world(timeline) == [4, 4, 4, 3, 0, 3, 3, 0]
