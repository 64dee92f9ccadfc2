"""What a job's checkpoints cost, from the records the training library leaves in the store:
pure functions, shared by the runtimes (which read the records) and the workflow (which shows
them in `status` and the result, and warns when they do not fit in a reclaim notice)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from spotrain.workflows.job.planner import grace_for_notice

EC2_NOTICE_S = 120.0  # a spot interruption warning comes two minutes ahead


class CheckpointStats(BaseModel):
    """The complete checkpoints still on record, and those that failed to load."""

    count: int = 0
    p50_s: float = Field(0.0, description="start to durable, median")
    p99_s: float = 0.0
    blocked_p50_s: float = Field(0.0, description="training blocked per checkpoint, median")
    blocked_p99_s: float = 0.0
    last_bytes: int = 0
    kinds: dict[str, int] = Field(default_factory=dict, description="periodic, notice, final")
    skipped: list[int] = Field(default_factory=list, description="steps that failed to load")


class CheckpointReport(CheckpointStats):
    """`status` and the result: the stats, against the time a reclaim notice leaves."""

    notice_s: float = Field(description="time a 2-minute notice leaves to checkpoint")
    warning: str | None = None
    young_daly_s: float | None = Field(
        None, description="periodic interval from cost and losses without notice"
    )


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(records: list[dict[str, Any]], skipped: list[dict[str, Any]]) -> CheckpointStats:
    """The store's checkpoint records (see workers/elastic/job_store.py) as stats."""
    durations = [float(r["duration_s"]) for r in records]
    blocked = [float(r["blocked_s"]) for r in records]
    kinds: dict[str, int] = {}
    for r in records:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    return CheckpointStats(
        count=len(records),
        p50_s=percentile(durations, 50),
        p99_s=percentile(durations, 99),
        blocked_p50_s=percentile(blocked, 50),
        blocked_p99_s=percentile(blocked, 99),
        last_bytes=int(records[-1]["bytes"]) if records else 0,
        kinds=kinds,
        skipped=sorted(int(r["step"]) for r in skipped),
    )


def young_daly_interval_s(cost_s: float, mean_time_between_losses_s: float) -> float:
    """The checkpoint interval that minimises expected lost work plus checkpoint time:
    sqrt(2 x cost x MTBF) (Young 1974, Daly 2006)."""
    return math.sqrt(2 * cost_s * mean_time_between_losses_s)


def report(
    stats: CheckpointStats | None,
    graceful_shutdown_timeout_s: float,
    losses_without_notice: int,
    running_s: float,
) -> CheckpointReport | None:
    """Stats plus the notice check and, once a loss without notice was seen, Young/Daly."""
    if stats is None:
        return None
    notice_s = grace_for_notice(EC2_NOTICE_S, graceful_shutdown_timeout_s)
    warning = None
    if stats.count and stats.p99_s > notice_s:
        warning = (
            f"checkpoint p99 {stats.p99_s:.1f} s exceeds the {notice_s:.0f} s a reclaim notice "
            "leaves: a reclaim will lose work (raise graceful_shutdown_timeout_s, or make "
            "checkpoints smaller)"
        )
    interval = None
    if stats.count and losses_without_notice and running_s > 0:
        interval = young_daly_interval_s(stats.blocked_p50_s, running_s / losses_without_notice)
    return CheckpointReport(
        **stats.model_dump(), notice_s=notice_s, warning=warning, young_daly_s=interval
    )


def describe(c: CheckpointReport | None) -> str:
    """One line (two with a warning) for `status` and `report`; empty without checkpoints."""
    if c is None:
        return ""
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(c.kinds.items()))
    line = (
        f"checkpoints {c.count} kept ({kinds}): p50 {c.p50_s:.2f} s, p99 {c.p99_s:.2f} s, "
        f"training blocked p50 {c.blocked_p50_s:.2f} s, last {c.last_bytes / 1e3:,.0f} kB"
    )
    if c.young_daly_s is not None:
        line += f"; Young/Daly interval {c.young_daly_s:.0f} s"
    if c.skipped:
        line += f"\n[yellow]skipped as unloadable: steps {', '.join(map(str, c.skipped))}[/]"
    if c.warning:
        line += f"\n[red]warning: {c.warning}[/]"
    return line
