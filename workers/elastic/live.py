"""Live resize: on a membership change the surviving ranks keep their process, re-form the
process group for the next generation and train on from memory; joining ranks take the state
from the survivors over the new group, tensor by tensor (handover.py), not from disk. Opt in
with `elastic.resize: live`.

A training loop supports it in a few lines (examples/train_ddp.py is the whole of it). What it
must hold for the hand-over: the module and optimizer (their state dicts travel), and
anything else with a state dict that every rank must agree on (an LR scheduler, a grad
scaler: pass it as `others`). What it must not hold across a resize: per-rank data that
depends on the world size (the data loader's position comes from the step).

    live.init_process_group(backend)            # after wait_for_gang
    step = -1 if live.state_from_peers() else load_checkpoint(model, optim)
    while True:
        try:
            step = live.sync(model, optim, step, others=[scheduler])  # the newest state
            ddp = DistributedDataParallel(model, init_sync=False)    # (for each membership)
            if (notice := live.checkpoint_owed()) is not None:       # a notice's, no pause
                ckpt.save_async(state, step, kind="notice", notice_at=notice)
            ...train; all-reduce [elastic_event_detected(), wants_checkpoint()] each step:
            on the event, checkpoint if any rank wants it (live.wants_checkpoint), break...
        except Exception as err:
            if not live.peer_failed(err):
                raise
            optim.zero_grad()                   # a peer vanished mid-step: drop that step
        if live.next_generation(step) is None:  # parked until the next membership
            break                               # this rank leaves: exit 0

How the runtime and the library meet, through the job's store (job_store.py):
- A live stop raises the elastic event as usual; each rank finishes its step, checkpoints if
  any rank's vote asks for it now (`wants_checkpoint`: growth, scale-in and a reclaim notice
  do not), leaves the process group, then acks with its step and parks: an ack from a rank
  still alive means "I hold step S in memory". A rank whose collective failed drops the step
  in flight and parks the same way; leaving the group first closes its connections, so a
  survivor still waiting on it fails at once too.
- What must be durable before a noticed node dies: nothing, while a rank survives it (every
  rank holds the whole state). The notice's checkpoint is owed by the next generation, which
  writes it in the background from its first step (`checkpoint_owed`); its record says how
  long after the notice it was durable. When every member is noticed at once the workflow
  stops in restart mode, checkpoint first.
- A node lost without notice: the stop's control record names it; each survivor's control
  thread then shuts down the connections its groups opened, so a collective waiting on a
  node that closes nothing (frozen, cut off) fails at once instead of after
  `collective_timeout()`.
- Starting the next generation, the runtime adopts the parked ranks on its member nodes and
  writes `gen-<old>/next.json`: each parked rank's new environment (rank, world size, master
  address and port, generation), or null for a rank that leaves. It starts processes only for
  the new places, telling them to take the state from their peers (the workflow adds only
  nodes whose ranks got a head start, so survivors never wait on a process start).
- A parked rank polls that record (every 20 ms on file://, 100 ms on s3://), takes the new
  environment and joins the new group (at the rendezvous the gang start recorded, if any).
  With no next generation within `SPOTRAIN_PARK_TIMEOUT_S` (default 600 s), or on SIGTERM,
  it leaves.
- If the new group does not form (a survivor hung, a peer died on the way), the ranks that
  came park again within the collective timeout; the runtime reports a parked rank nobody
  stopped as a fault, and the next generation goes on from their memory (from the last
  checkpoint only when no survivor is left).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

import torch

# Imported with this module, so as part of a joiner's head start: a process's first DDP or
# fully_shard imports it (1.3 s on an idle core, 3 s beside two busy loops, past a test's 10 s
# collective timeout in one CI run). After the rendezvous, a joiner's import would run while the
# survivors wait in their first collective, within collective_timeout().
import torch._dynamo
import torch.distributed as dist

from spotrain import elastic
from spotrain.elastic import environment, handover, job_store
from spotrain.elastic.control import changed_reader

DEFAULT_COLLECTIVE_TIMEOUT_S = 30.0
DEFAULT_PARK_TIMEOUT_S = 600.0
RENDEZVOUS_POLL_S = 0.005

_INET = (socket.AF_INET, socket.AF_INET6)
_sockets_before: set[str] = set()  # open before this generation's group began to form
_owed: float | None = None  # parked on a notice whose checkpoint is still owed (its time)
_due: float | None = None  # the generation owes that checkpoint (see checkpoint_owed)


def enabled() -> bool:
    """True when this generation resizes live (the runtime says so in the environment)."""
    return os.environ.get(environment.RESIZE) == "live"


def state_from_peers() -> bool:
    """True for a rank started into a live generation whose survivors hold the state: it
    loads nothing from disk and gets the state in `sync`."""
    return enabled() and os.environ.get(environment.STATE_FROM) == "peers"


def init_process_group(backend: str) -> None:
    """`dist.init_process_group` for this generation, with `collective_timeout()`. A rank other
    than 0 first waits (within that timeout) for rank 0's rendezvous to accept connections:
    torch's own client, refused, backs off for about half a second."""
    global _sockets_before
    if enabled():
        elastic.on_event(_abort_if_peer_lost)
        _sockets_before = set(_tcp_sockets())
    if int(os.environ["RANK"]) != 0:
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        deadline = time.monotonic() + collective_timeout().total_seconds()
        while time.monotonic() < deadline:
            try:
                socket.create_connection(address, timeout=1).close()
                break
            except OSError:  # not listening yet (or its name not resolvable yet)
                time.sleep(RENDEZVOUS_POLL_S)
    dist.init_process_group(backend, timeout=collective_timeout())


