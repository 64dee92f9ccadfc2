"""A plain torchrun DDP script that knows nothing of spotrain: run it as
`torchrun --nproc-per-node 2 examples/train_torchrun.py --ckpt-dir /tmp/ckpt`, or under spotrain
as a `type: command` job (examples/job_torchrun.yaml), which launches torchrun per node.

What makes it elastic is ordinary hygiene:
- SIGTERM sets a flag; at the next step boundary the ranks agree (one all-reduce), rank 0
  saves a checkpoint, and every rank exits 0. A node reclaim with notice arrives as exactly
  that SIGTERM (the pod deletion on Kubernetes, spotrain's elastic event elsewhere);
- it saves every --ckpt-every steps too (a node lost without notice costs at most that much);
- it resumes from the newest checkpoint in --ckpt-dir at whatever world size torchrun gives it;
- step s trains on samples [s*B, (s+1)*B) of a fixed shuffle, split over the ranks, so a
  resize neither repeats nor skips a sample.

`--record DIR` appends each rank's steps (sample range, loss) as JSON lines, for the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

SAMPLES, FEATURES = 8192, 6


def data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets and one fixed shuffle of them; identical on every rank and run."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.tanh(x @ torch.randn(FEATURES, 1, generator=g)) + 0.05 * torch.randn(
        SAMPLES, 1, generator=g
    )
    return x, y, torch.randperm(SAMPLES, generator=g)


def my_share(batch: int, world: int, rank: int) -> range:
    """This rank's positions within a batch: the first batch % world ranks take one more."""
    small, extra = divmod(batch, world)
    start = rank * small + min(rank, extra)
    return range(start, start + small + (rank < extra))


def latest(ckpt_dir: Path) -> Path | None:
    found = sorted(ckpt_dir.glob("step-*.pt"))
    return found[-1] if found else None


def save(ckpt_dir: Path, step: int, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Rank 0 writes (temp file, then rename: a reader sees all of it or none); all wait."""
    if dist.get_rank() == 0:
        tmp = ckpt_dir / f".tmp-step-{step:07d}.pt"
        torch.save({"step": step, "model": model.state_dict(), "optim": optim.state_dict()}, tmp)
        os.replace(tmp, ckpt_dir / f"step-{step:07d}.pt")
    dist.barrier()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--record", type=Path)
    parser.add_argument("--step-time", type=float, default=0.0, help="sleep per step (tests)")
    args = parser.parse_args()

    stop = False

    def on_sigterm(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True  # the checkpoint happens at the step boundary, not in the handler

    signal.signal(signal.SIGTERM, on_sigterm)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    optim = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    step = 0
    if (path := latest(args.ckpt_dir)) is not None:
        state = torch.load(path)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        step = state["step"]
    ddp = DistributedDataParallel(model)
    x, y, order = data()
    share = my_share(args.batch, world, rank)
    record = None
    if args.record:
        args.record.mkdir(parents=True, exist_ok=True)
        record = (args.record / f"world-{world}-rank-{rank}.jsonl").open("a", buffering=1)
    print(f"rank {rank}/{world}: from step {step}, share {share}", flush=True)

    while step < args.steps:
        first = step * args.batch + share.start  # position in an endless repeat of `order`
        idx = order[(first + torch.arange(len(share))) % SAMPLES]
        sse = ((ddp(x[idx]) - y[idx]) ** 2).sum()
        (sse * world / args.batch).backward()  # DDP's mean over ranks: the global batch mean
        optim.step()
        optim.zero_grad()
        step += 1
        time.sleep(args.step_time)  # stands in for a bigger model's step
        flags = torch.tensor([sse.item(), float(stop)])
        dist.all_reduce(flags)
        loss, stopping = flags[0].item() / args.batch, flags[1].item() > 0
        if record:
            row = {"step": step, "first": first, "count": len(idx), "loss": loss}
            record.write(json.dumps(row) + "\n")
        if stopping or step % args.ckpt_every == 0 or step == args.steps:
            save(args.ckpt_dir, step, ddp.module, optim)
        if stopping:
            print(f"rank {rank}: SIGTERM, checkpointed step {step}, exiting", flush=True)
            break
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # skip gloo's teardown, which can deadlock at exit (pytorch/pytorch#75097)
