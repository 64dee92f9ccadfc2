"""A real elastic PyTorch DDP job: a small MLP learns a fixed-seed synthetic regression.

Run by a spotrain runtime (it sets the torchrun-style and SPOTRAIN_* environment). Shows the
whole rank contract:
- gloo on CPU, NCCL when CUDA is present;
- torch.distributed.checkpoint (DCP) to the job's file:// or s3:// location through
  `spotrain.elastic.checkpoint`: asynchronous every `ckpt_every` steps (training goes on while
  it is written), synchronous on an elastic event; a new generation at another world size
  loads the newest complete one (DCP reshards);
- a sampler keyed by the global sample position: step s consumes positions
  [s*G, (s+1)*G) of an endless stream of per-epoch permutations, split over the ranks by the
  uneven local batches, so no sample is repeated or skipped across resizes;
- exit 0 after an elastic event (checkpoint, then ack), or after the done marker;
- live resize (`elastic.resize: live`, spotrain.elastic.live): on a membership change this
  process parks holding its step, joins the next generation's process group and trains on;
  a joiner takes the survivors' state; a peer lost mid-step costs only that step.

scale_config keys (per world size): lr, ckpt_every. `--record DIR` appends each rank's
consumed positions and rank 0's losses there as JSON lines, and each rank's final weights
to DIR/final-rank-R.json (the tests check them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from spotrain import elastic
from spotrain.elastic import checkpoint, handover, live

DATASET_SIZE = 4096
FEATURES = 8


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """The same data on every rank and generation: y = f(x) + noise, from a fixed seed."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(DATASET_SIZE, FEATURES, generator=g)
    w = torch.randn(FEATURES, 1, generator=g)
    y = x @ w + 0.5 * torch.sin(x[:, :1] * 2) + 0.05 * torch.randn(DATASET_SIZE, 1, generator=g)
    return x, y


def sample_indices(start: int, count: int) -> torch.Tensor:
    """Dataset indices at global stream positions [start, start+count): epoch e is a fixed
    permutation seeded by e, so a position always maps to the same sample."""
    positions = torch.arange(start, start + count)
    epochs = positions // DATASET_SIZE
    out = torch.empty(count, dtype=torch.long)
    for epoch in epochs.unique().tolist():
        perm = torch.randperm(DATASET_SIZE, generator=torch.Generator().manual_seed(epoch))
        mask = epochs == epoch
        out[mask] = perm[positions[mask] % DATASET_SIZE]
    return out


def build_model(params_m: float) -> nn.Module:
    """The tiny MLP, or one of about `params_m` million parameters (hidden layers 2048 wide)
    to measure resizes at the sizes people train."""
    width = 32 if not params_m else 2048
    hidden = max(0, round(params_m * 1e6 / (width * width)) - 1) if params_m else 0
    layers: list[nn.Module] = [nn.Linear(FEATURES, width), nn.Tanh()]
    for _ in range(hidden):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


def state_of(model: nn.Module, optim: torch.optim.Optimizer, step: int) -> dict:
    """What a checkpoint holds: model and optimizer (DCP reshards both) and the step."""
    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}


def load(ckpt: checkpoint.Checkpointer, model: nn.Module, optim: torch.optim.Optimizer) -> int:
    """Resume from the newest complete checkpoint that loads (any world size); the step."""
    state = state_of(model, optim, 0)
    if ckpt.load(state) is None:
        return 0
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def oracle(s: elastic.Settings, model: nn.Module, optim: torch.optim.Optimizer, to: Path) -> None:
    """Benchmarks: after a hand-over, time a raw `dist.broadcast` of the same tensors on the
    same group (the limit), and write both beside the step records (rank 0)."""
    tensors = list(model.state_dict().values())
    tensors += [v for e in optim.state.values() for v in e.values() if torch.is_tensor(v)]
    dist.barrier()
    started = time.monotonic()
    for t in tensors:
        dist.broadcast(t, src=handover.last.first_source)
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
        "--params", type=float, default=0, help="millions of parameters (default: a tiny MLP)"
    )
    parser.add_argument(
        "--oracle", action="store_true", help="benchmarks: time a raw broadcast per hand-over"
    )
    args = parser.parse_args()

    s = elastic.settings()
    if s.global_batch_size is None:
        sys.exit("set global_batch_size in the job spec: ranks need their share of it")
    # Everything that needs no peer comes before the gang start: a rank started ahead of a
    # live resize (a head start) has it ready when the generation starts.
    cuda = torch.cuda.is_available()
    torch.set_num_threads(1)  # a tiny model: threads only fight over the cores
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts them)
    device = torch.device(f"cuda:{s.local_rank}" if cuda else "cpu")
    model = build_model(args.params).to(device)
    optim = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    x_all, y_all = dataset()
    s = elastic.wait_for_gang()
    live.init_process_group("nccl" if cuda else "gloo")
    # A rank joining a live resize takes the survivors' state in `live.sync`, not the disk's.
    step = -1 if live.state_from_peers() else load(checkpoint.Checkpointer(), model, optim)
    if args.record:
        args.record.mkdir(parents=True, exist_ok=True)
    while s is not None:  # one pass per generation this process trains in
        done = train(s, args, model, optim, step, (x_all, y_all), device)
        if done is None:
            return 0
        step = done
        s = live.next_generation(step)  # parked until placed (live), else None: exit
    return 0


