"""The worker side of spotrain's worker contract, for any training script (no torch here).

    from spotrain.workers import elastic

    s = elastic.wait_for_gang()                 # the generation's settings, once all nodes are up
    for step in range(start, s.total_steps):
        ...train one step...
        elastic.report_progress(step + 1)       # rank 0 only, throttled
        if elastic.elastic_event_detected():    # agree across ranks, then:
            ...save a checkpoint (all ranks)...
            elastic.mark_checkpoint(step + 1, path)   # rank 0, after the save completed
            elastic.ack_checkpoint(step + 1)          # every rank; then exit 0
    elastic.mark_done(s.total_steps)            # rank 0; barrier; every rank exits 0

Exit conventions: 0 after an elastic event (checkpointed and acked), 0 after the completion
marker (job done), anything else is a fault. Ranks must not exit 0 before `mark_done` is on
record (a barrier after it), or the runtime sees a rank that stopped for no reason.

Gang start: `wait_for_gang` holds the rank until the runtime has every node of the generation
up (on Kubernetes: all its pods Running and Ready), so no rank trains, or times out in its
rendezvous, beside a pod still pulling its image. Call it before the process group.

The elastic event: the control file (`SPOTRAIN_CONTROL_FILE`) holds non-empty content. It may
not exist yet (no event). Locally the runtime writes it; on Kubernetes a downwardAPI volume
surfaces a pod annotation there (empty while the annotation is absent).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from spotrain.activities import worker_env
from spotrain.activities.store import JobStore
from spotrain.workflows.planner import local_batch_size

PROGRESS_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Settings:
    """This rank's view of its generation, read once from the environment."""

    job: str
    generation: int
    rank: int
    local_rank: int
    world_size: int
    node_id: str
    checkpoint: str
    control_file: str
    total_steps: int
    scale_config: dict[str, Any] = field(default_factory=dict)
    global_batch_size: int | None = None
    local_batch_size: int | None = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def batch_slice(self) -> range:
        """This rank's positions within each global batch: ranks in order, uneven sizes (the
        same split the runtime used for `local_batch_size`). Needs global_batch_size."""
        if self.global_batch_size is None:
            raise ValueError("the job spec sets no global_batch_size")
        sizes = [
            local_batch_size(self.global_batch_size, self.world_size, r)
            for r in range(self.rank + 1)
        ]
        start = sum(sizes[:-1])
        return range(start, start + sizes[-1])


def _optional_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


@cache
def settings() -> Settings:
    """The generation's settings; raises KeyError naming a variable the runtime did not set."""
    env = os.environ
    return Settings(
        job=env[worker_env.JOB],
        generation=int(env[worker_env.GENERATION]),
        rank=int(env["RANK"]),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env["WORLD_SIZE"]),
        node_id=env.get(worker_env.NODE_ID, ""),
        checkpoint=env[worker_env.CHECKPOINT],
        control_file=env.get(worker_env.CONTROL_FILE, ""),
        total_steps=int(env[worker_env.TOTAL_STEPS]),
        scale_config=json.loads(env.get(worker_env.SCALE_CONFIG) or "{}"),
        global_batch_size=_optional_int(worker_env.GLOBAL_BATCH_SIZE),
        local_batch_size=_optional_int(worker_env.LOCAL_BATCH_SIZE),
    )


@cache
def store() -> JobStore:
    """The job's checkpoint store (acks, progress, markers), opened once."""
    return JobStore(settings().checkpoint)


def wait_for_gang(poll_s: float = 0.2) -> Settings:
    """Block until the runtime marked this generation started (all its nodes up); then the
    generation's settings. A rolled-back gang never gets the mark: its pods are deleted."""
    s = settings()
    while not store().started(s.generation):
        time.sleep(poll_s)
    return s


class _ControlFile:
    """Latches the elastic event; reads the file only when its stat changes (cheap per step)."""

    def __init__(self) -> None:
        self.seen: tuple[int, int, int] | None = None
        self.event = False

    def check(self, path: str) -> bool:
        if self.event or not path:
            return self.event
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self.seen:
            self.seen = key
            try:
                with open(path) as f:
                    self.event = bool(f.read().strip())
            except FileNotFoundError:
                return False
        return self.event


_control = _ControlFile()


def elastic_event_detected() -> bool:
    """True once the orchestrator asked this generation to checkpoint and stop (it stays True).
    Ranks may see it a step apart: agree (e.g. all-reduce the flag) before saving."""
    return _control.check(settings().control_file)


def ack_checkpoint(step: int) -> None:
    """Every rank, after the checkpoint at `step` is complete: 'I am safe to stop'."""
    s = settings()
    store().write_ack(s.generation, s.rank, step, time.time())


_last_progress = 0.0


def report_progress(step: int, force: bool = False) -> None:
    """Rank 0 only (others return); at most about once a second unless `force`."""
    global _last_progress
    s = settings()
    now = time.monotonic()
    if not s.is_rank0 or (not force and now - _last_progress < PROGRESS_INTERVAL_S):
        return
    _last_progress = now
    store().write_progress(s.generation, step, time.time())


def mark_checkpoint(step: int, path: str) -> None:
    """Rank 0, once the checkpoint at `step` is completely written: the job resumes from it."""
    if settings().is_rank0:
        store().write_latest_checkpoint(step, path)


def latest_checkpoint() -> dict[str, Any] | None:
    """{"step", "path"} of the last complete checkpoint, or None: where to resume from."""
    return store().latest_checkpoint()


def mark_done(step: int) -> None:
    """Rank 0, when training finished: progress (forced) and the completion marker."""
    if settings().is_rank0:
        report_progress(step, force=True)
        store().write_done(step, time.time())
