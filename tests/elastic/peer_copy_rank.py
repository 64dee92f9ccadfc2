"""One rank of tests/elastic/test_peer_copy.py: the example's transformer
(examples/train_fsdp.py) as pure FSDP over gloo with a peer copy (spotrain.elastic.sharded), a
node lost, and the survivors' reshard to the next world size; every rank dumps its local
shards.

    python tests/elastic/peer_copy_rank.py SCENARIO_JSON ID

The scenario: "world", "stride" (processes per node), "steps" (full steps), "lost" (ids that
exit), "fail" and "partial" (one more step whose barrier passes on the ranks not in "fail":
the lost ones exit inside it, after the gradient exchange), "after" (the next generation's
members: old ids in new rank order), "port", "port2", "out". A rank dumps its shards as
`before-rank-R.pt` after the full steps (every rank) and `after-rank-R.pt` after the
reshard (or after all its steps when "after" is absent: a reference run).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

import train_fsdp as example  # noqa: E402

from spotrain import elastic  # noqa: E402
from spotrain.elastic import sharded  # noqa: E402

GLOBAL_BATCH = 12
SHAPE = (64, 2)  # the example's tiny transformer: dim 0 of 64 (or 192, 256) over 2-6 ranks


def enter(generation: int, rank: int, world: int, stride: int, port: int) -> elastic.Settings:
    """Join a generation's group as the runtime would start or place this process."""
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(stride),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SPOTRAIN_GENERATION": str(generation),
        }
    )
    elastic.settings.cache_clear()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return elastic.settings()


def forward_backward(model: torch.nn.Module, s: elastic.Settings, step: int, data) -> None:
    batch = s.batch_slice()
    idx = torch.arange(step * GLOBAL_BATCH + batch.start, step * GLOBAL_BATCH + batch.stop)
    sse = model(data[idx % len(data)])
    (sse * s.world_size / (GLOBAL_BATCH * example.SEQ)).backward()


def dump(name: str, model: torch.nn.Module, optim: torch.optim.Optimizer, out: Path) -> None:
    """This rank's local shards: parameters and optimizer state, by parameter index."""
    params = [p for g in optim.param_groups for p in g["params"]]
    local = {}
    for i, p in enumerate(params):
        local[f"{i}/param"] = p.to_local().detach().clone()
        for key, v in optim.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                local[f"{i}/{key}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    torch.save(local, out / f"{name}-rank-{dist.get_rank()}.pt")


def main() -> None:
    spec, me = json.loads(sys.argv[1]), int(sys.argv[2])
    out = Path(spec["out"])
    os.environ.update(
        {
            "SPOTRAIN_JOB": "peer",
            "SPOTRAIN_CHECKPOINT": f"file://{out}/store",
            "SPOTRAIN_TOTAL_STEPS": "100",
            "SPOTRAIN_GLOBAL_BATCH_SIZE": str(GLOBAL_BATCH),
            "SPOTRAIN_RESIZE": "live",
            "SPOTRAIN_PEER_COPY": "1",
        }
    )
    torch.set_num_threads(1)
    torch.manual_seed(0)
    full, data = example.Decoder(*SHAPE), example.dataset()
    s = enter(0, me, spec["world"], spec["stride"], spec["port"])
    mesh = sharded.full_mesh(s, "cpu")
    model, optim = example.build(mesh, SHAPE, torch.device("cpu"), full)
    step = sharded.sync(model, optim, 0, mesh)
    assert step == 0
    copy = sharded.peer_copy(model, optim)
    assert copy.active
    for _ in range(spec["steps"]):
        forward_backward(model, s, step, data)
        copy.step()
        optim.zero_grad()
        step += 1
    dump("before", model, optim, out)
    if me in spec["lost"] and not spec.get("partial"):
        os._exit(0)  # a node lost between steps
    if spec.get("partial"):  # one more step, cut short by the loss after the exchange
        forward_backward(model, s, step, data)

        def barrier(*args: object, **kwargs: object) -> None:
            if me in spec["lost"]:
                os._exit(0)
            if me in spec["fail"]:
                raise RuntimeError("Connection closed by peer (as when a peer dies)")

        real, dist.barrier = dist.barrier, barrier  # (the real one cannot pass: ranks gone)
        try:
            copy.step()
            step += 1
        except RuntimeError:
            pass
        dist.barrier = real
        optim.zero_grad()
    if "after" not in spec:
        dump("after", model, optim, out)
        os._exit(0)
    dist.destroy_process_group()
    dist.distributed_c10d._world.group_count = 0  # (as live.next_generation leaves it)
    s = enter(1, spec["after"].index(me), len(spec["after"]), spec["stride"], spec["port2"])
    mesh = sharded.full_mesh(s, "cpu")
    new_model, new_optim = example.build(mesh, SHAPE, torch.device("cpu"))
    sharded.carry(model, optim, new_model, new_optim)
    step = sharded.sync(new_model, new_optim, step, mesh)
    dump("after", new_model, new_optim, out)
    (out / f"step-rank-{s.rank}.json").write_text(json.dumps(step))
    copy = sharded.peer_copy(new_model, new_optim)  # and training goes on, copied again
    forward_backward(new_model, s, step, data)
    copy.step()
    os._exit(0)


if __name__ == "__main__":
    main()
