"""MLflow forwarding in-process, against MLflow's local file store: one run per job found
again by a later generation, nothing without a tracking location or off rank 0, and a broken
tracking location that turns tracking off instead of failing training."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotrain import elastic
from spotrain.elastic import mlflow_metrics

MlflowClient = pytest.importorskip("mlflow.tracking").MlflowClient


@pytest.fixture
def generation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """Set up a rank's environment; calling it again starts another generation."""

    def start(gen: int, rank: int = 0, world: int = 2, uri: str | None = None) -> None:
        env = {"SPOTRAIN_JOB": "metrics-job", "SPOTRAIN_GENERATION": str(gen), "RANK": str(rank)}
        env |= {"WORLD_SIZE": str(world), "SPOTRAIN_TOTAL_STEPS": "100"}
        env["SPOTRAIN_CHECKPOINT"] = f"file://{tmp_path}/store"
        env["MLFLOW_TRACKING_URI"] = uri or f"file://{tmp_path}/mlruns"
        env["MLFLOW_ALLOW_FILE_STORE"] = "true"
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        elastic.settings.cache_clear()
        mlflow_metrics.tracker.cache_clear()
        monkeypatch.setattr(mlflow_metrics, "_failed", False)

    yield start
    elastic.settings.cache_clear()
    mlflow_metrics.tracker.cache_clear()


def test_generations_share_one_run_with_their_scaling_events(generation, tmp_path: Path) -> None:
    generation(0, world=2)
    mlflow_metrics.generation_started(0)
    mlflow_metrics.log_metrics(1, loss=2.0, learning_rate=0.1, samples_per_second=None)
    mlflow_metrics.generation_ended(5, "elastic event")
    generation(1, world=4)
    mlflow_metrics.generation_started(5)
    mlflow_metrics.log_metrics(6, loss=1.5)
    generation(2, world=3)  # generation 1 was lost: it never logged an end
    mlflow_metrics.generation_started(4)
    generation(2, rank=1, world=3)
    mlflow_metrics.log_metrics(7, loss=99.0)  # not rank 0: nothing

    client = MlflowClient(f"file://{tmp_path}/mlruns")
    (run,) = client.search_runs([client.get_experiment_by_name("spotrain").experiment_id])
    history = {k: client.get_metric_history(run.info.run_id, k) for k in ("loss", "world_size")}
    assert [(m.step, m.value) for m in history["loss"]] == [(1, 2.0), (6, 1.5)]
    assert [(m.step, m.value) for m in history["world_size"]] == [(1, 2), (6, 4)]
    assert "samples_per_second" not in run.data.metrics
    tags = {k: json.loads(v) for k, v in run.data.tags.items() if k.startswith("spotrain.gen")}
    assert tags == {
        "spotrain.generation.0": {
            "world_size": 2,
            "start_step": 0,
            "end_step": 5,
            "end": "elastic event",
        },
        "spotrain.generation.1": {
            "world_size": 4,
            "start_step": 5,
            "end": "lost without notice",
            "resumed_at": 4,
        },
        "spotrain.generation.2": {"world_size": 3, "start_step": 4},
    }


def test_no_tracking_location_means_no_mlflow(generation, monkeypatch) -> None:
    generation(0)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert mlflow_metrics.tracker() is None
    mlflow_metrics.log_metrics(1, loss=1.0)  # a no-op


def test_a_broken_tracking_location_turns_tracking_off(generation, tmp_path, capsys) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's directory should be")
    generation(0, uri=f"file://{blocker}/mlruns")
    mlflow_metrics.log_metrics(1, loss=1.0)
    mlflow_metrics.log_metrics(2, loss=1.0)
    err = capsys.readouterr().err
    assert err.count("MLflow tracking off") == 1, err
    assert mlflow_metrics._failed
    assert sys.modules.get("mlflow") is not None  # it did try
