"""The rank side of spotrain's rank contract, for any training script (no torch here).

    from spotrain import elastic

    s = elastic.wait_for_gang()                 # the generation's settings, once all nodes are up
    for step in range(start, s.total_steps):
        with elastic.busy():                    # optional: this rank's own work (stragglers)
            ...load the batch, forward...
        ...backward, optimizer step...
        elastic.report_progress(step + 1)       # every rank: its step times; rank 0: progress
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

The elastic event reaches the rank through the control channel (workers/elastic/control.py): daemon
threads, started by the first `wait_for_gang` or `elastic_event_detected`, poll the
generation's control record in the checkpoint store (every 0.05 s on file://, 0.25 s on
s3://), the runtime's control file (`SPOTRAIN_CONTROL_FILE`) as a fallback, and EC2 instance
metadata where `SPOTRAIN_IMDS_ENDPOINT` is set (workers/elastic/imds.py).
`elastic_event_detected()` only reads the latched flag.

SIGTERM is an elastic event too (a pod deleted, a node drained, an eviction): the library
installs a handler that latches the event, so the loop checkpoints within its grace period and
exits as after any elastic event; a second SIGTERM ends the process. It is installed only if
SIGTERM still has its default action (a script's own handler wins) and not with
`SPOTRAIN_SIGTERM=0`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from spotrain.elastic import environment
from spotrain.elastic.control import Channel, ControlFile, StoreRecord, poll_interval
from spotrain.elastic.imds import Imds
from spotrain.elastic.job_store import JobStore
from spotrain.elastic.step_times import STUCK_AFTER_S, StepClock
from spotrain.workflows.job.planner import local_batch_size

PROGRESS_INTERVAL_S = 1.0
STEP_TIMES_INTERVAL_S = 5.0  # one small write per rank: about 720 an hour (S3 PUTs)


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
    local_world_size: int = 1  # this node's processes (a sharded model's shard group)
    peer_copy: bool = False  # elastic.peer_copy: a ring neighbour's shards in memory (sharded.py)

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
        job=env[environment.JOB],
        generation=int(env[environment.GENERATION]),
        rank=int(env["RANK"]),
        local_rank=int(env.get("LOCAL_RANK", "0")),
        world_size=int(env["WORLD_SIZE"]),
        node_id=env.get(environment.NODE_ID, ""),
        checkpoint=env[environment.CHECKPOINT],
        control_file=env.get(environment.CONTROL_FILE, ""),
        total_steps=int(env[environment.TOTAL_STEPS]),
        scale_config=json.loads(env.get(environment.SCALE_CONFIG) or "{}"),
        global_batch_size=_optional_int(environment.GLOBAL_BATCH_SIZE),
        local_batch_size=_optional_int(environment.LOCAL_BATCH_SIZE),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
        peer_copy=env.get(environment.PEER_COPY) == "1",
    )


@cache
def store() -> JobStore:
    """The job's checkpoint store (acks, progress, markers), opened once."""
    return JobStore(settings().checkpoint)


def wait_for_gang(poll_s: float | None = None) -> Settings:
    """Block until the runtime marked this generation started (all its nodes up); then the
    generation's settings. A rolled-back gang never gets the mark: its pods are deleted.
    Polled every 0.2 s on s3://, 0.02 s on files (a live resize's joiner waits on it)."""
    s = settings()
    if poll_s is None:
        poll_s = 0.2 if s.checkpoint.startswith("s3://") else 0.02
    channel = _channel or _start()
    if (started := store().start_record(s.generation)) is None:
        store().mark_waiting(s.generation, s.rank, time.time())
    while started is None:
        if channel.latched:  # stopped before it started: nothing to checkpoint
            logging.getLogger("spotrain.elastic").warning("elastic event before the gang start")
            raise SystemExit(0)
        time.sleep(poll_s)
        started = store().start_record(s.generation)
    # Where rank 0 turned out to be reachable (a pod's IP: no wait for its DNS record).
    os.environ.update(started.get("rendezvous") or {})
    return s


SIGTERM_ENV = "SPOTRAIN_SIGTERM"
_channel: Channel | None = None
_listeners: list[Callable[[dict[str, Any]], None]] = []  # every generation's channel calls them
_start_lock = threading.Lock()


