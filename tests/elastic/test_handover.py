"""Live resize's hand-over (spotrain.elastic.handover): tensors from the survivors at the newest
step into every other rank, with real gloo processes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from spotrain.elastic import handover
from spotrain.workers.embedded.stack import free_port
from tests.warm_python import WARM_PYTHON

pytest.importorskip("torch")

pytestmark = pytest.mark.usefixtures("warm_python_server")  # tests/warm_python.py

REPO = Path(__file__).resolve().parents[2]


def test_the_ranks_at_the_newest_step_give_and_the_rest_take() -> None:
    who = handover.roles([7, 8, -1, 8])
    assert (who.step, who.sources, who.takers) == (8, [1, 3], [0, 2])
    assert handover.roles([3, 3]).takers == []


def test_big_tensors_travel_alone_and_small_ones_are_packed_in_order() -> None:
    assert handover.buckets([10, 10, 100, 30, 30, 30, 5], 64) == [[0, 1], [2], [3, 4], [5, 6]]
    assert handover.buckets([], 64) == []
    assert handover.buckets([64, 63, 1], 64) == [[0], [1, 2]]


def test_buckets_are_striped_over_the_sources_in_turn() -> None:
    assert [handover.source_of(b, [1, 3]) for b in range(5)] == [1, 3, 1, 3, 1]
    assert [handover.source_of(b, [2]) for b in range(3)] == [2, 2, 2]


RANK = r"""
import json, os, sys, torch, torch.distributed as dist
from torch import nn
from spotrain.elastic import handover

steps = json.loads(sys.argv[1])
handover.BUCKET_BYTES = 4096  # many buckets: packed and whole ones, striped over the sources
dist.init_process_group("gloo")
rank = dist.get_rank()
# the sources hold one state (DDP replicas); every other rank starts from its own
torch.manual_seed(0 if steps[rank] == max(steps) else 100 + rank)
model = nn.Sequential(nn.Linear(40, 30), nn.BatchNorm1d(30), nn.Linear(30, 3))
model.half_scale = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))
optim = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
x = torch.randn(8, 40, generator=torch.Generator().manual_seed(7))
if steps[rank] >= 0:  # a survivor has trained (optimizer state, scheduler, running stats)
    for _ in range(steps[rank]):
        loss = model(x).pow(2).sum() + model.half_scale.float().sum()
        loss.backward(); optim.step(); optim.zero_grad(); sched.step()
step = handover.transfer(model, optim, steps, [sched])

def digest():
    flat = [t for t in model.state_dict().values()]
    for entry in optim.state_dict()["state"].values():
        flat += [v for v in entry.values() if isinstance(v, torch.Tensor)]
    return [float(t.double().sum()) for t in flat] + [sched.last_epoch, optim.param_groups[0]["lr"]]

before = digest()
loss = model(x).pow(2).sum() + model.half_scale.float().sum()
loss.backward(); optim.step()
after = [float(p.double().sum()) for p in model.parameters()]
moved = {"moved": handover.last.bytes, "sent": handover.last.sent}
print("RESULT " + json.dumps({"step": step, "state": before, "after": after, **moved}), flush=True)
os._exit(0)
"""


def run_ranks(steps: list[int]) -> list[dict]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [*WARM_PYTHON, "-c", RANK, json.dumps(steps)],
            env={
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(len(steps)),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(len(steps))
    ]
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert all("RESULT " in out for out in outputs), outputs
    return [json.loads(out.split("RESULT ", 1)[1].splitlines()[0]) for out in outputs]


def test_every_rank_ends_with_the_newest_state_striped_over_two_sources() -> None:
    """Two survivors at step 3 give; a survivor a step behind and a joiner take: model,
    buffers, Adam's state (a joiner has none yet), the scheduler, mixed dtypes, all equal,
    and the next optimizer step stays in lockstep."""
    results = run_ranks([3, 2, 3, -1])
    assert {r["step"] for r in results} == {3}
    assert all(r["state"] == results[0]["state"] for r in results), results
    assert all(r["after"] == results[0]["after"] for r in results)
    assert results[0]["moved"] > 0
    # striped: each source sent its share to both takers, the takers nothing
    sent = [r["sent"] for r in results]
    assert sent[0] > 0 and sent[2] > 0 and sent[1] == sent[3] == 0, sent
    assert sent[0] + sent[2] == 2 * results[0]["moved"]


def test_nothing_moves_when_every_rank_holds_the_same_step() -> None:
    results = run_ranks([5, 5])
    assert [r["step"] for r in results] == [5, 5]
    assert [r["moved"] for r in results] == [0, 0]
    assert results[0]["state"] == results[1]["state"]
