"""Job reports rendered from a real finished job (dev server, simulated cloud and runtime, one
reclaim with notice): the cost table's arithmetic, the plot as a real picture, the HTML page,
and a clear message when matplotlib is missing."""

from __future__ import annotations

import asyncio
import io
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import matplotlib.image
import pytest
import pytest_asyncio
from rich.console import Console
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.report import PlotUnavailable, Report, plot, print_report, to_html
from spotrain.workflows.state import JobResult

from .jobs import fast_runtime, fast_spec, simulated


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def finished(dev_env: WorkflowEnvironment) -> JobResult:
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(fast_spec(total_steps=150))
        while (status := await sim.status(handle)).world_size != 4:
            await asyncio.sleep(0.1)
        victim = next(n.node_id for n in status.nodes if n.rank == 1)
        deadline = datetime.now(UTC) + timedelta(seconds=30)
        await handle.signal("reclaim", {"node_id": victim, "deadline": deadline, "event_id": "r1"})
        return await handle.result()


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
    assert '<img src="job.png"' in page and "generation started" in page


def test_plot_without_matplotlib_says_how_to_install(
    finished: JobResult, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(PlotUnavailable, match="pip install"):
        plot(Report.from_result(finished), tmp_path / "job.png")
    assert not (tmp_path / "job.png").exists()
