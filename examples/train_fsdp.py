"""A real elastic sharded job: a small decoder-only transformer trained with FSDP2 (HSDP, or
pure FSDP with `--full-shard`).

Run by a spotrain runtime (it sets the torchrun-style and SPOTRAIN_* environment). The rank
contract of examples/train_ddp.py, for a sharded model:
- a 2-D device mesh (spotrain.elastic.sharded): replicate over nodes, shard over each node's
  processes (`procs_per_node` in the job spec); or, with `--full-shard`, one shard per rank
  over every node (no replica); gloo on CPU, NCCL when CUDA is present;
- DCP checkpoints to the job's file:// or s3:// location: asynchronous every `ckpt_every`
  steps, synchronous on an elastic event; a new generation at another world size loads the
  newest one, resharded to its mesh;
- the sample stream of spotrain.elastic.sampler: step s consumes stream positions
  [s*G, (s+1)*G), split over the ranks, so no sample is repeated or skipped across resizes;
- live resize (`elastic.resize: live`): HSDP: a survivor keeps its shards and rebuilds the
  model on the next generation's mesh (`sharded.carry`); a joining node takes each shard from
  a survivor holding the same one; a node lost without notice costs at most the step in
  flight. Pure FSDP: `sharded.sync` reshards in memory to the new world size, and with
  `elastic.peer_copy` a lost node's shards come from the copy its ring neighbour kept
  (`sharded.peer_copy`, stepped in `copy.step()`); without one, from the last checkpoint.

The data: token sequences from a fixed random Markov chain (no downloads), so the loss falls
to the chain's entropy. `--record DIR` appends each rank's consumed positions and rank 0's
losses there as JSON lines, and each rank's final (gathered) weights to
DIR/final-rank-R.json (the tests check them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from spotrain import elastic
from spotrain.elastic import checkpoint, handover, live, sharded
from spotrain.elastic.sampler import stream_indices

VOCAB = 64
SEQ = 32
DATASET_SIZE = 2048


def dataset() -> torch.Tensor:
    """The same sequences on every rank and generation: a fixed random Markov chain, each
    token followed by its chain successor 3 times in 4, else by a random token."""
    g = torch.Generator().manual_seed(1234)
    successor = torch.randperm(VOCAB, generator=g)
    tokens = torch.empty(DATASET_SIZE, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(VOCAB, (DATASET_SIZE,), generator=g)
    for i in range(1, SEQ + 1):
        follow = torch.rand(DATASET_SIZE, generator=g) < 0.75
        noise = torch.randint(VOCAB, (DATASET_SIZE,), generator=g)
        tokens[:, i] = torch.where(follow, successor[tokens[:, i - 1]], noise)
    return tokens


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """A decoder-only transformer: token and position embeddings, blocks, a tied-free head."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(SEQ, width)
        self.blocks = nn.ModuleList(Block(width, heads=max(1, width // 64)) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        """The summed next-token loss over `seq` (returned from inside: the root module's
        output is then no view of the logits, which FSDP2 warns of)."""
        tokens = seq[:, :-1]
        x = self.tokens(tokens) + self.positions(torch.arange(tokens.shape[1], device=seq.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1), reduction="sum")


def shape_for(params_m: float) -> tuple[int, int]:
    """(width, depth): the tiny default, or about `params_m` million parameters 1024 wide
    (12 width^2 per block), to measure resizes at the sizes people train."""
    if not params_m:
        return 64, 2
    return 1024, max(1, round(params_m * 1e6 / (12 * 1024 * 1024)))


def build(
    mesh: DeviceMesh, shape: tuple[int, int], device: torch.device, model: nn.Module | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model sharded on `mesh` (each block, then the root) and its optimizer. Without a
    built `model`, one on the meta device: its storage is allocated sharded, uninitialised
    (a survivor carries its shards into it, a joiner receives them)."""
    if model is None:
        with torch.device("meta"):
            model = Decoder(*shape)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if next(model.parameters()).is_meta:
        model.to_empty(device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)


def state_of(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    """What a checkpoint holds: the sharded model and optimizer (DCP reshards both) and the
    step."""
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}


def load(
    ckpt: checkpoint.Checkpointer,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    required: bool = False,
) -> int:
    """Resume from the newest complete checkpoint that loads (any mesh); the step. If none
    loads: step 0 from the initial weights (`required`: the model is uninitialised, a fault)."""
    state = state_of(model, optim, 0)
    if ckpt.load(state) is None:
        if required:
            raise RuntimeError("no checkpoint to go back to, and the shards are lost")
        return 0
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def oracle(
    s: elastic.Settings,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    mesh: DeviceMesh,
    to: Path,
) -> None:
    """Benchmarks, HSDP: after a hand-over, time a raw `dist.broadcast` of the same local
    shards on the same group (the replicas of this rank's shard: the limit), and write both
    beside the step records (rank 0)."""
    local = list(model.state_dict().values())
    for p in (p for g in optim.param_groups for p in g["params"]):
        local += [v for _, v in sorted(optim.state.get(p, {}).items()) if torch.is_tensor(v)]
    local = [t.to_local() if isinstance(t, DTensor) else t for t in local]
    group = sharded.replicas(mesh)
    dist.barrier()
    started = time.monotonic()
    for t in local:
        dist.broadcast(t, src=handover.last.first_source, group=group)
    raw = time.monotonic() - started
    if s.is_rank0:
        took = {"bytes": handover.last.bytes, "handover_s": handover.last.seconds, "raw_s": raw}
        took |= {"sources": handover.last.sources, "takers": handover.last.takers}
        (to / f"gen-{s.generation}-handover.json").write_text(json.dumps(took))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, help="append consumed positions and losses here")
    parser.add_argument(
        "--step-time", type=float, default=0.0, help="sleep per step, to stand in for a big model"
    )
    parser.add_argument(
        "--params", type=float, default=0, help="millions of parameters (default: tiny)"
    )
    parser.add_argument(
        "--oracle", action="store_true", help="benchmarks: time a raw broadcast per hand-over"
    )
    parser.add_argument(
        "--full-shard",
        action="store_true",
        help="pure FSDP: shard over every rank, no replica (set elastic.peer_copy to survive "
        "a node lost without notice in memory)",
    )
    args = parser.parse_args()

    s = elastic.settings()
    if s.global_batch_size is None:
        sys.exit("set global_batch_size in the job spec: ranks need their share of it")
    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{s.local_rank}" if cuda else "cpu")
    torch.set_num_threads(1)
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    shape = shape_for(args.params)
    # Built before the gang start (a head start); sharded once the mesh exists.
    full = Decoder(*shape).to(device)
    data = dataset()
    s = elastic.wait_for_gang()
    live.init_process_group("nccl" if cuda else "gloo")
    new_mesh = sharded.full_mesh if args.full_shard else sharded.node_mesh
    mesh = new_mesh(s, device.type)
    model, optim = build(mesh, shape, device, full)
    # A node joining a live resize takes its shards from the survivors in `sharded.sync`.
    step = -1 if live.state_from_peers() else load(checkpoint.Checkpointer(), model, optim)
    if args.record:
        args.record.mkdir(parents=True, exist_ok=True)
    while True:  # one pass per generation this process trains in
        done = train(s, args, model, optim, mesh, step, data, device)
        if done is None:
            return 0
        step = done
        if (s := live.next_generation(step)) is None:  # parked until placed (live), else exit
            return 0
        mesh = new_mesh(s, device.type)
        new_model, new_optim = build(mesh, shape, device)
        sharded.carry(model, optim, new_model, new_optim)  # HSDP; pure FSDP: in sharded.sync
        model, optim = new_model, new_optim


def train(
    s: elastic.Settings,
    args: argparse.Namespace,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    mesh: DeviceMesh,
    step: int,
    data: torch.Tensor,
    device: torch.device,
) -> int | None:
    """Train this generation from `step`: None once the job is done, else the step reached
    when the elastic event came (checkpointed if it asks) or a peer was lost (live)."""
    batch = s.batch_slice()
    ckpt_every = int(s.scale_config.get("ckpt_every", 25))
    record = (
        (args.record / f"gen-{s.generation}-rank-{s.rank}.jsonl").open("a", buffering=1)
        if args.record
        else None
    )
    print(f"gen {s.generation} rank {s.rank}/{s.world_size}: step {step}, {batch}", flush=True)
    tokens_per_step = s.global_batch_size * SEQ  # type: ignore[operator]
    try:
        step = sharded.sync(model, optim, step, mesh)  # joiners' shards (pure FSDP: all moved)
        if step is None:  # pure FSDP: a node's shards lost with their copy
            step = load(checkpoint.Checkpointer(), model, optim, required=True)
        copy = sharded.peer_copy(model, optim)  # elastic.peer_copy: a ring neighbour's shards
        if args.oracle and mesh.ndim > 1 and handover.last.takers and args.record:
            oracle(s, model, optim, mesh, args.record)
        if record and s.is_rank0 and sharded.last.reshard_s:  # (what it cost, for the bench)
            stats = json.dumps(dataclasses.asdict(sharded.last))
            (args.record / f"gen-{s.generation}-reshard.json").write_text(stats)
        for group in optim.param_groups:
            group["lr"] = float(s.scale_config.get("lr", 3e-3))
        ckpt = checkpoint.Checkpointer()
        if (notice := live.checkpoint_owed()) is not None:
            ckpt.save_async(state_of(model, optim, step), step, kind="notice", notice_at=notice)
        while step < s.total_steps:
            with elastic.busy():
                start = step * s.global_batch_size + batch.start  # type: ignore[operator]
                idx = stream_indices(start, len(batch), DATASET_SIZE)
                sse = model(data[idx].to(device))
            # FSDP averages gradients over ranks: scaled by world/tokens, the global mean.
            (sse * s.world_size / tokens_per_step).backward()
            seen, vote = elastic.elastic_event_detected(), live.wants_checkpoint()
            flags = torch.tensor([sse.item(), seen, vote], dtype=torch.float64, device=device)
            dist.all_reduce(flags)
            loss = flags[0].item() / tokens_per_step
            event, save = flags[1].item() > 0, flags[2].item() > 0
            copy.step()  # optim.step(), and the same step on the neighbour's copy (if kept)
            optim.zero_grad()
            step += 1
            if record:
                entry = {"step": step, "start": start, "count": len(idx), "world": s.world_size}
                entry |= {"time": time.time(), "copy_s": sharded.last.copy_s}
                record.write(json.dumps({**entry, "loss": loss} if s.is_rank0 else entry) + "\n")
            if args.step_time:
                time.sleep(args.step_time)
            if s.is_rank0 and step % 10 == 0:
                print(f"step {step} loss {loss:.4f} world {s.world_size}", flush=True)
            elastic.report_progress(step)
            ckpt.poll()
            if event:
                if save:
                    ckpt.save(state_of(model, optim, step), step, kind="notice")
                ckpt.close()
                print(f"rank {s.rank}: elastic event at step {step}", flush=True)
                return step
            if step % ckpt_every == 0 and step < s.total_steps:
                ckpt.save_async(state_of(model, optim, step), step)
    except Exception as err:
        if not (live.enabled() and live.peer_failed(err)):
            raise
        optim.zero_grad()  # a peer vanished mid-step: that step is dropped whole
        print(f"rank {s.rank}: lost a peer at step {step}: {err}", flush=True)
        return step
    finally:
        if record:
            record.close()
    ckpt.save(state_of(model, optim, step), step, kind="final")
    if args.record:  # the tests compare the trained weights with an uninterrupted run's
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        weights = torch.cat([t.detach().reshape(-1).cpu() for t in full.values()])
        (args.record / f"final-rank-{s.rank}.json").write_text(json.dumps(weights.tolist()))
    elastic.mark_done(step)
    dist.barrier()
    return None


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as leave:
        if isinstance(leave.code, str):
            print(leave.code, file=sys.stderr)
        code = leave.code if isinstance(leave.code, int) else int(leave.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (no process-group teardown: see examples/train_ddp.py)
