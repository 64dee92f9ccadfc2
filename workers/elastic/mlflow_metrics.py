"""Training metrics and the job's scaling events on one MLflow run (`pip install spotrain[mlflow]`).

Active when the job names a tracking location: `MLFLOW_TRACKING_URI` in the job spec's `env`
(and optionally `MLFLOW_EXPERIMENT_NAME`, default "spotrain"). Rank 0 logs; other ranks and
jobs without a tracking location do nothing (and never import mlflow).

One run per job (tag `spotrain.job`), found again by every generation, so loss, throughput and
learning rate sit beside the world size across resizes:
- metrics: what the loop reports (`log_metrics`), plus `world_size` at every logged step, and
  `spotrain.generation` / `spotrain.world_size` at each generation's start and end step;
- tags `spotrain.generation.<g>`: {"world_size", "start_step", "end_step", "end"} where end is
  "elastic event", "done", or "lost without notice" (filled in by the next generation, since
  a rank killed without notice logs nothing).

A tracking server that fails does not stop training: the error is printed once, logging stops.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from functools import cache
from typing import Any

from spotrain import elastic

TRACKING_URI = "MLFLOW_TRACKING_URI"
EXPERIMENT = "MLFLOW_EXPERIMENT_NAME"
JOB_TAG = "spotrain.job"
GENERATION_TAG = "spotrain.generation."


class Tracker:
    """The job's MLflow run, for rank 0 of the running generation."""

    def __init__(self, uri: str, experiment: str, s: elastic.Settings) -> None:
        from mlflow.tracking import MlflowClient  # only where a tracking location is named

        self.client = MlflowClient(uri)
        self.settings = s
        exp = self.client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(experiment)
        runs = self.client.search_runs(
            [exp_id], filter_string=f"tags.`{JOB_TAG}` = '{s.job}'", max_results=1
        )
        self.run_id = (
            runs[0].info.run_id
            if runs
            else self.client.create_run(exp_id, tags={JOB_TAG: s.job}, run_name=s.job).info.run_id
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, float(v), now, step) for k, v in values.items() if v is not None]
        self.client.log_batch(self.run_id, metrics=metrics)

    def generations(self) -> dict[int, dict[str, Any]]:
        tags = self.client.get_run(self.run_id).data.tags
        return {
            int(k.removeprefix(GENERATION_TAG)): json.loads(v)
            for k, v in tags.items()
            if k.startswith(GENERATION_TAG)
        }

    def set_generation(self, generation: int, record: dict[str, Any]) -> None:
        self.client.set_tag(self.run_id, f"{GENERATION_TAG}{generation}", json.dumps(record))


_failed = False


@cache
def tracker() -> Tracker | None:
    """The run, if the job names a tracking location and this is rank 0; else None."""
    s = elastic.settings()
    uri = os.environ.get(TRACKING_URI)
    if not uri or not s.is_rank0:
        return None
    return Tracker(uri, os.environ.get(EXPERIMENT, "spotrain"), s)


def _guarded(fn: Callable[[Tracker], None]) -> None:
    """Run one tracking call; a failure is printed once and turns tracking off."""
    global _failed
    if _failed:
        return
    try:
        t = tracker()
        if t is not None:
            fn(t)
    except Exception as err:  # the tracker is not worth a training job
        _failed = True
        print(f"spotrain: MLflow tracking off after an error: {err!r}", file=sys.stderr)


def log_metrics(step: int, **values: float | None) -> None:
    """Rank 0: forward the loop's metrics (e.g. loss, learning_rate, samples_per_second) with
    the world size; None values are skipped."""
    world = elastic.settings().world_size
    _guarded(lambda t: t.log(step, {**values, "world_size": world}))


def _scaling(t: Tracker, step: int) -> None:
    s = t.settings
    t.log(step, {"spotrain.generation": s.generation, "spotrain.world_size": s.world_size})


def generation_started(step: int) -> None:
    """Rank 0, once training resumed at `step`: the generation and its world size; an earlier
    generation that never recorded its end was lost without notice."""

    def started(t: Tracker) -> None:
        s = t.settings
        for g, record in t.generations().items():
            if g < s.generation and "end" not in record:
                t.set_generation(g, {**record, "end": "lost without notice", "resumed_at": step})
        t.set_generation(s.generation, {"world_size": s.world_size, "start_step": step})
        _scaling(t, step)

    _guarded(started)


def generation_ended(step: int, reason: str) -> None:
    """Rank 0, when the generation stops at `step`: "elastic event" or "done"."""

    def ended(t: Tracker) -> None:
        record = t.generations().get(t.settings.generation, {})
        t.set_generation(t.settings.generation, {**record, "end_step": step, "end": reason})
        _scaling(t, step)

    _guarded(ended)
