"""The sharded example, for real: FSDP2 as HSDP (examples/train_fsdp.py: a decoder-only
transformer, gloo on CPU), two processes per node on the local runtime. Resized by restart
(DCP reshards between meshes) and live (survivors keep their shards, a joining node takes
each shard from a survivor holding the same one, a node lost without notice costs at most
the step in flight); and pure FSDP with a peer copy (every resize reshards in memory, a lost
node's shards come from its ring neighbour's copy); every run ends with the weights of an
uninterrupted one."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from temporalio.testing import ActivityEnvironment

from spotrain.activities.local import LocalRuntime
from spotrain.elastic.job_store import JobStore
from spotrain.workflows.contract import GenerationPlan, Member
from tests.conftest import kill_local_ranks
from tests.elastic.test_live_resize import consumed, pids, through_held
from tests.elastic.test_train_ddp import plan as ddp_plan
from tests.elastic.test_train_ddp import records, run_to_end, stop_generation, watch

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_python_server")]  # (warm_python.py)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_fsdp.py"
TOTAL_STEPS = 60
GLOBAL_BATCH = 26  # uneven over 4 and 6 ranks
PROCS = 2  # per node: the shard group


def plan(
    tmp_path: Path,
    generation: int,
    nodes: list[int] | list[str],
    job: str = "fsdp",
    live: bool = False,
    total_steps: int = TOTAL_STEPS,
    peer_copy: bool = False,
) -> GenerationPlan:
    """The DDP example's plan (tests/elastic/test_train_ddp.py) for this one: nodes by index
    (node-<i>, local) or by instance id (Kubernetes), each of PROCS processes. `peer_copy`:
    pure FSDP (`--full-shard`) with `elastic.peer_copy`."""
    p = ddp_plan(
        tmp_path,
        generation,
        len(nodes),
        job,
        total_steps,
        ckpt_every=1000,
        example=EXAMPLE,
        step_time="0.05",
    )
    if peer_copy:
        p.command.append("--full-shard")
        p.peer_copy = True
    p.members = [
        Member(node_id=n if isinstance(n, str) else f"node-{n}", address="127.0.0.1", procs=PROCS)
        for n in nodes
    ]
    p.scale_config["lr"] = 3e-3
    p.global_batch_size = GLOBAL_BATCH
    return p.model_copy(update={"resize": "live", "collective_timeout_s": 10.0}) if live else p


def run_until(env: ActivityEnvironment, rt: LocalRuntime, p: GenerationPlan, step: int) -> int:
    deadline = time.monotonic() + 120
    while (result := watch(env, rt, p)).outcome == "progress" and (result.step or 0) < step:
        assert time.monotonic() < deadline, f"generation {p.generation} made no progress"
    assert result.outcome == "progress", (result, rt.log_path(p.job, 0, p.generation).read_text())
    return result.step or 0


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Two nodes, never resized: the weights every resized run must end with. One run serves
    the module's tests (four more torch ranks per test otherwise); its folder."""
    tmp = tmp_path_factory.mktemp("fsdp-reference")
    env, rt = ActivityEnvironment(), LocalRuntime(tmp / "rt")
    ref = plan(tmp, 0, [0, 1], job="ref")
    try:
        env.run(rt.start_generation, ref)
        run_to_end(env, rt, ref)
        yield tmp / "ref"
    finally:
        kill_local_ranks(tmp)


def assert_same_weights(resized: Path, uninterrupted: Path) -> None:
    """Every rank's gathered weights after the last step equal an uninterrupted run's within
    1e-4 of their norm: float summation order differs between meshes, and Adam lifts that
    noise in a few elements above an element-wise tolerance; one step more or less, or an
    optimizer state lost, is about 1e-2."""
    want = torch.tensor(json.loads((uninterrupted / "final-rank-0.json").read_text()))
    ranks = sorted(resized.glob("final-rank-*.json"))
    assert len(ranks) == 2 * PROCS and want.numel() > 0
    for f in ranks:  # every rank of the last generation: joiners as well as survivors
        got = torch.tensor(json.loads(f.read_text()))
        off = ((got - want).norm() / want.norm()).item()
        assert off < 1e-4, (f.name, off)


