"""Where a background checkpoint is written: from a thread of the training process (the
default), or, asked for with SPOTRAIN_CHECKPOINT_WRITER=process, in a process of its own at
nice 19, from a shared-memory copy of the state.

Why a process: a writing thread shares the training process's GIL, and `torch.save` holds it
through long native stretches (the copy into the file, the zip record's checksum). At nice 19
on busy cores such a thread can wait for a core while it holds the GIL, and every op training
dispatches from Python waits behind it. Why not by default: measured with ranks that train on
the CPU (docs/concepts/resize.md, 100M parameters), the thread paused training less on an
otherwise idle machine (0.60 s against 1.40 s per notice beyond a step); the process was ahead
only with the machine oversubscribed ten times over. Where the cores do not train (GPU nodes)
the process is the better bet, but unmeasured here.

How, with the process (`save_in_background` in checkpoint.py):
- The state is staged into shared memory, cached across saves (the same buffers each time:
  after the first save, staging is a copy, with no allocation or page faults). The rank thus
  keeps a copy of its checkpointed state in `/dev/shm` for its lifetime.
- DCP plans the save in the training process as usual (its collectives); the writing itself
  (`write_data`) goes to the writer process as the planned items, whose tensors travel as
  shared-memory handles, not bytes.
- The writer process starts on the first background save and ends with the training process
  (it reads until its pipe closes). A state under 64 MB is still written from a thread
  (starting a Python with torch costs more than it spares), and so is any where `/dev/shm`
  has no room for it (a container with the default 64 MB and no memory volume mounted there):
  the rank says so once.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.staging import AsyncStager, DefaultStager, StagingOptions
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

SHM = "/dev/shm"
NICE = 19
WRITER_ENV = "SPOTRAIN_CHECKPOINT_WRITER"  # "thread" (the default) or "process"
# Smaller states are written from a thread even so: they hold the GIL briefly, and starting
# the writer process (a Python with torch) would cost more than it spares.
PROCESS_FROM_BYTES = 64 * 2**20

_stager: DefaultStager | None = None
_use_process: bool | None = None  # decided at the first background save
_writer: tuple[mp.Process, Connection] | None = None


def stager(state: dict[str, Any]) -> AsyncStager | None:
    """The shared-memory stager for a background save of `state`, or None for a small state
    or where `/dev/shm` has no room for it (DCP's own staging then; the write stays in the
    process, from a thread)."""
    global _stager, _use_process
    needed = state_bytes(state)
    if needed < PROCESS_FROM_BYTES:
        return None
    if _use_process is None:  # (once: the copy cached there counts against it afterwards)
        _use_process = _process_fits(needed)
    if not _use_process:
        return None
    if _stager is None:
        _stager = DefaultStager(StagingOptions(False, True, False, False))  # (shared memory)
    return _stager


def _process_fits(needed: int) -> bool:
    """Whether the environment asks for the writer process and `/dev/shm` has room for a
    state of `needed` bytes; where it asks but cannot have it, the rank says why."""
    asked = os.environ.get(WRITER_ENV) or "thread"
    if asked == "thread":
        return False
    if asked != "process":
        why = f"{WRITER_ENV}={asked!r} is neither thread nor process"
    elif (free := shm_free()) > needed * 1.25:
        return True
    else:
        why = (
            f"{SHM} has {free / 2**20:.0f} MiB free, the state needs {needed / 2**20:.0f} MiB"
            " there (mount a memory volume at /dev/shm)"
        )
    print(f"background checkpoints write from a thread: {why}", file=sys.stderr, flush=True)
    return False


def shm_free() -> int:
    """Bytes free in `/dev/shm` (0 where there is none)."""
    try:
        st = os.statvfs(SHM)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def state_bytes(state: Any) -> int:
    """The bytes of every tensor in a (nested) state dict: a sharded one's local shard."""
    if isinstance(state, DTensor):
        return state_bytes(state.to_local())
    if isinstance(state, torch.Tensor):
        return state.untyped_storage().nbytes()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(v) for v in state)
    return 0


def write(location: str, plan: SavePlan, items: list[tuple[WriteItem, Any]]) -> list[WriteResult]:
    """Write this rank's planned `items` of the checkpoint at `location` in the writer process
    (started on first use); their results, or the writer's error raised here."""
    global _writer
    if _writer is not None and not _writer[0].is_alive():
        _forget_writer()
    if _writer is None:
        _writer = _start()
    try:
        _writer[1].send((location, plan, items))
        result = _writer[1].recv()
    except (EOFError, OSError) as err:
        _forget_writer()  # (it died: the next save starts another)
        raise RuntimeError(f"the checkpoint writer process died: {err!r}") from err
    if isinstance(result, BaseException):
        raise result
    return result


def pid() -> int | None:
    """The writer process's pid, once started."""
    return _writer[0].pid if _writer else None


def _forget_writer() -> None:
    """Close the pipe to a writer that died, and reap it."""
    global _writer
    if _writer is not None:
        process, conn = _writer
        conn.close()
        process.join(1)
        _writer = None


def _start() -> tuple[mp.Process, Connection]:
    ctx = mp.get_context("spawn")  # (forking a training process copies its threads' locks)
    ours, theirs = ctx.Pipe()
    process = ctx.Process(
        target=_serve, args=(theirs,), name="spotrain-checkpoint-writer", daemon=True
    )
    process.start()
    theirs.close()
    return process, ours


def _serve(conn: Connection) -> None:
    """The writer process: write each request's items, answer with the results (or the error),
    until the training process closes the pipe."""
    from spotrain.elastic.checkpoint import storage_writer  # (checkpoint.py imports this one)

    os.setpriority(os.PRIO_PROCESS, 0, NICE)
    while True:
        try:
            location, plan, items = conn.recv()
        except EOFError:
            return
        try:
            writer = storage_writer(location)
            result: Any = writer.write_data(plan, _Planned(items)).wait()
        except Exception as err:  # (reported to the training process, which records it)
            result = RuntimeError(f"{type(err).__name__}: {err}")
        try:
            conn.send(result)
        except OSError:  # the training process is gone (killed mid-write)
            return
        del items, plan  # (drop the shared buffers' handles before waiting)


class _Planned:
    """A save planner's `resolve_data` for items resolved in the training process."""

    def __init__(self, items: list[tuple[WriteItem, Any]]) -> None:
        self.data = {item.index: data for item, data in items}

    def resolve_data(self, item: WriteItem) -> Any:
        return self.data[item.index]
