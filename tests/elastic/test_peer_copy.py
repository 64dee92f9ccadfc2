"""Pure FSDP's in-memory resize (spotrain.elastic.sharded): the reshard's plan, FSDP2's rows,
and real gloo processes (tests/elastic/peer_copy_rank.py) that lose a node and rebuild its
shards from the peer copy its ring neighbour kept: bit for bit the state an uninterrupted run
holds."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from spotrain import elastic
from spotrain.elastic import environment
from spotrain.elastic.sharded import Held, plan, rows
from spotrain.workers.embedded.stack import free_port
from spotrain.workflows.contract import Member
from spotrain.workflows.job import job_planner
from spotrain.workflows.job.state import JobState
from spotrain.workflows.spec import parse_spec
from tests.jobs import job_spec
from tests.warm_python import WARM_PYTHON

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_python_server")]  # (warm_python.py)

torch = pytest.importorskip("torch")

RANK = Path(__file__).resolve().parent / "peer_copy_rank.py"


@pytest.mark.parametrize("length", [1, 5, 64, 65, 192])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6, 7])
def test_rows_are_fsdp2s_cut(length: int, world: int) -> None:
    chunks = list(torch.arange(length).chunk(world))
    chunks += [torch.arange(0)] * (world - len(chunks))
    for rank, chunk in enumerate(chunks):
        assert list(rows(length, world, rank)) == chunk.tolist()


def test_elastic_peer_copy_reaches_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The spec's `elastic.peer_copy` (live only) -> the generation's plan -> each rank's
    environment -> `Settings.peer_copy`, which `sharded.peer_copy` reads."""
    s = JobState.new(parse_spec(job_spec(elastic={"resize": "live", "peer_copy": True})))
    p = job_planner.generation_plan(s)
    assert p.peer_copy
    p.members = [Member(node_id="i-0", address="10.0.0.1", procs=2)]
    env = environment.rank_env(p, 0, 1, master_port=29500, control_file="")
    assert env[environment.PEER_COPY] == "1"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    elastic.settings.cache_clear()
    try:
        assert elastic.settings().peer_copy
    finally:
        elastic.settings.cache_clear()
    off = p.model_copy(update={"peer_copy": False})
    assert environment.PEER_COPY not in environment.rank_env(
        off, 0, 0, master_port=1, control_file=""
    )


def held(rank: int, step: int = 7, **kw: object) -> Held:
    return Held(generation=1, rank=rank, world=6, stride=2, step=step, copy=True, **kw)


def test_a_lost_nodes_shards_come_from_the_node_behind_it_on_the_ring() -> None:
    """6 ranks, 2 a node: node 1 (ranks 2, 3) lost; node 0 (ranks 0, 1) kept their copy."""
    how = plan([held(0), held(1), held(4), held(5)], 4)
    assert how is not None and how.step == 7 and how.finish == [] and not how.in_place
    assert how.sources == [(0, False), (1, False), (0, True), (1, True), (2, False), (3, False)]
    # node 0 lost: node 2 (ranks 4, 5, new ranks 2, 3) kept its copy; a joiner takes nothing
    how = plan([held(2), held(3), held(4), held(5), None, None], 6)
    assert how is not None and how.sources[:2] == [(2, True), (3, True)]


def test_no_plan_when_a_shard_is_in_no_ones_memory() -> None:
    assert plan([held(0), held(1)], 2) is None  # nodes 1 and 2 lost: node 1's copy went too
    nocopy = [Held(1, r, 6, 2, 7) for r in (0, 1, 4, 5)]
    assert plan(nocopy, 4) is None  # no peer copy: node 1's shards are gone
    assert plan([*[Held(1, r, 6, 2, 7) for r in range(6)], None, None], 8) is not None  # growth
    mixed = [held(0), held(1), held(4), Held(0, 5, 4, 2, 7, copy=True)]
    assert plan(mixed, 4) is None  # survivors of two layouts (a resize cut short)
    assert plan([None, None], 2) is None


def test_a_survivor_a_step_behind_takes_the_step_only_with_its_gradients_in_hand() -> None:
    how = plan([held(0, 8), held(1, 8), held(4, 7, pending=True), held(5, 7, pending=True)], 4)
    assert how is not None and how.step == 8 and how.finish == [2, 3]
    assert plan([held(0, 8), held(1, 8), held(4, 7), held(5, 7, pending=True)], 4) is None
    assert plan([held(0, 9), held(1, 9), held(4, 7, pending=True), held(5, 9)], 4) is None
    # nobody stepped: gradients some ranks hold are dropped
    how = plan([held(0, 7, pending=True), held(1, 7), held(4, 7), held(5, 7)], 4)
    assert how is not None and how.step == 7 and how.finish == []


