"""Sharded models under spotrain (FSDP2 `fully_shard`), as HSDP: a node is one replica.

The generation's 2-D device mesh replicates over its nodes and shards over each node's
processes, so the shard dimension (a node's process count) never changes with the world size:
a resize only adds or removes replicas. That is what makes a sharded job resize live:
- a survivor keeps its shards: it builds the model on the new mesh (on the meta device, no
  initialisation) and `carry` copies its own shards into it, locally;
- a joining node takes each shard from a survivor that holds the same one
  (`live.sync(..., group=replicas(mesh))`, the tensor hand-over of handover.py);
- a node lost without notice costs at most the step in flight: every shard lives on in
  another replica. With a single node (no other replica) a loss falls back to the last
  checkpoint, as does any job in restart mode: DCP reshards to any mesh.

    mesh = sharded.node_mesh(s, "cpu")            # after live.init_process_group
    ...fully_shard(block, mesh=mesh) for each block, then the root; the optimizer...
    step = live.sync(model, optim, step, group=sharded.replicas(mesh))
    ...train...
    s = live.next_generation(step)                # parked until placed
    mesh = sharded.node_mesh(s, "cpu")            # then the model again, on the meta
    ...device, fully_shard on the new mesh, to_empty; a new optimizer...
    sharded.carry(model, optim, new, new_optim)   # this rank's shards, old mesh -> new

examples/train_fsdp.py is the whole of it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from spotrain import elastic

REPLICATE, SHARD = "replicate", "shard"


def node_mesh(s: elastic.Settings, device_type: str) -> DeviceMesh:
    """HSDP's mesh for this generation: replicate over nodes x shard over a node's processes
    (the runtime places a node's ranks next to each other, `LOCAL_WORLD_SIZE` of them)."""
    procs = s.local_world_size
    if s.world_size % procs:
        raise ValueError(f"world size {s.world_size} is not a multiple of {procs} per node")
    return init_device_mesh(
        device_type, (s.world_size // procs, procs), mesh_dim_names=(REPLICATE, SHARD)
    )


def replicas(mesh: DeviceMesh) -> torch.distributed.ProcessGroup:
    """The group of ranks that hold this rank's shard: one per node."""
    return mesh.get_group(REPLICATE)


def carry(
    old: nn.Module,
    old_optim: torch.optim.Optimizer,
    new: nn.Module,
    new_optim: torch.optim.Optimizer,
) -> None:
    """Local: this rank's shards of the module and optimizer built on the last generation's
    mesh, into the same module and optimizer built on this one's (the same shard of every
    tensor: the shard dimension never changes). The old mesh's groups may be gone, or have
    failed mid-step: nothing here talks to a peer."""
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