def collective_timeout() -> timedelta:
    """How long a collective waits for a peer: a node lost without notice is detected within
    it. `init_process_group` above passes it (in restart mode it bounds a hang just the same)."""
    seconds = float(os.environ.get(environment.COLLECTIVE_TIMEOUT) or DEFAULT_COLLECTIVE_TIMEOUT_S)
    return timedelta(seconds=seconds)


def wants_checkpoint() -> bool:
    """This rank's vote for a checkpoint before stopping: it saw the elastic event, and the
    event asks for one now (always in restart mode; in live mode only an event that does not
    say otherwise, such as a SIGTERM: a notice's checkpoint is written after the resize, by the
    survivors, see `checkpoint_owed`; growth and scale-in need none). Ranks see the event a poll
    apart, and one may learn of it only from its peers, so agree: all-reduce the votes with
    the event flags and checkpoint if any rank voted for it (a save is collective)."""
    event = elastic.elastic_event()
    return event is not None and (not enabled() or event.get("checkpoint", True) is True)


def checkpoint_owed() -> float | None:
    """Once per generation that owes one: the time of the reclaim notice whose checkpoint it
    must write (start it at once, in the background: `save_async(..., kind="notice")`); else
    None. A live notice costs no pause: the survivors hold the whole state, so nothing has to
    be durable before the noticed node dies; the checkpoint only insures against losing the
    survivors too, and is written beside training (the runtime stops ranks synchronously,
    checkpoint first, when no rank survives the notice)."""
    global _due
    due, _due = _due, None
    return due


