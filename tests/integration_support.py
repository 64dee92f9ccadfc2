"""Drives a framework integration's example through spotrain's local runtime: real rank
processes (gloo, CPU), a reclaim with notice (the elastic event, a graceful stop), then a node
lost without notice (SIGKILL), then a generation that runs to the end."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.testing import ActivityEnvironment

from spotrain.activities.local import LocalRuntime, job_processes
from spotrain.activities.store import JobStore
from spotrain.workflows.contract import (
    GenerationPlan,
    Member,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass
class Scenario:
    """One job's generations; `command` runs one rank, `record` is the example's record dir."""

    tmp_path: Path
    job: str
    command: list[str]
    total_steps: int
    global_batch_size: int
    scale_config: dict[int, dict[str, Any]]
    job_type: str = "pytorch"
    procs_per_node: int = 1
    env: dict[str, str] = field(default_factory=dict)  # more worker environment

    def __post_init__(self) -> None:
        self.activities = ActivityEnvironment()
        self.rt = LocalRuntime(self.tmp_path / "rt")
        self.record = self.tmp_path / "record"
        self.checkpoint = f"file://{self.tmp_path}/store"

    def plan(self, generation: int, nodes: int) -> GenerationPlan:
        return GenerationPlan(
            job=self.job,
            generation=generation,
            members=[
                Member(node_id=f"node-{i}", address="127.0.0.1", procs=self.procs_per_node)
                for i in range(nodes)
            ],
            command=self.command,
            env={**OFFLINE, **self.env},
            job_type=self.job_type,
            checkpoint=self.checkpoint,
            scale_config=self.scale_config.get(nodes * self.procs_per_node, {}),
            global_batch_size=self.global_batch_size,
            total_steps=self.total_steps,
        )

    def start(self, generation: int, nodes: int) -> GenerationPlan:
        p = self.plan(generation, nodes)
        self.activities.run(self.rt.start_generation, p)
        return p

    def watch(self, p: GenerationPlan) -> WatchResult:
        req = WatchRequest(
            job=p.job,
            generation=p.generation,
            world_size=p.world_size,
            checkpoint=p.checkpoint,
            report_after_s=0.5,
        )
        return self.activities.run(self.rt.watch_generation, req)

    def log(self, p: GenerationPlan) -> str:
        return "\n".join(
            self.rt.log_path(p.job, r, p.generation).read_text()[-3000:]
            for r in range(len(self.rt._ranks(p.job, p.generation)))
        )

    def wait_for_step(self, p: GenerationPlan, step: int, timeout_s: float = 240) -> None:
        """Until rank 0 reported `step` (progress), failing with the ranks' logs."""
        deadline = time.monotonic() + timeout_s
        while (result := self.watch(p)).outcome == "progress" and (result.step or 0) < step:
            assert time.monotonic() < deadline, f"no progress to step {step}:\n{self.log(p)}"
        assert result.outcome == "progress", (result, self.log(p))

    def wait_for_checkpoint(self, p: GenerationPlan, after: int, timeout_s: float = 240) -> int:
        """Until a periodic checkpoint past step `after` is the job's latest; its step."""
        deadline = time.monotonic() + timeout_s
        while True:
            latest = JobStore(self.checkpoint).latest_checkpoint()
            if latest and latest["step"] > after:
                return latest["step"]
            assert self.watch(p).outcome == "progress", self.log(p)
            assert time.monotonic() < deadline, f"no checkpoint past {after}:\n{self.log(p)}"

    def stop(self, p: GenerationPlan, graceful: bool) -> StopResult:
        req = StopRequest(
            job=p.job,
            generation=p.generation,
            world_size=p.world_size,
            checkpoint=p.checkpoint,
            graceful=graceful,
            grace_s=120,
        )
        return self.activities.run(self.rt.stop_generation, req)

    def run_to_end(self, p: GenerationPlan, timeout_s: float = 300) -> WatchResult:
        deadline = time.monotonic() + timeout_s
        while (result := self.watch(p)).outcome == "progress":
            assert time.monotonic() < deadline, f"generation {p.generation} did not finish"
        assert result.outcome == "completed", (result, self.log(p))
        return result

    def records(self, generation: int) -> dict[int, list[dict[str, Any]]]:
        """rank -> its JSON lines for `generation` (the examples' --record format)."""
        out = {}
        for f in self.record.glob(f"gen-{generation}-rank-*.jsonl"):
            out[int(f.stem.rsplit("-", 1)[1])] = [json.loads(x) for x in f.read_text().splitlines()]
        return out

    def leftovers(self) -> list[int]:
        return job_processes(self.job)
