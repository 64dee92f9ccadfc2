"""The zero-change path for real: examples/train_torchrun.py (no spotrain import) as a
`type: command` job: the local runtime starts torchrun for each rank through
spotrain.elastic.torchrun, which turns the elastic event into the script's SIGTERM.
2 ranks, a reclaim with notice, 3 ranks, a node lost without notice, 1 rank to the end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from spotrain.activities.command_launch import launch_command
from spotrain.workflows.spec import parse_spec
from tests.elastic.integration_support import Scenario
from tests.warm_python import WARM_PYTHON

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_python_server")]  # (warm_python.py)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_torchrun.py"
STEPS, BATCH, EVERY = 80, 5, 10


def rows(record: Path, world: int) -> dict[int, list[dict]]:
    """rank -> the script's JSON lines at this world size."""
    return {
        int(f.stem.rsplit("-", 1)[1]): [json.loads(x) for x in f.read_text().splitlines()]
        for f in record.glob(f"world-{world}-rank-*.jsonl")
    }


def checkpoints(ckpt: Path) -> list[int]:
    return sorted(int(p.stem.removeprefix("step-")) for p in ckpt.glob("step-*.pt"))


def wait_until(sc: Scenario, p, what, timeout_s: float = 240):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (found := what()):
        assert sc.watch(p).outcome == "progress", sc.log(p)
        assert time.monotonic() < deadline, sc.log(p)
    return found


def test_launch_command_wraps_command_jobs_and_multi_process_pods(tmp_path: Path) -> None:
    sc = Scenario(tmp_path, "j", ["python", "train.py"], 10, 4, {}, job_type="command")
    sc.procs_per_node = 2
    p = sc.plan(0, nodes=2)
    node1 = launch_command(p, 1, "python")
    assert node1[:4] == ["python", "-m", "spotrain.elastic.torchrun", "node"]
    assert node1[4:] == ["--nnodes=2", "--node-rank=1", "--nproc-per-node=2", "--", *p.command]
    rank3 = launch_command(p, 1, "py", local_rank=1)
    assert rank3[4:7] == ["--nnodes=4", "--node-rank=3", "--nproc-per-node=1"]
    # A spotrain rank command: once per process (Kubernetes: one pod, the node's processes
    # through spotrain.elastic.procs, under the command's interpreter; locally each rank).
    pytorch = p.model_copy(update={"job_type": "pytorch"})
    procs = ["-m", "spotrain.elastic.procs", "--"]
    assert launch_command(pytorch, 1, None) == ["python", *procs, *p.command]
    assert launch_command(pytorch, 1, "py", local_rank=1) == ["py", "train.py"]
    one = pytorch.model_copy(
        update={"members": [m.model_copy(update={"procs": 1}) for m in p.members]}
    )
    assert launch_command(one, 1, None) == p.command
    assert launch_command(p, 1, "py", local_rank=1)[-2:] == ["py", "train.py"]


def job(tmp_path: Path, name: str, steps: int = STEPS) -> tuple[Scenario, Path, Path]:
    ckpt, record = tmp_path / "ckpt", tmp_path / "record"
    command = [*WARM_PYTHON, str(EXAMPLE), "--ckpt-dir", str(ckpt), "--record", str(record)]
    command += ["--steps", str(steps), "--batch", str(BATCH), "--ckpt-every", str(EVERY)]
    command += ["--step-time", "0.05"]
    tmp_path.mkdir(exist_ok=True)
    return Scenario(tmp_path, name, command, steps, BATCH, {}, job_type="command"), ckpt, record


def test_plain_torchrun_script_resumes_through_a_reclaim_and_a_loss(tmp_path: Path) -> None:
    sc, ckpt, record = job(tmp_path, "torchrun-integration")
    gen0 = sc.start(0, nodes=2)
    wait_until(sc, gen0, lambda: len(rows(record, 2).get(0, [])) >= 8)
    notice = sc.stop(gen0, graceful=True)  # control file -> command_node -> SIGTERM -> save
    assert notice.acked_ranks == [0, 1] and not notice.forced, sc.log(gen0)
    k = checkpoints(ckpt)[-1]
    assert k >= 8 and [r["step"] for r in rows(record, 2)[0]][-1] == k

    gen1 = sc.start(1, nodes=3)
    wait_until(sc, gen1, lambda: checkpoints(ckpt)[-1] > k)
    lost = sc.stop(gen1, graceful=False)  # SIGKILL: torchrun agents, and their workers with them
    assert lost.forced and lost.acked_ranks == []
    assert sc.leftovers() == []
    c = checkpoints(ckpt)[-1]
    assert c > k and c % EVERY == 0 and c < STEPS, (k, c)

    gen2 = sc.start(2, nodes=1)
    # Reference: the same script on one rank, never stopped, to a few steps past the loss.
    ref, _, ref_record = job(tmp_path / "ref", "torchrun-reference", steps=c + 5)
    ref_gen = ref.start(0, nodes=1)
    assert sc.run_to_end(gen2).exit_codes == {0: 0}
    assert ref.run_to_end(ref_gen).exit_codes == {0: 0}
    assert sc.leftovers() == [] and ref.leftovers() == []

    gens = {2: rows(record, 2), 3: rows(record, 3), 1: rows(record, 1)}
    steps = {w: [r["step"] for r in gens[w][0]] for w in gens}
    assert steps[2] == list(range(1, k + 1))
    assert steps[3] == list(range(k + 1, steps[3][-1] + 1)) and steps[3][-1] >= c
    assert steps[1] == list(range(c + 1, STEPS + 1))
    kept = {
        2: gens[2],
        1: gens[1],
        3: {r: [x for x in xs if x["step"] <= c] for r, xs in gens[3].items()},
    }
    # Every position of the sample stream once: none repeated or skipped across the resizes.
    positions = sorted(
        p
        for rs in kept.values()
        for xs in rs.values()
        for x in xs
        for p in range(x["first"], x["first"] + x["count"])
    )
    assert positions == list(range(STEPS * BATCH))
    assert {x["count"] for x in gens[3][0]} == {2} and {x["count"] for x in gens[3][2]} == {1}

    # The loss continues the curve: the same computation as the run never stopped (same samples,
    # global-mean gradients, optimizer state restored), up to float summation order.
    losses = [x["loss"] for w in (2, 3, 1) for x in kept[w][0]]
    ref_losses = [x["loss"] for x in rows(ref_record, 1)[0]]
    assert losses[: c + 5] == pytest.approx(ref_losses, rel=1e-3)
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])


@pytest.mark.parametrize(
    ("spec", "script"),
    [
        ("job_hf.yaml", "train_hf.py"),
        ("job_lightning.yaml", "train_lightning.py"),
        ("job_torchrun.yaml", "train_torchrun.py"),
        ("job_fsdp.yaml", "train_fsdp.py"),
    ],
)
def test_example_job_specs_validate_and_run_their_scripts(spec: str, script: str) -> None:
    job_spec = parse_spec(yaml.safe_load((EXAMPLE.parent / spec).read_text()))
    assert job_spec.command[1] == f"examples/{script}"
    assert (EXAMPLE.parent / script).exists()