def peer_failed(err: BaseException) -> bool:
    """True if `err` is a collective (or the forming of a group) that failed because a peer
    vanished or timed out."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        mark in text for mark in ("gloo", "Gloo", "NCCL", "Connection closed", "Timed out")
    )


def sync(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    step: int,
    others: Iterable[handover.Stateful] = (),
    group: dist.ProcessGroup | None = None,
) -> int:
    """Collective, before (re)building DDP: every rank takes the model, optimizer, step and
    `others` (anything else with a state dict: an LR scheduler...) of the most advanced ranks
    (a joiner passes -1), tensor by tensor (handover.py). Free when every rank agrees. A
    sharded model passes its replicas' group (`sharded.replicas`): each shard comes from a
    rank that holds the same shard."""
    if not enabled():
        return step
    steps = agree(step)
    members = dist.get_process_group_ranks(group) if group else range(len(steps))
    handover.transfer(model, optim, [steps[r] for r in members], others, group)
    return max(steps)


def agree(step: int) -> list[int]:
    """Collective, at a live generation's start (`sync` calls it; a loop that moves its state
    itself, such as a pure FSDP job's reshard in sharded.py, calls it instead): every rank's
    step (a joiner's -1), in rank order; and the notice checkpoint a parked rank owes passes
    to this generation (`checkpoint_owed`)."""
    global _owed, _due
    held = [(0, None)] * dist.get_world_size()
    dist.all_gather_object(held, (step, _owed))
    _owed = None  # this generation owes it now
    _due = next((owed for _, owed in held if owed is not None), None)
    return [s for s, _ in held]


def next_generation(step: int) -> elastic.Settings | None:
    """Park holding `step` in memory until the runtime places this rank in the next
    generation; then re-form the process group and return the new settings. None: this
    rank leaves (restart mode, not adopted, no next generation in time, or SIGTERM)."""
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    while True:
        s = elastic.settings()
        if enabled():
            # Out of the old group before parking: a survivor still blocked in a collective
            # with this rank (after a peer was lost) fails at once on the closed connection,
            # not after collective_timeout().
            _drop_groups()
        elastic.store().write_ack(s.generation, s.rank, step, time.time())
        if not enabled():
            return None
        _owe_notice_checkpoint(s.generation)
        env = _wait_for_place(s)
        if env is None:
            return None
        os.environ.update(env)
        new = elastic.next_generation_settings()
        elastic.wait_for_gang()
        try:
            init_process_group(backend)
        except Exception as err:
            if not peer_failed(err):
                raise
            # A peer did not come (died or hung on the way): park again in this generation,
            # still holding `step`; the runtime sees a parked rank nobody stopped as a fault.
            print(f"rank {new.rank}: the new group did not form: {err}", flush=True)
            continue
        return new


def _abort_if_peer_lost(event: dict[str, Any]) -> None:
    """The control thread, on a stop naming lost nodes (other than this rank's): end what this
    rank waits on at once. A killed peer's connections close, but a frozen or cut-off node
    closes nothing, and a collective waiting on it would sit out `collective_timeout()`. So
    shut down every connection opened since this generation's group began to form (the
    groups' own, and a client's that simply reconnects): the collective fails as on a closed
    connection, and the rank drops the step in flight and parks."""
    lost = event.get("lost") or []
    if not enabled() or not lost or elastic.settings().node_id in lost:
        return
    if dist.is_initialized() and dist.get_backend() == "nccl":
        with contextlib.suppress(Exception):  # NCCL's own abort (its transport is not TCP)
            dist.distributed_c10d._abort_process_group()
    opened = _tcp_sockets()
    for inode in opened.keys() - _sockets_before:
        with contextlib.suppress(OSError):  # (closed meanwhile)
            conn = socket.socket(fileno=os.dup(opened[inode]))
            with conn:
                if conn.type == socket.SOCK_STREAM and conn.family in _INET:
                    conn.getpeername()  # (raises for a listening socket: left alone)
                    conn.shutdown(socket.SHUT_RDWR)
    print(f"rank {os.environ.get('RANK')}: nodes {lost} lost: waits on them aborted", flush=True)


def _tcp_sockets() -> dict[str, int]:
    """This process's sockets: inode -> file descriptor (Linux; elsewhere none)."""
    out = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                if target.startswith("socket:"):
                    out[target] = int(fd)
    return out


def _owe_notice_checkpoint(generation: int) -> None:
    """Parking on a notice whose checkpoint comes after the resize: remember the notice. As the
    generation's control record says: a rank may have heard of the event only from its peers
    (the all-reduced flag), before its own channel read the record."""
    global _owed
    try:
        event = elastic.store().control_record(generation) or {}
    except Exception:  # the store unreachable for a moment: what this rank latched, if anything
        event = elastic.elastic_event() or {}
    if event.get("checkpoint") == job_store.AFTER_RESIZE:
        notice = event.get("notice_at")
        _owed = datetime.fromisoformat(notice).timestamp() if notice else event.get("time", 0.0)


def _drop_groups() -> None:
    """Tear every process group down, even one that lost a peer or never formed."""
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    # A group that failed to form is never destroyed, but it counted: every rank of the next
    # group must derive the same store keys from this count (a new process starts at 0).
    dist.distributed_c10d._world.group_count = 0


def _wait_for_place(s: elastic.Settings) -> dict[str, str] | None:
    """This rank's environment in the next generation, or None when it leaves."""
    read = changed_reader(elastic.store(), elastic.store().next_key(s.generation))
    every = 0.1 if s.checkpoint.startswith("s3://") else 0.02
    deadline = time.monotonic() + float(
        os.environ.get(environment.PARK_TIMEOUT) or DEFAULT_PARK_TIMEOUT_S
    )
    while time.monotonic() < deadline and not elastic.sigterm_received:
        with contextlib.suppress(Exception):  # unreachable for a moment: ask again
            record = json.loads(read() or "{}")
            if record.get("generation") is not None:  # (None: a placeholder, not yet placed)
                return record["ranks"].get(str(s.rank))
        time.sleep(every)
    return None
