"""The pure checkpoint figures: percentiles, the notice warning, Young/Daly, and the workflow
state's view of them (what `status` and the result carry)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from temporalio import activity
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedRuntime
from spotrain.workflows import contract
from spotrain.workflows.contract import WatchRequest, WatchResult
from spotrain.workflows.job.checkpoints import (
    EC2_NOTICE_S,
    describe,
    percentile,
    report,
    summarize,
    young_daly_interval_s,
)
from spotrain.workflows.job.state import JobState
from spotrain.workflows.spec import parse_spec
from tests.jobs import job_spec, simulated


def record(step: int, duration: float, blocked: float, kind: str = "periodic") -> dict:
    return {"step": step, "duration_s": duration, "blocked_s": blocked, "kind": kind, "bytes": 10}


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) == 0.0
    assert percentile([5.0, 1.0, 9.0], 50) == 5.0


def test_summarize_counts_kinds_and_skipped_steps() -> None:
    records = [record(10, 2.0, 0.1), record(20, 4.0, 0.2), record(30, 3.0, 3.0, "notice")]
    stats = summarize(records, [{"step": 40}])
    assert stats.count == 3 and stats.kinds == {"periodic": 2, "notice": 1}
    assert (stats.p50_s, stats.p99_s) == (3.0, 4.0)
    assert (stats.blocked_p50_s, stats.blocked_p99_s) == (0.2, 3.0)
    assert stats.skipped == [40] and stats.last_bytes == 10


def test_warning_when_p99_exceeds_what_a_notice_leaves() -> None:
    fast = summarize([record(10, 20.0, 1.0)], [])
    slow = summarize([record(10, 20.0, 1.0), record(20, 90.0, 1.0)], [])
    # graceful 60 s: a 2-minute notice leaves min(60, 120 - 5) = 60 s
    assert report(fast, 60, 0, 100).warning is None
    warned = report(slow, 60, 0, 100)
    assert warned.notice_s == 60 and "p99 90.0 s exceeds the 60 s" in warned.warning
    # a long graceful timeout is cut by the notice itself
    assert report(slow, 600, 0, 100).notice_s == EC2_NOTICE_S - 5
    assert report(slow, 600, 0, 100).warning is None
    assert report(None, 60, 0, 100) is None


def test_young_daly_only_once_a_loss_without_notice_was_seen() -> None:
    assert young_daly_interval_s(2.0, 3600.0) == pytest.approx(math.sqrt(2 * 2 * 3600))
    stats = summarize([record(10, 5.0, 2.0)], [])
    assert report(stats, 60, 0, 7200).young_daly_s is None
    # two losses in two hours: MTBF 3600 s, cost = training blocked (2 s)
    assert report(stats, 60, 2, 7200).young_daly_s == pytest.approx(120.0)
    assert "Young/Daly interval 120 s" in describe(report(stats, 60, 2, 7200))


def test_job_state_reports_checkpoints_in_status_and_result() -> None:
    spec = parse_spec(
        {
            "name": "j",
            "command": ["x"],
            "total_steps": 10,
            "spot": {
                "region": "us-east-1",
                "instance_types": [{"name": "m5.large", "on_demand_price": 0.1}],
            },
            "checkpoint": "s3://bucket/j",
            "elastic": {"graceful_shutdown_timeout_s": 30},
        }
    )
    assert spec.checkpoint_keep == 3
    s = JobState.new(spec)
    now = datetime(2026, 11, 23, tzinfo=UTC)
    s.submitted_at = now - timedelta(hours=1)
    assert s.accounts(now)["checkpoints"] is None
    s.checkpoints = summarize([record(10, 45.0, 0.5)], [{"step": 20}])
    s.losses = 1
    c = s.accounts(now)["checkpoints"]
    assert c.warning and c.notice_s == 30 and c.skipped == [20]
    assert c.young_daly_s == pytest.approx(math.sqrt(2 * 0.5 * 3600))
    text = describe(c)
    assert "skipped as unloadable: steps 20" in text and "warning" in text
    with pytest.raises(ValueError, match="checkpoint_keep"):
        parse_spec({**spec.model_dump(mode="json"), "checkpoint_keep": 0})


class TimedCheckpoints(SimulatedRuntime):
    """The simulated runtime, reporting checkpoint records as the training library leaves them
    in the store (a stand-in for the store: tests/elastic/test_checkpoint.py writes them for real):
    90 s to durable, and step 5 skipped as unloadable."""

    @activity.defn(name=contract.WATCH_GENERATION)
    def watch_generation(self, req: WatchRequest) -> WatchResult:
        result = super().watch_generation(req)
        stats = summarize([record(10, 90.0, 1.0)], [{"step": 5}])
        return result.model_copy(update={"checkpoints": stats})


async def test_job_warns_once_and_reports_skipped_checkpoints(ts_env: WorkflowEnvironment) -> None:
    spec = job_spec(total_steps=3_600)  # graceful_shutdown_timeout_s 60: p99 90 s does not fit
    async with simulated(ts_env.client, runtime=TimedCheckpoints()) as sim:
        result = await (await sim.start(spec)).result()
    c = result.checkpoints
    assert c is not None and c.p99_s == 90.0 and c.skipped == [5] and c.notice_s == 60
    assert c.warning and "exceeds the 60 s" in c.warning
    events = [e.event for e in result.timeline]
    assert events.count("checkpoints too slow") == 1  # said once, not on every progress report
    assert events.count("checkpoint skipped") == 1
