"""Sharded models under spotrain (FSDP2 `fully_shard`): HSDP, or pure FSDP with a peer copy.

HSDP (`node_mesh`): the generation's 2-D device mesh replicates over its nodes and shards over
each node's processes, so the shard dimension (a node's process count) never changes with the
world size: a resize only adds or removes replicas.
- a survivor keeps its shards: it builds the model on the new mesh (on the meta device, no
  initialisation) and `carry` copies its own shards into it, locally;
- a joining node takes each shard from a survivor that holds the same one (`sync`: the tensor
  hand-over of handover.py within `replicas(mesh)`);
- a node lost without notice costs at most the step in flight: every shard lives on in
  another replica. With a single node (no other replica) a loss falls back to the last
  checkpoint, as does any job in restart mode: DCP reshards to any mesh.

Pure FSDP (`full_mesh`: one shard per rank, no replica) moves shards at every resize, since
dim 0 is cut into as many pieces as there are ranks. `sync` reshards in memory: every rank
of the new generation receives the rows of its new shard from the ranks that held them (a
joiner holds none), point to point and tensor by tensor, into the new model's own storage
(no gathered full tensor, no second copy). Where a node is gone (lost, or left on a notice)
its rows come from its **peer copy** (`elastic.peer_copy: true`, Gemini-style): each rank
keeps a copy of the shards of the rank one node ahead on the ring, model and optimizer
state, and steps it with that rank's gradient shard (`PeerCopy.step`), so the copy is never
stale. Without a copy (or two neighbouring nodes lost at once) `sync` returns None: the job
goes back to its last checkpoint.

    mesh = sharded.node_mesh(s, "cpu")            # or full_mesh; after live.init_process_group
    ...fully_shard(block, mesh=mesh) for each block, then the root; the optimizer...
    step = sharded.sync(model, optim, step, mesh) # a joiner's shards, a lost node's (None:
    copy = sharded.peer_copy(model, optim)        # load the checkpoint); the neighbour's copy
    ...forward, backward...
    copy.step()                                   # optim.step(), and the copy's step
    s = live.next_generation(step)                # parked until placed
    mesh = sharded.node_mesh(s, "cpu")            # then the model again, on the meta
    ...device, fully_shard on the new mesh, to_empty; a new optimizer...
    sharded.carry(model, optim, new, new_optim)   # HSDP: this rank's shards, old mesh -> new

Why the copy replays the step instead of copying the state after it: a copy sent after the
optimizer step would lag its owner while in flight, and the survivors, already past it,
could not go back to meet it. Gradients travel before anyone steps: `PeerCopy.step` sends
this rank's gradient shard to its holder, receives its neighbour's, and only then (after a
barrier) steps the optimizer and the copy together. A barrier completes on a rank only once
every rank entered it, so when a node dies around a step, either no survivor stepped (every
copy is at the step before) or every survivor holds the gradients of the step (a survivor
whose barrier failed takes the step in `sync`). The optimizer is replayed on the copy: an
elementwise one (SGD, Adam, AdamW...: the same update on a shard's rows as on the whole);
its state stays equal to the owner's bit for bit (same kernels, same inputs).

examples/train_fsdp.py is the whole of it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._redistribute import _gen_transform_infos

from spotrain import elastic
from spotrain.elastic import handover, live

REPLICATE, SHARD = "replicate", "shard"
WINDOW = 8  # tensors whose transfers are in flight at once in a reshard


def node_mesh(s: elastic.Settings, device_type: str) -> DeviceMesh:
    """HSDP's mesh for this generation: replicate over nodes x shard over a node's processes
    (the runtime places a node's ranks next to each other, `LOCAL_WORLD_SIZE` of them)."""
    procs = s.local_world_size
    if s.world_size % procs:
        raise ValueError(f"world size {s.world_size} is not a multiple of {procs} per node")
    _forget_meshes()
    return init_device_mesh(
        device_type, (s.world_size // procs, procs), mesh_dim_names=(REPLICATE, SHARD)
    )


def _forget_meshes() -> None:
    """Before a generation's mesh: drop DTensor's sharding caches, or a process renumbered
    into a mesh shape it had before gets its old mesh back (its old coordinate, its destroyed
    groups). As `tensor.debug._clear_sharding_prop_cache`, whose import costs every rank's
    start 1.5 s (docs/sharded.md)."""
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()
    _gen_transform_infos.cache_clear()


def replicas(mesh: DeviceMesh) -> torch.distributed.ProcessGroup:
    """The group of ranks that hold this rank's shard: one per node."""
    return mesh.get_group(REPLICATE)


def carry(
    old: nn.Module,
    old_optim: torch.optim.Optimizer,
    new: nn.Module,
    new_optim: torch.optim.Optimizer,
) -> None:
    """HSDP, local: this rank's shards of the module and optimizer built on the last
    generation's mesh, into the same module and optimizer built on this one's (the same shard
    of every tensor: the shard dimension never changes). The old mesh's groups may be gone, or
    have failed mid-step: nothing here talks to a peer. Pure FSDP (a 1-D mesh): nothing here,
    the shards move in `sync` (what this rank holds stays held until then)."""
    if _mesh_of(new).ndim == 1:
        return
    for module in old.modules():  # (a step cut short can leave parameters gathered)
        if isinstance(module, FSDPModule):
            module.reshard()
    new_state, old_state = new.state_dict(), old.state_dict()
    if new_state.keys() != old_state.keys():
        raise ValueError("carry: the new module is not the old one rebuilt")
    with torch.no_grad():
        for key, tensor in new_state.items():
            _local(tensor).copy_(_local(old_state[key]))
    params = [p for g in new_optim.param_groups for p in g["params"]]
    old_params = [p for g in old_optim.param_groups for p in g["params"]]
    for param, was in zip(params, old_params, strict=True):
        if was in old_optim.state:
            new_optim.state[param] = {
                key: _on_mesh_of(param, v) for key, v in old_optim.state[was].items()
            }
    for group, was_group in zip(new_optim.param_groups, old_optim.param_groups, strict=True):
        group.update({k: v for k, v in was_group.items() if k != "params"})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _on_mesh_of(param: torch.Tensor, value: object) -> object:
    """An optimizer state value moved to `param`'s mesh: a DTensor's local shard, unchanged
    and uncopied, rewrapped; anything else as it is."""
    if not isinstance(value, DTensor) or not isinstance(param, DTensor):
        return value
    return DTensor.from_local(
        value.to_local(),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _mesh_of(model: nn.Module) -> DeviceMesh:
    for p in model.parameters():
        if isinstance(p, DTensor):
            return p.device_mesh
    raise ValueError("the model has no sharded parameter (fully_shard it on a mesh first)")


# --- pure FSDP: shards over every rank, resharded in memory, a peer copy ----------------------


def full_mesh(s: elastic.Settings, device_type: str) -> DeviceMesh:
    """Pure FSDP's mesh for this generation: one shard per rank, no replica (a model too big
    for one node). A live resize reshards it in `sync`; set `elastic.peer_copy` so that a
    node lost without notice costs no return to the checkpoint."""
    _forget_meshes()
    return init_device_mesh(device_type, (s.world_size,), mesh_dim_names=(SHARD,))


def rows(length: int, world: int, rank: int) -> range:
    """The rows of dim 0 that FSDP2 gives `rank` of `world` ranks: `torch.chunk`'s cut
    (chunks of ceil(length / world) rows; the last ones short, or empty)."""
    size = -(-length // world)
    start = min(rank * size, length)
    return range(start, min(start + size, length))


@dataclass(frozen=True)
class Held:
    """What a rank brings to a pure FSDP `sync`: where its shards sit (its generation's rank
    and world size, a node's processes: the ring's stride), the step they are at, whether it
    keeps a copy of its neighbour's shards, and whether it holds the gradients of the next
    step (its own and its neighbour's) without having taken it."""

    generation: int
    rank: int
    world: int
    stride: int
    step: int
    copy: bool = False
    pending: bool = False
    current: bool = False  # its model is the one built on this mesh (started on it)


@dataclass(frozen=True)
class Plan:
    """A pure FSDP reshard: the step every shard ends at, the ranks (new) that first take the
    step their peers took, and for each old rank the new rank that gives its rows (from its
    own shards, or from its copy of them)."""

    step: int
    finish: list[int]
    sources: list[tuple[int, bool]]  # old rank -> (new rank, from its peer copy)
    world: int  # the old world size
    in_place: bool = False  # every rank already holds its own shard of this mesh


def plan(held: list[Held | None], world: int) -> Plan | None:
    """The reshard from what each rank of the new generation (`world` ranks) holds (None: a
    joiner), or None when some shard is in no one's memory: a node lost with the node that
    kept its copy, survivors of different layouts (a resize cut short), a survivor a step
    behind without that step's gradients."""
    survivors = [(n, h) for n, h in enumerate(held) if h is not None]
    if not survivors:
        return None
    layouts = {(h.generation, h.world, h.stride) for _, h in survivors}
    if len(layouts) != 1:
        return None
    _, old_world, stride = layouts.pop()
    top = max(h.step for _, h in survivors)
    finish = [n for n, h in survivors if h.step < top]
    if any(held[n].step != top - 1 or not held[n].pending for n in finish):  # type: ignore[union-attr]
        return None
    own = {h.rank: n for n, h in survivors}
    copies = {h.rank: n for n, h in survivors if h.copy}
    sources: list[tuple[int, bool]] = []
    for o in range(old_world):
        if o in own:
            sources.append((own[o], False))
        elif (o - stride) % old_world in copies:  # its holder: one node behind on the ring
            sources.append((copies[(o - stride) % old_world], True))
        else:
            return None
    in_place = (
        old_world == world
        and not finish
        and all(sources[n] == (n, False) and held[n].current for n in range(world))  # type: ignore[union-attr]
    )
    return Plan(top, finish, sources, old_world, in_place)


@dataclass
class Stats:
    """What the last reshard and the copy's steps cost, for the loop's log and the benchmarks."""

    reshard_s: float = 0.0
    reshard_bytes: int = 0  # (received by this rank)
    from_copy: int = 0  # old ranks whose rows came from a peer copy
    copy_s: float = 0.0  # what the copy added to the last step: the two below
    exchange_s: float = 0.0  # gradient shards sent and received, and the barrier
    copy_step_s: float = 0.0  # the optimizer's step on the copy
    bootstrap_s: float = 0.0
    copy_bytes: int = 0  # the copy's tensors (its memory)


last = Stats()


@dataclass
class _State:
    """This process's state: its model and optimizer and where their shards sit."""

    model: nn.Module
    optim: torch.optim.Optimizer
    generation: int
    rank: int
    world: int
    stride: int
    copy: PeerCopy | None = None


_held: _State | None = None


def sync(model: nn.Module, optim: torch.optim.Optimizer, step: int, mesh: DeviceMesh) -> int | None:
    """Collective at a live generation's start, before training: every rank ends with its
    shards of this mesh at the newest step; that step. HSDP: the joiners' shards from a
    survivor holding the same one (`live.sync` within `replicas(mesh)`). Pure FSDP: every rank
    receives the rows of its new shard from the ranks (or peer copies) that hold them, tensor
    by tensor; None when some rows are in no one's memory (load the last checkpoint then).
    A joiner passes step -1. Not live: `step`, nothing moves."""
    global _held
    if mesh.ndim > 1:
        return live.sync(model, optim, step, group=replicas(mesh))
    if not live.enabled():
        return step
    s = elastic.settings()
    last.reshard_s = last.reshard_bytes = last.from_copy = 0
    state = _held
    if state is None and step >= 0:  # started from a checkpoint (or from scratch) on this mesh
        state = _State(model, optim, s.generation, s.rank, s.world_size, s.local_world_size)
    live.agree(step)
    mine = None
    if state is not None:
        copy = state.copy
        mine = Held(
            state.generation,
            state.rank,
            state.world,
            state.stride,
            step,
            copy=copy is not None and copy.active,
            pending=copy is not None and copy.pending is not None,
            current=state.model is model,
        )
    held: list[Held | None] = [None] * dist.get_world_size()
    dist.all_gather_object(held, mine)
    how = plan(held, dist.get_world_size())
    if how is None:
        print(f"rank {s.rank}: shards lost from memory: {held}", flush=True)
        _held = None
        return None
    if not how.in_place:
        assert state is not None or dist.get_rank() not in how.finish
        if dist.get_rank() in how.finish:
            state.copy.finish()  # type: ignore[union-attr]
        _reshard(state, model, optim, how)
    _held = _State(model, optim, s.generation, s.rank, s.world_size, s.local_world_size)
    return how.step


@torch.no_grad()
def _reshard(
    state: _State | None, model: nn.Module, optim: torch.optim.Optimizer, how: Plan
) -> None:
    """Move every sharded tensor (parameters, then optimizer state) from the old layout to
    this mesh's, point to point: each overlap of an old rank's rows with a new rank's goes
    from its holder straight into the new shard's storage. Replicated buffers and the
    optimizer's small rest come from the first survivor."""
    started = time.monotonic()
    me, world = dist.get_rank(), dist.get_world_size()
    first = min(n for n, _ in how.sources)
    if state is not None:
        for module in state.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
    skeleton = [_skeleton(state.optim) if me == first and state is not None else None]
    dist.broadcast_object_list(skeleton, src=first)
    skel: dict[str, Any] = skeleton[0]  # type: ignore[assignment]
    params = _params(optim)
    old_params = _params(state.optim) if state is not None else []
    for i, entry in skel["state"].items():
        optim.state[params[i]] = {
            k: _empty_like(params[i], v.dtype) if isinstance(v, _Rows) else _clone(v)
            for k, v in entry.items()
        }
    for group, hyper in zip(optim.param_groups, skel["groups"], strict=True):
        group.update(hyper)
    received = 0
    in_flight: deque[list[tuple[dist.Work, torch.Tensor]]] = deque()
    order = [(i, None) for i in range(len(params))] + [
        (i, k)
        for i, entry in skel["state"].items()
        for k, v in entry.items()
        if isinstance(v, _Rows)
    ]
    for number, (i, key) in enumerate(order):
        if not isinstance(params[i], DTensor) or params[i].placements != (Shard(0),):
            raise ValueError(f"pure FSDP: parameter {i} is not sharded on dim 0 of the mesh")
        target = _local(params[i] if key is None else optim.state[params[i]][key])
        length = params[i].shape[0]
        mine = rows(length, world, me)
        works = []
        for o, (src, from_copy) in enumerate(how.sources):
            theirs = rows(length, how.world, o)
            source = None
            if src == me:
                assert state is not None
                if from_copy:
                    copy = state.copy
                    assert copy is not None
                    source = (
                        copy.params[i] if key is None else copy.optim.state[copy.params[i]][key]
                    )
                else:
                    was = old_params[i]
                    source = _local(was if key is None else state.optim.state[was][key])
            for n in range(world):
                theirs_n = rows(length, world, n)
                a, b = max(theirs.start, theirs_n.start), min(theirs.stop, theirs_n.stop)
                if a >= b or (src != me and n != me):
                    continue
                tag = number * how.world + o  # (unique per message in flight)
                if src == me and n == me:
                    target[a - mine.start : b - mine.start].copy_(
                        source[a - theirs.start : b - theirs.start]  # type: ignore[index]
                    )
                elif src == me:
                    part = source[a - theirs.start : b - theirs.start].contiguous()  # type: ignore[index]
                    works.append((dist.isend(part, n, tag=tag), part))
                else:
                    part = target[a - mine.start : b - mine.start]
                    works.append((dist.irecv(part, src, tag=tag), part))
                    received += part.numel() * part.element_size()
        in_flight.append(works)
        while len(in_flight) > WINDOW:
            _wait(in_flight.popleft())
    for works in in_flight:
        _wait(works)
    for name, buffer in model.named_buffers():  # (replicated: not sharded by fully_shard)
        if me == first and state is not None:
            buffer.copy_(dict(state.model.named_buffers())[name])
        dist.broadcast(buffer, src=first)
    last.reshard_s, last.reshard_bytes = time.monotonic() - started, received
    last.from_copy = sum(1 for _, from_copy in how.sources if from_copy)


def _params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optim.param_groups for p in g["params"]]


@dataclass(frozen=True)
class _Rows:
    """A sharded optimizer state tensor in a skeleton: its rows travel, not it."""

    dtype: torch.dtype


def _clone(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value


def _skeleton(optim: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's layout and small rest, by parameter index: a sharded tensor as
    `_Rows` (its rows travel), anything else as it is; the groups' settings."""
    params = _params(optim)
    state = {
        i: {k: _Rows(v.dtype) if isinstance(v, DTensor) else v for k, v in optim.state[p].items()}
        for i, p in enumerate(params)
        if p in optim.state
    }
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optim.param_groups]
    return {"state": state, "groups": groups}


def _empty_like(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor laid out like `param` (a DTensor: on its mesh, its shard)."""
    local = torch.empty(_local(param).shape, dtype=dtype, device=_local(param).device)
    return handover.laid_out_like(local, param)


def _wait(works: list[tuple[dist.Work, torch.Tensor]]) -> None:
    """Wait for sends and receives (each with its tensor, kept alive until then)."""
    for work, _ in works:
        work.wait()


# --- the peer copy ------------------------------------------------------------------------------


def peer_copy(model: nn.Module, optim: torch.optim.Optimizer) -> PeerCopy:
    """Collective, once per generation after `sync`: with `elastic.peer_copy` (pure FSDP, live,
    more than one node) this rank takes a copy of the shards of the rank one node ahead on the
    ring (rank + a node's processes), model and optimizer state, and sends its own to the rank
    one node behind. Step with `PeerCopy.step()` in place of `optim.step()`: without the
    setting, that is all it does."""
    global _held
    s = elastic.settings()
    active = (
        s.peer_copy
        and live.enabled()
        and _mesh_of(model).ndim == 1
        and s.world_size > s.local_world_size
    )
    if _held is None or _held.model is not model:  # (loaded from the checkpoint after `sync`)
        _held = _State(model, optim, s.generation, s.rank, s.world_size, s.local_world_size)
    copy = PeerCopy(optim, s.rank, s.world_size, s.local_world_size, active)
    if active:
        copy.take()
    _held.copy = copy  # (only once whole: a copy cut short by a loss is none)
    return copy


@dataclass
class PeerCopy:
    """This rank's copy of its ring neighbour's shards: `params` (local shards, plain tensors)
    and `optim` (the same optimizer class over them, its state the neighbour's), stepped with
    the neighbour's gradient shard in `step`."""

    own: torch.optim.Optimizer
    rank: int
    world: int
    stride: int
    active: bool
    params: list[torch.Tensor] = field(default_factory=list)
    optim: torch.optim.Optimizer | None = None
    grads: list[torch.Tensor] = field(default_factory=list)  # the neighbour's, received
    pending: list[torch.Tensor | None] | None = None  # own gradients exchanged, step not taken

    @property
    def holder(self) -> int:
        """The rank that keeps this rank's copy: one node behind on the ring."""
        return (self.rank - self.stride) % self.world

    @property
    def neighbour(self) -> int:
        """The rank whose copy this rank keeps: one node ahead on the ring."""
        return (self.rank + self.stride) % self.world

    @torch.no_grad()
    def take(self) -> None:
        """Collective: send this rank's shards and optimizer state to its holder, receive the
        neighbour's into new tensors (shaped by the neighbour's rows)."""
        started = time.monotonic()
        own = _params(self.own)
        keys = [sorted(self.own.state.get(p, {})) for p in own]
        mine, theirs = [], []
        for p in own:
            mine.append(_local(p))
            theirs.append(self._neighbours(p, p.dtype))
        for p, names in zip(own, keys, strict=True):
            for k in names:
                v = self.own.state[p][k]
                if isinstance(v, torch.Tensor):
                    mine.append(_local(v))
                    theirs.append(
                        self._neighbours(p, v.dtype)
                        if isinstance(v, DTensor)
                        else torch.empty_like(v)
                    )
        _wait(_exchange(mine, theirs, self.holder, self.neighbour))
        self.params = theirs[: len(own)]
        self.grads = [torch.empty_like(t) for t in self.params]
        groups, at = [], 0
        for g in self.own.param_groups:
            n = len(g["params"])
            groups.append({**g, "params": self.params[at : at + n]})
            at += n
        self.optim = type(self.own)(groups)
        received = iter(theirs[len(own) :])
        for p, copy, names in zip(own, self.params, keys, strict=True):
            if names:
                self.optim.state[copy] = {
                    k: next(received)
                    if isinstance(self.own.state[p][k], torch.Tensor)
                    else self.own.state[p][k]
                    for k in names
                }
        last.bootstrap_s = time.monotonic() - started
        last.copy_bytes = sum(t.numel() * t.element_size() for t in theirs + self.grads)

    def _neighbours(self, param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An empty tensor shaped as the neighbour's shard of `param`."""
        local = _local(param)
        if not isinstance(param, DTensor):
            return torch.empty_like(local, dtype=dtype)
        if param.placements != (Shard(0),):
            raise ValueError(f"peer copy: a shard on dim 0 expected, not {param.placements}")
        assert len(rows(param.shape[0], self.world, self.rank)) == local.shape[0]
        n = len(rows(param.shape[0], self.world, self.neighbour))
        return torch.empty((n, *param.shape[1:]), dtype=dtype, device=local.device)

    def step(self) -> None:
        """`optim.step()`; with the copy active, first this rank's gradient shards to its
        holder and the neighbour's here, then a barrier (once any rank passes it, every rank
        holds the step's gradients), then the step of both the optimizer and the copy. A
        peer lost before the barrier raises as any collective does."""
        if not self.active:
            self.own.step()
            return
        started = time.monotonic()
        own = [p.grad for p in _params(self.own)]
        # (no gradient: the parameter took no part in the step, on any rank)
        sent = [_local(g) for g in own if g is not None]
        into = [t for g, t in zip(own, self.grads, strict=True) if g is not None]
        _wait(_exchange(sent, into, self.holder, self.neighbour))
        self.pending = own
        dist.barrier()
        last.exchange_s = time.monotonic() - started
        self.finish()

    def finish(self) -> None:
        """Take the step whose gradients this rank holds (`pending`), on the optimizer and the
        copy: in `step`, and in `sync` for a survivor whose barrier failed after a peer's
        passed. Nothing here talks to a peer."""
        assert self.pending is not None and self.optim is not None
        for p, g in zip(_params(self.own), self.pending, strict=True):
            p.grad = g  # (a failed step's zero_grad(set_to_none) unlinked them)
        for copy, g, into in zip(self.params, self.pending, self.grads, strict=True):
            copy.grad = None if g is None else into
        for group, theirs in zip(self.optim.param_groups, self.own.param_groups, strict=True):
            group.update({k: v for k, v in theirs.items() if k != "params"})  # (an LR schedule)
        self.own.step()
        started = time.monotonic()
        self.optim.step()
        last.copy_step_s = time.monotonic() - started
        last.copy_s = last.exchange_s + last.copy_step_s
        self.pending = None


def _exchange(
    mine: list[torch.Tensor], theirs: list[torch.Tensor], to: int, source: int
) -> list[tuple[dist.Work, torch.Tensor]]:
    """Send `mine` to rank `to` and receive `theirs` from rank `source`, tensor by tensor, all
    posted at once (receives first: a ring where every rank sends never waits on itself)."""
    works = [(dist.irecv(t, source, tag=i), t) for i, t in enumerate(theirs) if t.numel()]
    for i, t in enumerate(mine):
        if t.numel():
            t = t.contiguous()
            works.append((dist.isend(t, to, tag=i), t))
    return works