def train(
    s: elastic.Settings,
    args: argparse.Namespace,
    model: nn.Module,
    optim: torch.optim.Optimizer,
    step: int,
    data: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
) -> int | None:
    """Train this generation from `step` (after taking the most advanced rank's state): None
    once the job is done, else the step reached when the elastic event came (checkpointed if
    it asks) or a peer was lost (live)."""
    if cuda := device.type == "cuda":
        torch.cuda.set_device(device)
    batch = s.batch_slice()
    ckpt_every = int(s.scale_config.get("ckpt_every", 25))
    record = (
        # line-buffered: a rank killed without notice still leaves every step it took
        (args.record / f"gen-{s.generation}-rank-{s.rank}.jsonl").open("a", buffering=1)
        if args.record
        else None
    )
    print(f"gen {s.generation} rank {s.rank}/{s.world_size}: step {step}, {batch}", flush=True)
    try:  # (every collective, the first ones too, can meet a lost peer)
        step = live.sync(model, optim, step)
        if args.oracle and handover.last.takers and args.record:
            oracle(s, model, optim, args.record)
        for group in optim.param_groups:  # this world size's rate, over the restored state's
            group["lr"] = float(s.scale_config.get("lr", 0.02))
        ckpt = checkpoint.Checkpointer()
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if cuda else None,
            init_sync=not live.enabled(),  # (live: `sync` made every rank's state the same)
            gradient_as_bucket_view=True,  # (no second copy of the gradients)
        )
        if (notice := live.checkpoint_owed()) is not None:  # a live notice's: no pause
            ckpt.save_async(state_of(model, optim, step), step, kind="notice", notice_at=notice)
        while step < s.total_steps:
            with elastic.busy():  # this rank's own work (backward waits on peers): stragglers
                start = step * s.global_batch_size + batch.start
                idx = sample_indices(start, batch.stop - batch.start)
                x, y = data[0][idx].to(device), data[1][idx].to(device)
                sse = ((ddp(x) - y) ** 2).sum()
            # DDP averages gradients over ranks; scaling by world/global makes it the global mean.
            (sse * s.world_size / s.global_batch_size).backward()
            # One all-reduce: the global loss, whether any rank saw the elastic event, and
            # whether any that saw it wants a checkpoint (a rank may hear of it only here). Both
            # collectives come before the optimizer step, so a peer lost in either leaves the
            # model as it was: the step in flight is dropped whole.
            seen, vote = elastic.elastic_event_detected(), live.wants_checkpoint()
            flags = torch.tensor([sse.item(), seen, vote], dtype=torch.float64, device=device)
            dist.all_reduce(flags)
            loss = flags[0].item() / s.global_batch_size
            event, save = flags[1].item() > 0, flags[2].item() > 0
            optim.step()
            optim.zero_grad()
            step += 1
            if record:
                entry = {"step": step, "start": start, "count": len(idx), "world": s.world_size}
                entry["time"] = time.time()
                record.write(json.dumps({**entry, "loss": loss} if s.is_rank0 else entry) + "\n")
            if args.step_time:
                time.sleep(args.step_time)
            if s.is_rank0 and step % 10 == 0:
                print(f"step {step} loss {loss:.5f} world {s.world_size}", flush=True)
            elastic.report_progress(step)
            ckpt.poll()
            if event:
                if save:
                    ckpt.save(state_of(ddp.module, optim, step), step, kind="notice")
                ckpt.close()
                print(f"rank {s.rank}: elastic event at step {step}", flush=True)
                return step
            if step % ckpt_every == 0 and step < s.total_steps:
                ckpt.save_async(state_of(ddp.module, optim, step), step)
    except Exception as err:
        if not (live.enabled() and live.peer_failed(err)):
            raise
        # A peer vanished mid-step: that step is dropped (its optimizer step never ran), and
        # the survivors re-form from what they hold.
        optim.zero_grad()
        print(f"rank {s.rank}: lost a peer at step {step}: {err}", flush=True)
        return step
    finally:
        if record:
            record.close()
    ckpt.save(state_of(ddp.module, optim, step), step, kind="final")
    if args.record:  # the tests compare the trained weights across ranks and runs
        weights = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
        (args.record / f"final-rank-{s.rank}.json").write_text(json.dumps(weights.tolist()))
    elastic.mark_done(step)
    dist.barrier()  # every rank exits only once the done marker is on record
    return None


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit as leave:  # (sys.exit with a message, or the library's exit 0)
        if isinstance(leave.code, str):
            print(leave.code, file=sys.stderr)
        code = leave.code if isinstance(leave.code, int) else int(leave.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without tearing the process group down, whatever ended the rank: gloo's teardown
    # can deadlock on the GIL with its own worker thread (pytorch/pytorch#75097), and a rank
    # that never exits stalls the generation (its stop waits out the grace period). The OS
    # frees the rest.
    os._exit(code)
