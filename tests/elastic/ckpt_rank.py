"""One rank of a checkpoint test: real gloo, real DCP through spotrain.elastic.checkpoint.

argv[1] is a JSON list of operations, run in order; each prints one JSON line:
    ["save", step, kind]   synchronous save of a model whose every value is `step`
    ["async", step]        asynchronous save of the same
    ["steps", n]           n training-like collectives (all_reduce), noting the marker's step
    ["load"]               load the newest complete checkpoint; the step and the model's values
    ["close"]              wait for the save in flight
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from spotrain import elastic
from spotrain.elastic import checkpoint


def model_state(model: nn.Module, step: int) -> dict:
    return {"model": model.state_dict(), "step": torch.tensor(step)}


def main() -> None:
    ops = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    s = elastic.settings()
    ckpt = checkpoint.Checkpointer()
    model = nn.Linear(64, 48)
    for op in ops:
        out: dict = {"op": op[0], "rank": s.rank}
        started = time.monotonic()
        if op[0] in ("save", "async"):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(op[1])
            if op[0] == "save":
                ckpt.save(model_state(model, op[1]), op[1], kind=op[2])
            else:
                ckpt.save_async(model_state(model, op[1]), op[1])
                out["in_flight"] = ckpt.pending is not None
        elif op[0] == "steps":
            markers = []
            for _ in range(op[1]):
                dist.all_reduce(torch.ones(4))
                latest = elastic.latest_checkpoint()
                markers.append(latest["step"] if latest else None)
                time.sleep(0.05)
            out["markers"] = markers
        elif op[0] == "load":
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(-1)
            state = model_state(model, 0)
            out["step"] = ckpt.load(state)
            values = {float(v) for t in state["model"].values() for v in t.flatten().tolist()}
            out["values"] = sorted(values)
            out["saved_step"] = int(state["step"])
        elif op[0] == "close":
            ckpt.close()
        out["blocked_s"] = time.monotonic() - started
        print(json.dumps(out), flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # as the example: gloo's teardown can hang (pytorch/pytorch#75097)


if __name__ == "__main__":
    main()
