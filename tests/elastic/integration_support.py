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

from spotrain.activities.local import LocalRuntime
from spotrain.elastic.job_store import JobStore
from spotrain.workflows.contract import (
    GenerationPlan,
    Member,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)
from spotrain.workflows.job.planner import local_batch_size
from tests.jobs import leftover_processes

WORLDS = {0: 2, 1: 3, 2: 2}  # generation -> ranks in `reclaim_then_loss`
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
    env: dict[str, str] = field(default_factory=dict)  # more rank environment

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

    def recorded_step(self, generation: int) -> int:
        """Rank 0's last step on record. Its --record line is written as the step ends; the
        progress it reports is throttled to about one a second, in which a fast step runs
        dozens of times (CI once saw a notice meant for step 10 land at step 47)."""
        path = self.record / f"gen-{generation}-rank-0.jsonl"
        text = path.read_text() if path.exists() else ""
        lines = text[: text.rfind("\n") + 1].splitlines()  # whole lines only
        return json.loads(lines[-1])["step"] if lines else 0

    def wait_for_step(self, p: GenerationPlan, step: int, timeout_s: float = 240) -> None:
        """Until rank 0 recorded `step`, failing with the ranks' logs."""
        deadline = time.monotonic() + timeout_s
        while (result := self.watch(p)).outcome == "progress" and (
            self.recorded_step(p.generation) < step
        ):
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

    def leftovers(self, within_s: float = 2.0) -> list[str]:
        """The job's processes still alive after `within_s` (tests/jobs.py says why wait)."""
        return leftover_processes(self.job, within_s)

    def reclaim_then_loss(self, first_step: int, every: int) -> tuple[int, int]:
        """2 ranks past `first_step`, then the elastic event; 3 ranks until a periodic
        checkpoint (every `every` steps), then SIGKILL; 2 ranks to the end. The two steps
        resumed from: (k, the notice's checkpoint; c, the last periodic one)."""
        gen0 = self.start(0, WORLDS[0])
        self.wait_for_step(gen0, first_step)
        notice = self.stop(gen0, graceful=True)  # save at the step boundary, ack, exit 0
        assert notice.acked_ranks == [0, 1] and not notice.forced, self.log(gen0)
        k = notice.checkpoint_step
        assert k is not None and first_step <= k < self.total_steps - 2 * every, k

        gen1 = self.start(1, WORLDS[1])
        self.wait_for_checkpoint(gen1, after=k)
        loss = self.stop(gen1, graceful=False)  # no notice: SIGKILL
        assert loss.forced and loss.acked_ranks == []
        c = loss.checkpoint_step
        assert c is not None and k < c < self.total_steps and c % every == 0, (k, c)

        gen2 = self.start(2, WORLDS[2])
        assert self.run_to_end(gen2).exit_codes == {r: 0 for r in range(WORLDS[2])}
        assert self.leftovers() == []
        return k, c

    def kept_records(self, k: int, c: int) -> dict[int, dict[int, list[dict[str, Any]]]]:
        """generation -> rank -> the steps that count (a lost generation's past c do not),
        checked: the steps add up, each rank took its uneven share of every global batch, and
        no sample was taken twice (the run must fit in one epoch of the dataset)."""
        rec = {g: self.records(g) for g in WORLDS}
        steps = {g: [e["step"] for e in rec[g][0]] for g in rec}
        assert steps[0] == list(range(1, k + 1))
        assert steps[1] == list(range(k + 1, steps[1][-1] + 1)) and steps[1][-1] >= c
        assert steps[2] == list(range(c + 1, self.total_steps + 1))
        kept = {
            g: {r: [e for e in es if g != 1 or e["step"] <= c] for r, es in rec[g].items()}
            for g in rec
        }
        for g, ranks in kept.items():
            shares = [
                local_batch_size(self.global_batch_size, WORLDS[g], r) for r in range(WORLDS[g])
            ]
            assert sorted(ranks) == list(range(WORLDS[g]))
            for r, entries in ranks.items():
                assert {len(e["indices"]) for e in entries} == {shares[r]}, (g, r)
                assert {e["world"] for e in entries} == {WORLDS[g]}
        taken = [i for rs in kept.values() for es in rs.values() for e in es for i in e["indices"]]
        assert len(taken) == self.total_steps * self.global_batch_size
        assert len(set(taken)) == len(taken)
        return kept
