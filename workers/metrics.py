"""Prometheus metrics and structured logs for the worker.

One endpoint serves both the Temporal SDK's own metrics (task latencies, poller counts...)
and spotrain's, because spotrain's instruments come from the same `Runtime` metric meter.
spotrain's figures are read from the jobs themselves (`status` query of every running job,
every `interval_s`): they stay right across worker restarts and need nothing in the workflow.

    runtime = setup(prometheus="0.0.0.0:9464", json_logs=True)   # before connect()
    asyncio.create_task(collect(client, JobMetrics(runtime.metric_meter), task_queue))
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import datetime, timedelta

from temporalio.client import Client
from temporalio.common import MetricMeter
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from spotrain.workflows.job.state import JobStatus

log = logging.getLogger("spotrain.metrics")
STOPPED = ("generation checkpointed", "generation stopped")


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines: time, level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created).astimezone().isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(prometheus: str | None = None, json_logs: bool = False) -> Runtime:
    """Configure logging and make a Runtime with a Prometheus endpoint at `prometheus`
    (host:port) the process default, so clients connected afterwards report through it."""
    handler = logging.StreamHandler()
    if json_logs:
        handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    metrics = PrometheusConfig(bind_address=prometheus) if prometheus else None
    runtime = Runtime(telemetry=TelemetryConfig(metrics=metrics))
    Runtime.set_default(runtime, error_if_already_set=False)
    return runtime


class JobMetrics:
    """spotrain's instruments. Counters advance by what each job's totals grew since the
    last look; gauges are the sum over running jobs."""

    def __init__(self, meter: MetricMeter) -> None:
        self.reclaims = meter.create_counter("spotrain_reclaims", "nodes reclaimed or lost")
        self.resizes = meter.create_counter("spotrain_resizes", "membership changes")
        self.faults = meter.create_counter("spotrain_faults", "failed or stalled generations")
        self.resize_seconds = meter.create_histogram_float(
            "spotrain_resize_duration_seconds", "generation stopped -> next one started", "s"
        )
        self.nodes = meter.create_gauge("spotrain_nodes", "live nodes by lifecycle")
        self.cost_rate = meter.create_gauge_float(
            "spotrain_cost_rate_usd_per_hour", "what running jobs' nodes cost per hour"
        )
        self.jobs = meter.create_gauge("spotrain_jobs", "running jobs by phase")
        self._seen: dict[str, JobStatus] = {}

    def observe(self, statuses: list[JobStatus]) -> None:
        nodes = {"spot": 0, "on-demand": 0}
        phases: dict[str, int] = dict.fromkeys(("Pending", "Running", "Resizing", "Paused"), 0)
        rate = 0.0
        for s in statuses:
            before = self._seen.get(s.name)
            self.reclaims.add(max(0, s.reclaims - (before.reclaims if before else 0)))
            self.resizes.add(max(0, s.resizes - (before.resizes if before else 0)))
            self.faults.add(max(0, s.faults - (before.faults if before else 0)))
            seen_until = before.timeline[-1].time if before and before.timeline else None
            stopped_at = None
            for e in s.timeline:
                if e.event in STOPPED:
                    stopped_at = e.time
                elif e.event == "generation started" and stopped_at is not None:
                    if seen_until is None or e.time > seen_until:
                        self.resize_seconds.record((e.time - stopped_at).total_seconds())
                    stopped_at = None
            for n in s.nodes:
                if n.state == "ready":
                    nodes[n.lifecycle] += 1
                    rate += n.price
            phases[s.phase] = phases.get(s.phase, 0) + 1
        self._seen = {s.name: s for s in statuses}
        for lifecycle, count in nodes.items():
            self.nodes.set(count, {"lifecycle": lifecycle})
        for phase, count in phases.items():
            self.jobs.set(count, {"phase": phase})
        self.cost_rate.set(rate)


async def running_statuses(client: Client, task_queue: str) -> list[JobStatus]:
    """The `status` of every running job this worker's task queue serves, asked all at once
    with a short deadline: one job that cannot answer does not hold up the rest."""
    query = (
        f"WorkflowType = 'TrainingJob' AND ExecutionStatus = 'Running' "
        f"AND TaskQueue = '{task_queue}'"
    )
    handles = [
        client.get_workflow_handle(wf.id, run_id=wf.run_id)
        async for wf in client.list_workflows(query)
    ]
    answers = await asyncio.gather(
        *(
            h.query("status", result_type=JobStatus, rpc_timeout=timedelta(seconds=5))
            for h in handles
        ),
        return_exceptions=True,
    )
    statuses = []
    for handle, answer in zip(handles, answers, strict=True):
        if isinstance(answer, JobStatus):
            statuses.append(answer)
        else:  # a job that cannot answer now is counted next time
            log.warning("metrics: no status from %s: %s", handle.id, answer)
    return statuses


async def collect(
    client: Client, metrics: JobMetrics, task_queue: str, interval_s: float = 15.0
) -> None:
    """Refresh spotrain's metrics until cancelled; a failed round is logged, not fatal."""
    while True:
        try:
            metrics.observe(await running_statuses(client, task_queue))
        except Exception as e:
            log.warning("metrics: collection failed: %s", e)
        await asyncio.sleep(interval_s)