def _start() -> Channel:
    """Start this rank's control channel (once) and, in the main thread, the SIGTERM handler."""
    global _channel
    with _start_lock:
        if _channel is not None:
            return _channel
        s, channel, records = settings(), Channel(), store()
        channel.listeners = _listeners
        channel.watch(StoreRecord(records, s.generation, poll_interval(records)))
        if s.control_file:
            channel.watch(ControlFile(s.control_file, poll_interval()))
        imds = Imds.from_env(s.node_id, lambda n: store().report_notice(s.generation, n))
        if imds is not None:
            channel.watch(imds)
        if (
            os.environ.get(SIGTERM_ENV) != "0"
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, _on_sigterm)
        ):
            signal.signal(signal.SIGTERM, _on_sigterm)
        _channel = channel
        return channel


sigterm_received = False  # a parked rank (live.py) leaves on it


def _on_sigterm(signum: int, _frame: object) -> None:
    global sigterm_received
    sigterm_received = True
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one ends the process
    if _channel is not None:
        _channel.raise_event("SIGTERM", {"kind": "stop"})


def next_generation_settings() -> Settings:
    """Live resize (live.py), once the runtime put this process into the next generation's
    environment: forget the old generation's settings and event, listen to the new one's."""
    global _channel
    with _start_lock:
        old, _channel = _channel, None
    if old is not None:
        old.close()
    settings.cache_clear()
    _start()
    return settings()


def elastic_event_detected() -> bool:
    """True once the orchestrator (or EC2, or a SIGTERM) asked this generation to checkpoint
    and stop; it stays True. A flag read: the channel's threads do the polling. Ranks may see
    it a poll apart: agree (e.g. all-reduce the flag) before saving."""
    return (_channel or _start()).latched


def on_event(listener: Callable[[dict[str, Any]], None]) -> None:
    """Call `listener(event)` whenever a generation's elastic event latches, from the thread
    that latched it (quick, and never raising): once registered, for every generation."""
    if listener not in _listeners:
        _listeners.append(listener)


def elastic_event() -> dict[str, Any] | None:
    """What raised the event ({"source", "seen": epoch time, "kind", ...}), or None yet."""
    return (_channel or _start()).event


def ack_checkpoint(step: int) -> None:
    """Every rank, after the checkpoint at `step` is complete: 'I am safe to stop'."""
    s = settings()
    store().write_ack(s.generation, s.rank, step, time.time())


_last_progress = _last_step_times = 0.0
_clock = StepClock()


@contextmanager
def busy() -> Iterator[None]:
    """Mark this rank's own work in a step (not its waits on peers): straggler detection
    then compares these times, which in lockstep training differ between a slow node and
    its peers where the wall time per step does not; and a rank stuck in it is told apart."""
    started = time.monotonic()
    _clock.begin_busy(time.time())
    _watch_stuck()
    try:
        yield
    finally:
        _clock.end_busy(time.monotonic() - started)


def report_progress(step: int, force: bool = False) -> None:
    """Every rank, after each step (or every few): times the step in memory; unless `force`,
    writes rank 0's progress at most about once a second and this rank's step times about
    every `STEP_TIMES_INTERVAL_S` (straggler detection needs no more), or at once after a
    section the stuck watch wrote as in progress (`StepClock.stale`)."""
    global _last_progress, _last_step_times
    s = settings()
    now = time.monotonic()
    _clock.tick(step, now)
    if force or _clock.stale() or now - _last_step_times >= STEP_TIMES_INTERVAL_S:
        _last_step_times = now
        with _clock.lock:
            store().write_rank_steps(s.generation, s.rank, _clock.record(step, time.time()))
    if s.is_rank0 and (force or now - _last_progress >= PROGRESS_INTERVAL_S):
        _last_progress = now
        store().write_progress(s.generation, step, time.time())


_stuck_watch: threading.Thread | None = None


def _watch_stuck() -> None:
    """Start (once) the daemon thread that writes a section in progress for too long."""
    global _stuck_watch
    if _stuck_watch is not None:
        return

    def watch() -> None:
        s = settings()
        while True:
            time.sleep(STUCK_AFTER_S / 2)
            try:
                with _clock.lock:
                    if (record := _clock.stuck_record(time.time())) is not None:
                        store().write_rank_steps(s.generation, s.rank, record)
            except Exception as err:  # the store may be away for a moment: not the end
                logging.getLogger("spotrain.elastic").warning("stuck watch: %s", err)

    _stuck_watch = threading.Thread(target=watch, name="spotrain-stuck-watch", daemon=True)
    _stuck_watch.start()


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
