"""What every benchmark shares: spot traces, the Temporal servers, statistics and output.

Traces use the format of `../shared/traces/` (see its README): `{"metadata": {"gap_seconds":
G}, "data": [n0, n1, ...]}`, the number of spot nodes that could be held at each tick.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.binaries import temporal_cli, temporal_test_server
from spotrain.workflows import attributes

REPO = Path(__file__).resolve().parent.parent
SHARED_TRACES = REPO.parent / "shared" / "traces"
DEFAULT_TRACE = "availability_16-node_aws-08-27-2023_us-east-2b_v100_1.json"
ZONE_IN_NAME = re.compile(r"[a-z]{2}-[a-z]+-\d[a-z]")


@dataclass(frozen=True)
class Trace:
    """Spot capacity of one zone over time; past its end the trace repeats."""

    zone: str
    gap_s: float
    data: tuple[int, ...]

    @classmethod
    def load(cls, arg: str) -> Trace:
        """`ZONE=PATH` or `PATH` (the zone is read from the file name, e.g. us-east-2b)."""
        zone, _, path = arg.rpartition("=")
        found = ZONE_IN_NAME.search(Path(path).name)
        zone = zone or (found.group(0) if found else Path(path).stem)
        doc = json.loads(Path(path).read_text())
        data = tuple(int(n) for n in doc["data"])
        if not data:
            raise ValueError(f"{path}: empty trace")
        return cls(zone=zone, gap_s=float(doc["metadata"]["gap_seconds"]), data=data)

    @property
    def span_s(self) -> float:
        return self.gap_s * len(self.data)

    def at(self, offset_s: float) -> int:
        return self.data[int(offset_s // self.gap_s) % len(self.data)]

    def drops(self, until_s: float) -> list[float]:
        """Offsets (s) of the ticks where capacity falls, up to `until_s`."""
        out = []
        for k in range(1, int(until_s // self.gap_s) + 1):
            if self.data[k % len(self.data)] < self.data[(k - 1) % len(self.data)]:
                out.append(k * self.gap_s)
        return out


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


def write_json(path: Path | None, report: dict[str, Any]) -> None:
    """The machine-readable report: to `path` if given, else only the table is printed."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str))
