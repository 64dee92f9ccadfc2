"""Distributed checkpoints (torch.distributed.checkpoint, DCP) for training code, to the job's
checkpoint location: `file:///path` or `s3://bucket/prefix` (written straight to S3 through AWS's
s3torchconnector: `pip install "spotrain[s3]"`).

    ckpt = checkpoint.Checkpointer()                  # after init_process_group
    step = ckpt.load(state) or 0                      # the newest complete one that loads
    for ...:
        ...train...
        if step % every == 0:
            ckpt.save_async(state, step)              # training goes on while it is written
        if elastic_event:                           # (restart mode; live: checkpoint_owed)
            ckpt.save(state, step, kind="notice")     # synchronous: it must be durable now
    ckpt.close()

- Never two saves in flight: a save first waits for the one before it.
- The latest-checkpoint marker moves only once a checkpoint is complete (every rank's files
  and the metadata written); each complete one leaves a record with its duration (end to
  end, and the time training was blocked), size and kind, which the orchestrator reports.
- Retention (rank 0, after each completion): the newest `keep` complete checkpoints stay,
  and so does the one the newest generation resumed from; files of saves that never completed
  (older than the newest complete one, so not in flight) are removed. A generation that is no
  longer the newest (a straggler of a lost generation) deletes nothing.
- Loading tries the marker's checkpoint, then older complete ones: a corrupt or partial one is
  recorded as skipped (the report says so) and the previous one is used.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from spotrain import elastic
from spotrain.elastic import checkpoint_writer
from spotrain.elastic.job_store import JobStore

# DCP reports a failure on any rank to every rank as a CheckpointException (a BaseException).
FAILED = (Exception, CheckpointException)

KEEP_ENV = "SPOTRAIN_CHECKPOINT_KEEP"
DEFAULT_KEEP = 3


def _s3_settings() -> tuple[str, Any, str | None]:
    """(region, client config, endpoint): boto3's own variables, so one setting
    (`AWS_ENDPOINT_URL_S3`, e.g. moto) points the store and the checkpoints at the same S3."""
    try:
        from s3torchconnector import S3ClientConfig
    except ImportError as err:
        raise RuntimeError(
            'checkpoints to s3:// need s3torchconnector: pip install "spotrain[s3]"'
        ) from err
    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    # A custom endpoint (moto, MinIO) rarely resolves virtual-hosted bucket names.
    return region, S3ClientConfig(force_path_style=bool(endpoint)), endpoint


class _Yielding:
    """A DCP writer whose writing thread yields the CPU to training (nice 19 for that thread
    alone): an asynchronous save insures, it is not urgent. The default (checkpoint_writer.py
    says when the writer process writes instead)."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            with contextlib.suppress(OSError, AttributeError):  # (Linux: per-thread nice)
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return super().write_data(plan, planner)  # type: ignore[misc]


class _InWriterProcess:
    """A DCP writer whose writing runs in the writer process (checkpoint_writer.py): planning
    stays here, the planned items (shared-memory tensors) go there."""

    location: str

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        items = [(item, planner.resolve_data(item)) for item in plan.items]
        done: TorchFuture[list[WriteResult]] = TorchFuture()
        done.set_result(checkpoint_writer.write(self.location, plan, items))
        return done


BACKGROUND = {"thread": _Yielding, "process": _InWriterProcess}


def storage_writer(path: str, background: str | None = None) -> StorageWriter:
    """A DCP writer for a local path or an s3:// URI; `background` (an asynchronous save's):
    "process" writes in the writer process, "thread" from a thread that yields the CPU."""
    if path.startswith("s3://"):
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageWriter

        region, config, endpoint = _s3_settings()
        base: type[StorageWriter] = S3StorageWriter
        args: tuple[Any, ...] = (region, path)
        kwargs: dict[str, Any] = {"s3client_config": config}
    else:
        base, args, kwargs = dcp.FileSystemWriter, (path,), {}
    if background:
        mixin = BACKGROUND[background]
        base = type(f"{mixin.__name__.strip('_')}{base.__name__}", (mixin, base), {})
    writer = base(*args, **kwargs)
    if background == "process":
        writer.location = path  # type: ignore[attr-defined]
    if path.startswith("s3://"):
        client = S3Client(region, endpoint=endpoint, s3client_config=config)
        writer.fs = S3FileSystem(region, s3_client=client)  # its constructor takes no endpoint
    return writer


