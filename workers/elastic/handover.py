"""Live resize's state hand-over: tensors go straight from the survivors' state dicts into the
takers' (joiners, and any survivor a step behind), point to point, never as one pickled object.

- What travels: the module's state dict, received in place (into the taker's own parameters
  and buffers); the optimizer's state tensors, allocated on the taker from a small skeleton
  (shapes and dtypes, the param groups, the step, anything the loop registered) that is the
  only thing pickled.
- Order and cut: every rank derives the same tensor order (the module's state dict, then the
  optimizer state by parameter index and key) and cuts it into buckets of about
  `BUCKET_BYTES`. A tensor of at least a bucket's size is a bucket of its own and is sent as
  it lies in memory (no copy at the source); smaller ones are packed into one buffer.
- Striping: bucket b comes from source b mod len(sources), the survivors holding the newest
  step, to every taker. With several survivors, each sends a share; a taker receives from all.
- Memory: at most `WINDOW` packed buffers are in flight on either side, so the source holds no
  second copy of its state (only a few buckets), and a taker only what it must hold anyway.
- Sharded models (FSDP2 as HSDP, sharded.py): each rank's local shards travel, within `group`,
  the ranks that hold the same shard (one per node); a taker's optimizer state is allocated as
  DTensors on its own parameters' mesh.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

BUCKET_BYTES = 32 << 20
WINDOW = 4


class Stateful(Protocol):
    """What a loop may register beside the model and optimizer (an LR scheduler, a scaler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


@dataclass(frozen=True)
class TensorSpec:
    """An optimizer state tensor as the taker allocates it."""

    shape: tuple[int, ...]  # (a DTensor's local shard)
    dtype: torch.dtype
    on_cpu: bool  # (e.g. Adam's step counter, a CPU scalar beside CUDA parameters)
    sharded: bool = False  # a DTensor like its parameter (FSDP2): rebuilt on the taker's mesh


@dataclass(frozen=True)
class Roles:
    """Who gives and who takes, from every rank's step (a joiner's is -1)."""

    step: int
    sources: list[int]
    takers: list[int]


@dataclass
class Stats:
    """What the last hand-over moved, for the loop's log and the benchmarks."""

    bytes: int = 0
    sent: int = 0  # (by this rank: a source's share, striped)
    seconds: float = 0.0
    sources: int = 0
    takers: int = 0
    first_source: int = 0


last = Stats()


def roles(steps: list[int]) -> Roles:
    """The ranks at the newest step give; every other rank takes."""
    top = max(steps)
    return Roles(
        step=top,
        sources=[r for r, s in enumerate(steps) if s == top],
        takers=[r for r, s in enumerate(steps) if s != top],
    )


def source_of(bucket: int, sources: list[int]) -> int:
    """Striping: which source sends bucket `bucket` (every taker receives it from there)."""
    return sources[bucket % len(sources)]


def buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Tensor indices, in order, cut into buckets: a tensor of at least `bucket_bytes` alone,
    smaller neighbours packed up to `bucket_bytes`."""
    out: list[list[int]] = []
    packed: list[int] = []
    room = 0
    for i, size in enumerate(sizes):
        if packed and (size > room or size >= bucket_bytes):
            out.append(packed)
            packed = []
        if size >= bucket_bytes:
            out.append([i])
            continue
        if not packed:
            room = bucket_bytes
        packed.append(i)
        room -= size
    if packed:
        out.append(packed)
    return out


def transfer(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    steps: list[int],
    others: Iterable[Stateful] = (),
    group: dist.ProcessGroup | None = None,
) -> int:
    """Collective over `group` (default: the world), whose members' steps are `steps` in
    group-rank order: every member ends with the state of those at the newest step; that step."""
    started = time.monotonic()
    who = roles(steps)
    last.bytes = last.sent = last.sources = last.takers = 0
    if not who.takers:
        return who.step
    members = dist.get_process_group_ranks(group) if group else list(range(len(steps)))
    sources, takers = [members[r] for r in who.sources], [members[r] for r in who.takers]
    rank = dist.get_rank()
    others = list(others)
    model_tensors = [_local(t) for t in model.state_dict().values()]
    device = model_tensors[0].device if model_tensors else torch.device("cpu")
    giving = rank in sources
    skeleton = [_skeleton(optim, others) if rank == sources[0] else None]
    dist.broadcast_object_list(skeleton, src=sources[0], group=group)
    skel: dict[str, Any] = skeleton[0]  # type: ignore[assignment]
    params = [p for g in optim.param_groups for p in g["params"]]
    optim_state = (
        optim.state_dict()["state"] if giving else _allocate(skel["state"], device, params)
    )
    tensors = model_tensors + _optim_tensors(optim_state, skel["state"])
    sizes = [t.numel() * t.element_size() for t in tensors]
    cut = buckets(sizes, BUCKET_BYTES)
    if giving:
        mine = [b for b in range(len(cut)) if source_of(b, sources) == rank]
        _send(tensors, cut, mine, takers, device, group)
        last.sent = sum(sizes[i] for b in mine for i in cut[b]) * len(takers)
    else:
        _receive(tensors, cut, sources, device, group)
        optim.load_state_dict({"state": optim_state, "param_groups": skel["param_groups"]})
        for obj, state in zip(others, skel["others"], strict=True):
            obj.load_state_dict(state)
    dist.barrier(group=group)  # (so that every clock stops when the last taker has it all)
    last.bytes, last.seconds = sum(sizes), time.monotonic() - started
    last.sources, last.takers, last.first_source = len(sources), len(takers), sources[0]
    return who.step


def _local(t: torch.Tensor) -> torch.Tensor:
    """What travels of a tensor: a DTensor's local shard (its own memory), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _skeleton(optim: torch.optim.Optimizer, others: list[Stateful]) -> dict[str, Any]:
    """The source's small rest: optimizer state with tensors as specs, groups, others."""
    sd = optim.state_dict()
    state = {
        index: {
            key: TensorSpec(
                tuple(_local(v).shape), v.dtype, v.device.type == "cpu", isinstance(v, DTensor)
            )
            if isinstance(v, torch.Tensor)
            else v
            for key, v in entry.items()
        }
        for index, entry in sd["state"].items()
    }
    return {
        "state": state,
        "param_groups": sd["param_groups"],
        "others": [obj.state_dict() for obj in others],
    }


def _allocate(
    spec: dict[Any, dict[str, Any]], device: torch.device, params: list[torch.Tensor]
) -> dict[Any, dict[str, Any]]:
    """Empty tensors where the skeleton has specs (a sharded one as a DTensor laid out like its
    parameter, `params` in the optimizer's index order); other values as they are."""
    return {
        index: {
            key: _empty(v, device, params[index]) if isinstance(v, TensorSpec) else v
            for key, v in entry.items()
        }
        for index, entry in spec.items()
    }


def _empty(spec: TensorSpec, device: torch.device, param: torch.Tensor) -> torch.Tensor:
    local = torch.empty(spec.shape, dtype=spec.dtype, device="cpu" if spec.on_cpu else device)
    return laid_out_like(local, param) if spec.sharded else local


def laid_out_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`local` as this rank's shard of a tensor sharded as `param` (a DTensor) is; `local`
    itself where `param` is a plain tensor."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(
        local,
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _optim_tensors(state: dict[Any, dict[str, Any]], spec: dict[Any, dict[str, Any]]) -> list:
    """The optimizer's tensors in the skeleton's order (the same on every rank)."""
    return [
        _local(state[index][key])
        for index, entry in spec.items()
        for key, v in entry.items()
        if isinstance(v, TensorSpec)
    ]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _direct(tensors: list[torch.Tensor], bucket: list[int], device: torch.device) -> bool:
    """A bucket sent as the tensor lies in memory: alone, contiguous, on the wire's device."""
    t = tensors[bucket[0]]
    return len(bucket) == 1 and t.is_contiguous() and t.device == device


def _send(
    tensors: list[torch.Tensor],
    cut: list[list[int]],
    mine: list[int],
    takers: list[int],
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> None:
    in_flight: deque[list[dist.Work]] = deque()
    for b in mine:
        if _direct(tensors, cut[b], device):
            wire = _as_bytes(tensors[cut[b][0]])
        else:
            wire = torch.cat([_as_bytes(tensors[i]).to(device) for i in cut[b]])
        in_flight.append([dist.isend(wire, dst, group, tag=b) for dst in takers])
        while len(in_flight) > WINDOW:
            _wait(in_flight.popleft())
    for works in in_flight:
        _wait(works)


def _receive(
    tensors: list[torch.Tensor],
    cut: list[list[int]],
    sources: list[int],
    device: torch.device,
    group: dist.ProcessGroup | None,
) -> None:
    in_flight: deque[tuple[list[int], torch.Tensor, dist.Work]] = deque()
    for b, bucket in enumerate(cut):
        if _direct(tensors, bucket, device):
            wire = _as_bytes(tensors[bucket[0]])
        else:
            size = sum(tensors[i].numel() * tensors[i].element_size() for i in bucket)
            wire = torch.empty(size, dtype=torch.uint8, device=device)
        work = dist.irecv(wire, source_of(b, sources), group, tag=b)
        in_flight.append((bucket, wire, work))
        while len(in_flight) > WINDOW:
            _unpack(tensors, device, *in_flight.popleft())
    for item in in_flight:
        _unpack(tensors, device, *item)


def _unpack(
    tensors: list[torch.Tensor],
    device: torch.device,
    bucket: list[int],
    wire: torch.Tensor,
    work: dist.Work,
) -> None:
    work.wait()
    if _direct(tensors, bucket, device):
        return
    offset = 0
    for i in bucket:
        t = tensors[i]
        size = t.numel() * t.element_size()
        chunk = wire[offset : offset + size]
        offset += size
        if t.is_contiguous():
            _as_bytes(t).copy_(chunk)
        else:  # (a byte chunk at any offset, cloned so its start suits the dtype)
            t.copy_(chunk.clone().view(t.dtype).view(t.shape))


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()