def first_steps(rec: dict[int, list[dict]]) -> list[int]:
    return [e["step"] for e in rec[0]]


def lose_node_0(
    env: ActivityEnvironment, rt: LocalRuntime, p: GenerationPlan, tmp_path: Path
) -> int:
    """Node-0 of a live 3-node generation lost without notice: the other four ranks park
    having lost at most the step in flight; the step they hold."""
    assert rt.kill_node("fsdp", "node-0") == [0, 1]
    lost = stop_generation(
        env, rt, p, graceful=False, grace_s=20, live=True, lost_node_ids=["node-0"]
    )
    held = lost.held_step
    assert lost.acked_ranks == [2, 3, 4, 5] and held is not None
    reached = max(
        e["step"] for entries in records(tmp_path, p.generation, "fsdp").values() for e in entries
    )
    assert reached - held <= 1, (reached, held)
    return held


def assert_ended_live(
    tmp_path: Path, rt: LocalRuntime, last: GenerationPlan, s0: int, held: int, ref: Path
) -> None:
    """Three live generations (growth parked at `s0`, a loss at `held`, then `last`): every
    sample consumed once, nothing loaded from disk, an uninterrupted run's weights, no rank
    left running."""
    rec = [records(tmp_path, g, "fsdp") for g in range(3)]
    rec1 = through_held(rec[1], held, GLOBAL_BATCH)
    assert consumed([(rec[0], s0), (rec1, held), (rec[2], TOTAL_STEPS)]) == list(
        range(TOTAL_STEPS * GLOBAL_BATCH)
    )
    store = JobStore(last.checkpoint)
    assert store.loaded_step(1) is None and store.loaded_step(2) is None  # nothing from disk
    assert_same_weights(tmp_path / "fsdp", ref)
    assert not any(r.alive() for g in range(3) for r in rt._ranks("fsdp", g))


def test_restart_resizes_reshard_through_checkpoints(tmp_path: Path, uninterrupted: Path) -> None:
    """2 -> 3 -> 2 nodes (4 -> 6 -> 4 ranks) by restart: each generation loads the last one's
    checkpoint onto its own mesh, and ends where an uninterrupted run does."""
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt")
    stops, gens = [], [plan(tmp_path, 0, [0, 1])]
    for g, nodes in enumerate(([0, 1, 2], [1, 2]), start=1):
        env.run(rt.start_generation, gens[-1])
        run_until(env, rt, gens[-1], 12 * g)
        stop = stop_generation(env, rt, gens[-1], graceful=True, grace_s=60)
        assert stop.checkpoint_step is not None and not stop.forced
        stops.append(stop.checkpoint_step)
        gens.append(plan(tmp_path, g, nodes))
    env.run(rt.start_generation, gens[-1])
    assert run_to_end(env, rt, gens[-1]).exit_codes == dict.fromkeys(range(2 * PROCS), 0)

    rec = [records(tmp_path, g, "fsdp") for g in range(3)]
    assert first_steps(rec[1]) == list(range(stops[0] + 1, stops[1] + 1))
    assert {e["world"] for e in rec[1][5]} == {6}
    assert consumed([(rec[0], stops[0]), (rec[1], stops[1]), (rec[2], TOTAL_STEPS)]) == list(
        range(TOTAL_STEPS * GLOBAL_BATCH)
    )
    store = JobStore(gens[-1].checkpoint)
    assert store.loaded_step(1) == stops[0] and store.loaded_step(2) == stops[1]
    assert_same_weights(tmp_path / "fsdp", uninterrupted)


