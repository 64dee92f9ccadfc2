"""What every benchmark shares: spot traces, the Temporal servers, statistics and output.

Traces use the format of `../shared/traces/` (see its README): `{"metadata": {"gap_seconds":
G}, "data": [n0, n1, ...]}`, the number of spot nodes that could be held at each tick.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.embedded.binaries import temporal_cli, temporal_test_server
from spotrain.workers.embedded.spot_market import Trace
from spotrain.workflows.job import attributes

REPO = Path(__file__).resolve().parent.parent
SHARED_TRACES = REPO.parent / "shared" / "traces"
DEFAULT_TRACE = "availability_16-node_aws-08-27-2023_us-east-2b_v100_1.json"


def cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop(
    procs: Sequence[subprocess.Popen[Any]], signum: int = signal.SIGTERM, grace_s: float = 30
) -> None:
    """Send each live process `signum`, then wait for each up to `grace_s`; kill what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def load_traces(args: Sequence[str]) -> list[Trace]:
    """The traces named on the command line, or the default shared one; zones must differ."""
    traces = [Trace.load(a) for a in args] or [Trace.load(str(SHARED_TRACES / DEFAULT_TRACE))]
    zones = [t.zone for t in traces]
    if len(set(zones)) != len(zones):
        raise ValueError(f"two traces for one zone in {zones}: name them ZONE=PATH")
    return traces


async def _register_attributes(env: WorkflowEnvironment) -> None:
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace="default",
            search_attributes={key.name: key.indexed_value_type for key in attributes.ALL},
        )
    )


@asynccontextmanager
async def time_skipping_server() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server: hours of a trace pass in milliseconds."""
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter, test_server_existing_path=temporal_test_server()
    )
    try:
        await _register_attributes(env)
        yield env
    finally:
        await env.shutdown()


@asynccontextmanager
async def dev_server(*dynamic_config: str) -> AsyncIterator[WorkflowEnvironment]:
    """A real `temporal server start-dev` (in memory), as in production but on loopback;
    `dynamic_config`: "key=value" settings (e.g. limit.historyCount.suggestContinueAsNew)."""
    extra = [a for kv in dynamic_config for a in ("--dynamic-config-value", kv)]
    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=temporal_cli(),
        search_attributes=attributes.ALL,
        dev_server_extra_args=["--log-level", "error", *extra],
    )
    try:
        yield env
    finally:
        await env.shutdown()


def summary(values: Sequence[float]) -> dict[str, float]:
    """Median, p99 (nearest rank), min, max and count: never one absolute time."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "n": len(ordered),
        "median": statistics.median(ordered),
        "p99": p99,
        "min": ordered[0],
        "max": ordered[-1],
    }


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A plain-text table, numbers rounded for reading (the JSON keeps them whole)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
        return "-" if value is None else str(value)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def publish(
    report: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    path: Path | None,
) -> None:
    """Print the JSON report, then the same rows as a table; also write the JSON to `path`."""
    text = json.dumps(report, indent=1, default=str)
    print(text)
    print()
    print(table(rows, columns))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
