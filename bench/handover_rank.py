"""One rank of bench/handover.py (run by it: `python -m bench.handover_rank ARGS_JSON`): S
survivors and one joiner (the last rank); rank 0 prints its measurements as `RESULT {json}`."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from spotrain.elastic import handover

WIDTH = 4096
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """RSS above its value on entry, sampled every 2 ms while inside."""

    def __enter__(self) -> Peak:
        self.base, self.peak, self.on = rss(), 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.on:
            self.peak = max(self.peak, rss())
            time.sleep(0.002)

    def __exit__(self, *_: object) -> None:
        self.on = False
        self.thread.join()
        self.peak = max(self.peak, rss()) - self.base


def state(model: nn.Module, optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor of the state: parameters and their momentum."""
    momentum = [optim.state[p]["momentum_buffer"] for p in model.parameters()]
    return list(model.state_dict().values()) + momentum


def main() -> None:
    params_m, survivors, repeats, pickled = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    joiner = world - 1
    torch.set_num_threads(1)
    layers = max(1, round(params_m * 1e6 / (WIDTH * WIDTH)))
    torch.manual_seed(0 if rank != joiner else 1)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optim = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.randn_like(p) if rank != joiner else torch.zeros_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    state_bytes = sum(t.numel() * t.element_size() for t in state(model, optim))

    def scramble() -> None:  # the joiner's state differs before each measurement
        dist.barrier()
        if rank == joiner:
            with torch.no_grad():
                for t in state(model, optim):
                    t.normal_()
        dist.barrier()

    out: list[dict[str, Any]] = []
    for _ in range(repeats):
        scramble()
        t0 = time.monotonic()
        for t in state(model, optim):
            dist.broadcast(t, src=0)
        row = {"raw": time.monotonic() - t0}
        scramble()
        with Peak() as peak:
            t0 = time.monotonic()
            handover.transfer(model, optim, [10] * survivors + [-1])
            row["handover"] = time.monotonic() - t0
            dist.barrier()
        row["rss"] = peak.peak
        sums = [0.0] * world
        digest = torch.stack([t.double().sum() for t in state(model, optim)]).sum().item()
        dist.all_gather_object(sums, digest)
        assert len(set(sums)) == 1, f"the joiner's state differs: {sums}"
        if pickled:  # what live.sync did before: one pickled object
            scramble()
            t0 = time.monotonic()
            sd = {"model": model.state_dict(), "optim": optim.state_dict()}
            payload = [sd if rank == 0 else None]
            dist.broadcast_object_list(payload, src=0)
            if rank != 0:
                model.load_state_dict(payload[0]["model"])
                optim.load_state_dict(payload[0]["optim"])
            del payload, sd
            row["pickled"] = time.monotonic() - t0
        out.append(row)
    if rank == 0:
        print("RESULT " + json.dumps({"state_bytes": state_bytes, "rows": out}), flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # (gloo's teardown can hang: see examples/train_ddp.py)