def save_in_background(
    state: dict[str, Any], path: str, group: dist.ProcessGroup | None = None
) -> Future[Any]:
    """Stage `state` and write it in the background (checkpoint_writer.py says where); the
    future of its metadata. No `group`: one process saves alone."""
    stager = checkpoint_writer.stager(state)
    writer = storage_writer(path, background="process" if stager else "thread")
    return dcp.async_save(
        state, storage_writer=writer, process_group=group, async_stager=stager, no_dist=not group
    )


def storage_reader(path: str) -> StorageReader:
    """A DCP reader for a local path or an s3:// URI."""
    if not path.startswith("s3://"):
        return dcp.FileSystemReader(path)
    from s3torchconnector import S3ReaderConstructor
    from s3torchconnector._s3client import S3Client
    from s3torchconnector.dcp import S3FileSystem, S3StorageReader

    region, config, endpoint = _s3_settings()
    constructor = S3ReaderConstructor.dcp_optimized()  # one object: the reader plans its ranges
    reader = S3StorageReader(region, path, s3client_config=config, reader_constructor=constructor)
    client = S3Client(region, endpoint=endpoint, s3client_config=config)
    reader.fs = S3FileSystem(region, s3_client=client, reader_constructor=constructor)
    return reader


def check_location(uri: str) -> None:
    """Fail fast, with the store's message, on a location the job cannot use."""
    scheme = urlparse(uri).scheme
    if scheme not in ("file", "s3"):
        raise ValueError(f"unsupported checkpoint location {uri!r}: use file:///path or s3://")
    if scheme == "s3":
        _s3_settings()


@dataclass
class _InFlight:
    """An asynchronous save not yet finalised."""

    step: int
    path: str
    kind: str
    started: float
    blocked_s: float
    future: Future[Any]
    notice_at: float | None
    done_at: list[float] = field(default_factory=list)