def test_in_place_only_when_every_rank_holds_its_own_shard_of_this_mesh() -> None:
    fresh = [Held(2, r, 4, 2, 0, current=True) for r in range(4)]
    assert plan(fresh, 4).in_place  # type: ignore[union-attr]
    rebuilt = [Held(2, r, 4, 2, 5) for r in range(4)]  # the same layout, a new model
    assert not plan(rebuilt, 4).in_place  # type: ignore[union-attr]


def run(*runs: tuple[dict, list[int], Path]) -> list[str]:
    """Every run's ranks (scenario, process ids, output folder) at once."""
    procs = []
    for scenario, ids, out in runs:
        out.mkdir(parents=True, exist_ok=True)
        scenario = {**scenario, "out": str(out), "port": free_port(), "port2": free_port()}
        procs += [
            subprocess.Popen(
                [*WARM_PYTHON, str(RANK), json.dumps(scenario), str(i)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for i in ids
        ]
    try:
        outputs = [p.communicate(timeout=480)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


def assembled(out: Path, name: str) -> dict[str, torch.Tensor]:
    """Every tensor whole: the ranks' local shards along dim 0 in rank order (a scalar such
    as Adam's step: the same on every rank)."""
    ranks = [torch.load(f) for f in sorted(out.glob(f"{name}-rank-*.pt"), key=_rank)]
    whole = {}
    for key in ranks[0]:
        parts = [r[key] for r in ranks]
        if parts[0].dim() == 0:
            assert all(torch.equal(p, parts[0]) for p in parts), key
            whole[key] = parts[0]
        else:
            whole[key] = torch.cat(parts)
    return whole


def _rank(path: Path) -> int:
    return int(path.stem.rsplit("-", 1)[1])


def assert_equal_states(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    off = [k for k in want if not torch.equal(got[k], want[k])]
    assert not off, f"{len(off)} of {len(want)} tensors differ, first {off[:3]}"


@pytest.mark.timeout(600)  # (6 processes starting torch: minutes on a loaded 2-core machine)
def test_a_node_lost_between_steps_is_rebuilt_from_its_peer_copy_bit_for_bit(
    tmp_path: Path,
) -> None:
    """3 nodes of 2 ranks, 3 steps; node 1 lost; the 4 survivors reshard 6 -> 4 in memory:
    model and Adam state equal the 6 ranks' before the loss exactly (node 1's rows from the
    copy node 0 kept, stepped with node 1's gradients), and training goes on."""
    scenario = {"world": 6, "stride": 2, "steps": 3, "lost": [2, 3], "after": [0, 1, 4, 5]}
    run((scenario, list(range(6)), tmp_path))
    before, after = assembled(tmp_path, "before"), assembled(tmp_path, "after")
    assert len(list(tmp_path.glob("after-rank-*.pt"))) == 4
    assert any(k.endswith("exp_avg") for k in after)
    assert_equal_states(after, before)
    assert all(json.loads(f.read_text()) == 3 for f in tmp_path.glob("step-rank-*.json"))


@pytest.mark.timeout(600)
def test_a_survivor_whose_barrier_failed_takes_the_step_its_peers_took(tmp_path: Path) -> None:
    """3 nodes of 1 rank; in step 3 every rank exchanged its gradients, then rank 1 died:
    rank 2 passed the barrier and stepped, rank 0 (which keeps rank 1's copy) failed in it.
    In the reshard 3 -> 2, rank 0 takes step 3 on its shards and on rank 1's copy: the state
    equals an uninterrupted run's after 3 steps, exactly."""
    scenario = {"world": 3, "stride": 1, "steps": 2, "lost": [1], "partial": True, "fail": [0]}
    run(
        ({**scenario, "after": [0, 2]}, [0, 1, 2], tmp_path / "lost"),
        ({"world": 3, "stride": 1, "steps": 3, "lost": []}, [0, 1, 2], tmp_path / "ref"),
    )
    got, want = assembled(tmp_path / "lost", "after"), assembled(tmp_path / "ref", "after")
    assert_equal_states(got, want)
    assert all(json.loads(f.read_text()) == 3 for f in (tmp_path / "lost").glob("step-*.json"))


MESH_AGAIN = r"""
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from spotrain.elastic import sharded

forget = sys.argv[1] == "forget"
meshes = []
for port in sys.argv[2:]:  # two generations of one process, each a group of its own
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    if forget:
        sharded._forget_meshes()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    out = torch.empty_like(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
    meshes.append(out.device_mesh is mesh)
    dist.destroy_process_group()
print("RESULT", meshes[-1], flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("forget", [True, False])
def test_a_new_generations_mesh_is_not_an_old_one_from_dtensors_caches(forget: bool) -> None:
    """A DeviceMesh equals an older one of the same shape and names, and DTensor's sharding
    caches hand back the older: its coordinate and groups from another generation. The
    meshes sharded.py builds forget them first."""
    how = "forget" if forget else "keep"
    out = subprocess.run(
        [*WARM_PYTHON, "-c", MESH_AGAIN, how, str(free_port()), str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert f"RESULT {forget}" in out, out
