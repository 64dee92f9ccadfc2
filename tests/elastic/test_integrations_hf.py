"""The Hugging Face Trainer integration for real: examples/train_hf.py (a tiny GPT-2 from its
config) on 2 ranks, resized to 3 by a reclaim with notice, then a node lost without notice,
then back to 2 ranks to the end: every process a real rank of the local runtime (gloo, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.elastic.integration_support import Scenario
from tests.warm_python import WARM_PYTHON

pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_python_server")]  # (warm_python.py)

MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_hf.py"
TOTAL, GLOBAL = 60, 5  # 5 splits unevenly: 2 + 3 over two ranks, 1 + 2 + 2 over three
PACE = ["--step-time", "0.05"]  # the notice lands within a few steps, not dozens
SCALE = {  # learning rate per world size; a constant schedule so the logged rate shows it
    2: {"lr": 1e-2, "lr_scheduler_type": "constant", "save_steps": 10},
    3: {"lr": 5e-3, "lr_scheduler_type": "constant", "save_steps": 10},
}


def window(losses: dict[int, float], first: int) -> float:
    return sum(losses[s] for s in range(first, first + 4)) / 4


def test_trainer_resumes_through_a_reclaim_and_a_loss_without_repeating_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlruns = f"file://{tmp_path}/mlruns"  # MLflow's local file store
    sc = Scenario(
        tmp_path,
        "hf-integration",
        [*WARM_PYTHON, str(EXAMPLE), "--record", str(tmp_path / "record"), *PACE],
        total_steps=TOTAL,
        global_batch_size=GLOBAL,
        scale_config=SCALE,
        env={"MLFLOW_TRACKING_URI": mlruns, "MLFLOW_ALLOW_FILE_STORE": "true"},
    )
    k, c = sc.reclaim_then_loss(first_step=10, every=10)
    kept = sc.kept_records(k, c)
    rec = {g: sc.records(g) for g in kept}

    # scale_config's learning rate per world size, also after resuming a checkpoint saved at
    # another size (whose optimizer and schedule carried the old rate).
    lrs = {g: {e["lr"] for e in rec[g][0]} for g in rec}
    assert lrs == {0: {1e-2}, 1: {5e-3}, 2: {1e-2}}

    # The loss continues its curve across both resumes (a restart from scratch would be back
    # near the first window's level).
    losses = {e["step"]: e["loss"] for g in kept for e in kept[g][0]}
    first = window(losses, 1)
    for resumed_at in (k, c):
        before, after = window(losses, resumed_at - 3), window(losses, resumed_at + 1)
        assert after < 0.9 * first and after < 1.15 * before, (first, before, after, resumed_at)
    assert window(losses, TOTAL - 3) < 0.8 * first

    # MLflow: one run for the job, with the loop's metrics and the scaling events.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(mlruns)
    (run,) = client.search_runs([client.get_experiment_by_name("spotrain").experiment_id])
    assert run.data.tags["spotrain.job"] == "hf-integration"

    def history(key: str) -> dict[int, float]:  # step -> value; a lost step's rerun wins
        logged = client.get_metric_history(run.info.run_id, key)
        return {m.step: m.value for m in sorted(logged, key=lambda m: m.timestamp)}

    assert history("loss") == pytest.approx(losses)
    rates = history("samples_per_second")
    assert set(rates) == set(range(1, TOTAL + 1)) and min(rates.values()) > 0
    world = history("world_size")
    assert [world[s] for s in (1, k, k + 1, c, c + 1, TOTAL)] == [2, 2, 3, 3, 2, 2]
    assert history("learning_rate")[k + 1] == pytest.approx(5e-3)
    gens = {
        int(key.rsplit(".", 1)[1]): json.loads(value)
        for key, value in run.data.tags.items()
        if key.startswith("spotrain.generation.")
    }
    assert gens == {
        0: {"world_size": 2, "start_step": 0, "end_step": k, "end": "elastic event"},
        1: {"world_size": 3, "start_step": k, "end": "lost without notice", "resumed_at": c},
        2: {"world_size": 2, "start_step": c, "end_step": TOTAL, "end": "done"},
    }
    scaling = client.get_metric_history(run.info.run_id, "spotrain.world_size")
    in_order = [(m.step, m.value) for m in sorted(scaling, key=lambda m: (m.timestamp, m.step))]
    assert in_order == [(0, 2), (k, 2), (k, 3), (c, 2), (TOTAL, 2)]  # starts and ends