class Checkpointer:
    """DCP saves and loads for one rank of one generation (see the module's docstring)."""

    def __init__(self, keep: int | None = None) -> None:
        self.s = elastic.settings()
        self.store: JobStore = elastic.store()
        self.keep = max(1, keep or int(os.environ.get(KEEP_ENV) or DEFAULT_KEEP))
        check_location(self.s.checkpoint)
        # Saves' own collectives run beside training's (an async save's in a thread): gloo
        # works on CPU tensors whatever the training backend.
        self.group = dist.new_group(backend="gloo")
        self.pending: _InFlight | None = None

    # --- saving ----------------------------------------------------------------------------

    def save_async(
        self,
        state: dict[str, Any],
        step: int,
        kind: str = "periodic",
        notice_at: float | None = None,
    ) -> None:
        """Copy the state to memory and write it in the background; blocks only for the copy
        (and for the previous save, if that one is still being written). `notice_at`: the
        reclaim notice it insures against (its record says how long after it was durable)."""
        started = time.monotonic()
        self.wait()
        path = self.store.checkpoint_path(step)
        future = save_in_background(state, path, self.group)
        blocked = time.monotonic() - started
        pending = _InFlight(step, path, kind, started, blocked, future, notice_at)
        future.add_done_callback(lambda _f: pending.done_at.append(time.monotonic()))
        self.pending = pending

    def save(self, state: dict[str, Any], step: int, kind: str = "notice") -> None:
        """Synchronous: returns once the checkpoint is complete and the latest on every rank
        (the one to use after an elastic event, before acking it)."""
        started = time.monotonic()
        self.wait()
        path = self.store.checkpoint_path(step)
        metadata = dcp.save(state, storage_writer=storage_writer(path), process_group=self.group)
        elapsed = time.monotonic() - started
        self._complete(step, path, kind, elapsed, elapsed, metadata)
        dist.barrier(group=self.group)  # nobody acks a checkpoint before it is the latest

    def poll(self) -> None:
        """Finalise the asynchronous save if it has finished; cheap, call it every step."""
        if self.pending is not None and self.pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the asynchronous save in flight, if any, is finalised."""
        p, self.pending = self.pending, None
        if p is None:
            return
        try:
            metadata = p.future.result()
        except FAILED as err:  # its files are leftovers, removed by a later retention
            print(f"rank {self.s.rank}: checkpoint at step {p.step} failed: {err}", file=sys.stderr)
            return
        end = p.done_at[0] if p.done_at else time.monotonic()
        self._complete(p.step, p.path, p.kind, end - p.started, p.blocked_s, metadata, p.notice_at)

    def close(self) -> None:
        self.wait()

    def _complete(
        self,
        step: int,
        path: str,
        kind: str,
        duration: float,
        blocked: float,
        metadata: Any,
        notice_at: float | None = None,
    ) -> None:
        """Rank 0: record the checkpoint, move the marker forward, apply retention."""
        if not self.s.is_rank0:
            return
        size = sum(info.length for info in (metadata.storage_data or {}).values())
        after = {} if notice_at is None else {"after_notice_s": round(time.time() - notice_at, 3)}
        self.store.record_checkpoint(
            after
            | {
                "step": step,
                "path": path,
                "kind": kind,
                "duration_s": round(duration, 4),
                "blocked_s": round(blocked, 4),
                "bytes": size,
                "world_size": self.s.world_size,
                "generation": self.s.generation,
                "time": time.time(),
            }
        )
        latest = self.store.latest_checkpoint()
        if latest is None or latest["step"] <= step:
            elastic.mark_checkpoint(step, path)
        self.retain()

    def retain(self) -> list[int]:
        """Delete what retention lets go (see the module's docstring); the steps deleted."""
        if (self.store.newest_generation() or 0) > self.s.generation:
            return []  # a newer generation runs: it owns the checkpoints now
        complete = [r["step"] for r in self.store.checkpoints()]
        if not complete:
            return []
        keep = set(complete[-self.keep :])
        loaded = self.store.loaded_step(self.s.generation)
        if loaded is not None:
            keep.add(loaded)
        gone = [step for step in complete if step not in keep]
        for step in gone:
            self.store.forget_checkpoint(step)
        newest = complete[-1]
        for step in self.store.checkpoint_dirs():
            if step < newest and step not in complete:  # a save that never completed
                self.store.forget_checkpoint(step)
                gone.append(step)
        return sorted(gone)

    # --- loading ---------------------------------------------------------------------------

    def load(self, state: dict[str, Any]) -> int | None:
        """Load the newest complete checkpoint that loads into `state` (DCP reshards to this
        world size); its step, or None when there is none. Collective."""
        candidates = [self._candidates() if self.s.is_rank0 else None]
        dist.broadcast_object_list(candidates, src=0, group=self.group)
        for step, path in candidates[0] or []:
            try:
                dcp.load(state, storage_reader=storage_reader(path), process_group=self.group)
            except FAILED as err:  # every rank sees the failure: DCP gathers them
                reason = str(err).strip().splitlines()[-1][:300] if str(err).strip() else repr(err)
                print(
                    f"rank {self.s.rank}: checkpoint at step {step} does not load, trying an "
                    f"older one: {reason}",
                    file=sys.stderr,
                )
                if self.s.is_rank0:
                    self.store.record_skipped(
                        {
                            "step": step,
                            "path": path,
                            "reason": reason,
                            "generation": self.s.generation,
                            "time": time.time(),
                        }
                    )
                continue
            if self.s.is_rank0:
                self.store.write_loaded(self.s.generation, step)
            return step
        if candidates[0]:
            raise RuntimeError("no complete checkpoint loads: see the skipped ones above")
        return None

    def _candidates(self) -> list[tuple[int, str]]:
        """The marker's checkpoint first, then every older complete one, newest first."""
        latest = self.store.latest_checkpoint()
        out = [(latest["step"], latest["path"])] if latest else []
        for r in reversed(self.store.checkpoints()):
            if latest is None or r["step"] < latest["step"]:
                out.append((r["step"], r["path"]))
        return out