def test_live_growth_and_a_replica_lost_without_notice(tmp_path: Path, uninterrupted: Path) -> None:
    """Live: a third node joins and takes its shards from the survivors; then a node is lost
    without notice and the other two go on from memory, having lost at most the step in
    flight. Nothing is read from disk; the weights end as an uninterrupted run's."""
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt")
    gen0 = plan(tmp_path, 0, [0, 1], live=True)
    env.run(rt.start_generation, gen0)
    run_until(env, rt, gen0, 10)

    grow = stop_generation(env, rt, gen0, graceful=True, grace_s=60, live=True)
    s0 = grow.held_step
    assert s0 is not None and grow.checkpoint_step is None
    gen1 = plan(tmp_path, 1, [0, 1, 2], live=True)
    env.run(rt.start_generation, gen1)
    assert [pids(rt, 1, "fsdp")[r] for r in range(4)] == [pids(rt, 0, "fsdp")[r] for r in range(4)]
    run_until(env, rt, gen1, s0 + 10)

    # node-0 lost: node-1's processes, ranks 2, 3 of a 2 x 2 mesh in generation 0, become
    # ranks 0, 1 of an equal one (sharded._forget_meshes)
    held = lose_node_0(env, rt, gen1, tmp_path)
    gen2 = plan(tmp_path, 2, [1, 2], live=True)
    env.run(rt.start_generation, gen2)
    assert pids(rt, 2, "fsdp")[0] == pids(rt, 1, "fsdp")[2]  # node-1's processes, renumbered
    assert run_to_end(env, rt, gen2).exit_codes == dict.fromkeys(range(2 * PROCS), 0)

    rec = [records(tmp_path, g, "fsdp") for g in range(3)]
    assert first_steps(rec[1])[0] == s0 + 1 and first_steps(rec[2])[0] == held + 1
    assert_ended_live(tmp_path, rt, gen2, s0, held, uninterrupted)


def test_pure_fsdp_reshards_live_and_a_lost_node_comes_back_from_its_peer_copy(
    tmp_path: Path, uninterrupted: Path
) -> None:
    """Pure FSDP (one shard per rank, no replica) with `elastic.peer_copy`: a third node joins
    (4 -> 6 ranks: every shard cut anew, in memory); then node-0 is lost without notice, and
    its shards come from the copy node-2 (the joiner) kept of them, stepped with node-0's
    gradients: the 4 survivors reshard 6 -> 4 and go on, at most the step in flight lost.
    Nothing is read from disk; the weights end as an uninterrupted run's."""
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt")
    gen0 = plan(tmp_path, 0, [0, 1], live=True, peer_copy=True)
    env.run(rt.start_generation, gen0)
    run_until(env, rt, gen0, 10)

    grow = stop_generation(env, rt, gen0, graceful=True, grace_s=60, live=True)
    s0 = grow.held_step
    assert s0 is not None and grow.checkpoint_step is None
    gen1 = plan(tmp_path, 1, [0, 1, 2], live=True, peer_copy=True)
    env.run(rt.start_generation, gen1)
    run_until(env, rt, gen1, s0 + 10)

    held = lose_node_0(env, rt, gen1, tmp_path)
    gen2 = plan(tmp_path, 2, [1, 2], live=True, peer_copy=True)
    env.run(rt.start_generation, gen2)
    assert run_to_end(env, rt, gen2).exit_codes == dict.fromkeys(range(2 * PROCS), 0)

    resharded = [
        json.loads((tmp_path / "fsdp" / f"gen-{g}-reshard.json").read_text()) for g in (1, 2)
    ]
    assert resharded[0]["from_copy"] == 0 and resharded[1]["from_copy"] == PROCS  # node-0's
    rec = [records(tmp_path, g, "fsdp") for g in range(3)]
    assert first_steps(rec[1])[0] == s0 + 1 and first_steps(rec[2])[0] == held + 1
    assert {e["world"] for e in rec[2][0]} == {4} and all(e["copy_s"] > 0 for e in rec[2][0])
    assert_ended_live(tmp_path, rt, gen2, s0, held, uninterrupted)
