"""The Lightning integration for real: examples/train_lightning.py on 2 ranks (DDP, gloo),
resized to 3 by a reclaim with notice, then a node lost without notice, then 2 ranks to the
end, on the local runtime."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.elastic.integration_support import Scenario
from tests.warm_python import WARM_PYTHON

pytest.importorskip("lightning")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("warm_python_server")]  # (warm_python.py)

MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lightning.py"
TOTAL, GLOBAL = 60, 5
SCALE = {2: {"lr": 0.02, "ckpt_every": 10}, 3: {"lr": 0.01, "ckpt_every": 10}}


def test_lightning_resumes_through_a_reclaim_and_a_loss_without_repeating_samples(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mlruns = f"file://{tmp_path}/mlruns"
    command = [*WARM_PYTHON, str(EXAMPLE), "--record", str(tmp_path / "record")]
    sc = Scenario(
        tmp_path,
        "lightning-integration",
        [*command, "--step-time", "0.05"],
        total_steps=TOTAL,
        global_batch_size=GLOBAL,
        scale_config=SCALE,
        env={"MLFLOW_TRACKING_URI": mlruns, "MLFLOW_ALLOW_FILE_STORE": "true"},
    )
    k, c = sc.reclaim_then_loss(first_step=8, every=10)
    kept = sc.kept_records(k, c)
    rec = {g: sc.records(g) for g in kept}
    # scale_config's rate per world size, also right after resuming another size's optimizer.
    assert {g: {e["lr"] for e in rec[g][0]} for g in rec} == {0: {0.02}, 1: {0.01}, 2: {0.02}}

    # The loss continues its curve: each resume starts far below where training began (a
    # restart from the initial weights would be back there; per-step noise at a global batch
    # of 5 is too large to compare neighbouring windows).
    losses = {e["step"]: e["loss"] for g in kept for e in kept[g][0]}

    def mean(first_step: int) -> float:
        return sum(losses[s] for s in range(first_step, first_step + 8)) / 8

    for resumed_at in (k, c):
        assert mean(resumed_at + 1) < 0.6 * mean(1), (mean(1), mean(resumed_at + 1), resumed_at)
    assert mean(TOTAL - 7) < 0.4 * mean(1)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(mlruns)
    (run,) = client.search_runs([client.get_experiment_by_name("spotrain").experiment_id])
    history = sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.timestamp)
    logged = {m.step: m.value for m in history}  # a lost step's rerun wins
    assert logged == pytest.approx(losses, rel=1e-5)
    assert '"end": "lost without notice"' in run.data.tags["spotrain.generation.1"]
