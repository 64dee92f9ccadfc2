"""The goodput benchmark's measured inputs for what a resize and a launch cost: live resize's
pauses (bench/live_resize.py), the state's hand-over (bench/handover.py), and a node's boot to
ready. Pure functions over the results files, so that the model is tested apart from the
workflow runs (tests/bench/test_goodput_live.py)."""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spotrain.activities.simulated import LivePauses

from ..common import REPO

RESULTS = REPO / "bench" / "results"
LIVE_KINDS = {"growth": "growth", "shrink on notice": "shrink", "loss without notice": "loss"}
# live_resize.json's live medians (s) as measured on 2026-11-24, when the file is absent
LIVE_MEDIANS = {"growth": 0.180, "shrink": 0.266, "loss": 0.263}
# bench.handover's medians without its file: (state GB, s), 10M and 100M params, 1 survivor
# (`--params 10 100 --survivors 1 --repeats 3`, 2026-11-25, load average 3.3)
HANDOVER_POINTS = [(0.08, 0.133), (0.8, 0.506)]


def live_medians(path: Path = RESULTS / "live_resize.json") -> dict[str, float]:
    """The median live pause per kind of resize (growth, shrink, loss), in seconds."""
    if not path.exists():
        return dict(LIVE_MEDIANS)
    rows = json.loads(path.read_text())["rows"]
    found = {
        LIVE_KINDS[r["kind"]]: float(r["median"])
        for r in rows
        if r["mode"] == "live" and r["kind"] in LIVE_KINDS
    }
    return LIVE_MEDIANS | found


def handover_points(path: Path = RESULTS / "handover.json") -> list[tuple[float, float]]:
    """(state GB, median hand-over s) per measured size, with the fewest survivors measured
    (one joiner fed by one survivor: the slowest case)."""
    if not path.exists():
        return list(HANDOVER_POINTS)
    rows = [r for r in json.loads(path.read_text())["rows"] if r["method"] == "handover"]
    if not rows:
        return list(HANDOVER_POINTS)
    fewest = min(r["survivors"] for r in rows)
    return sorted(
        (r["state_MB"] / 1000, float(r["median"])) for r in rows if r["survivors"] == fewest
    )


def handover_s(state_gb: float, points: Sequence[tuple[float, float]]) -> float:
    """The hand-over time of `state_gb`: linear between measured sizes; beyond the largest at
    its rate (s per GB); below the smallest, the smallest's time (fixed costs dominate)."""
    points = sorted(points)
    if state_gb <= points[0][0]:
        return points[0][1]
    for (g0, s0), (g1, s1) in itertools.pairwise(points):
        if state_gb <= g1:
            return s0 + (s1 - s0) * (state_gb - g0) / (g1 - g0)
    g, s = points[-1]
    return s * state_gb / g


def live_pauses(
    state_gb: float,
    medians: dict[str, float],
    points: Sequence[tuple[float, float]],
    measured_gb: float = 0.0,
) -> LivePauses:
    """The simulated runtime's live pauses: each kind's median as measured on a model of
    `measured_gb`, growth plus the hand-over of the state beyond that (the measured growth
    already includes the hand-over of its own state)."""
    extra = max(0.0, handover_s(state_gb, points) - handover_s(measured_gb, points))
    return LivePauses(
        growth_s=medians["growth"] + extra,
        shrink_s=medians["shrink"],
        loss_s=medians["loss"],
    )


def measured_gb(settings: dict[str, Any]) -> float:
    """The state size (GB) a bench.live_resize run was measured on, from its settings (0:
    the tiny model, whose file states no size)."""
    return (settings.get("state_mb") or 0.0) / 1000


def live_results_for(state_gb: float, results: Path = RESULTS) -> Path:
    """The data-parallel live_resize results file (local runtime, with all three live
    pauses) measured on the state size nearest `state_gb`: a 100M-parameter run's pauses come
    from the 100M file, not the tiny model's."""
    candidates = []
    for path in sorted(results.glob("live_resize*.json")):
        data = json.loads(path.read_text())
        settings = data["settings"]
        kinds = {r["kind"] for r in data["rows"] if r.get("mode") == "live" and "median" in r}
        if (
            settings.get("runtime") == "local"
            and settings.get("example", "ddp") == "ddp"
            and set(LIVE_KINDS) <= kinds
        ):
            candidates.append((abs(measured_gb(settings) - state_gb), path.name, path))
    if not candidates:
        return results / "live_resize.json"  # (absent too: the medians kept in this module)
    return min(candidates)[2]


def measured_live_pauses(state_gb: float, live_results: str = "") -> tuple[LivePauses, Path]:
    """Live pauses from `live_results` (a bench.live_resize results file, for example a
    sharded model's; "": the file measured nearest `state_gb`) and the hand-over sweep, with
    the file they came from."""
    path = Path(live_results) if live_results else live_results_for(state_gb)
    gb = measured_gb(json.loads(path.read_text()).get("settings", {})) if path.exists() else 0.0
    return live_pauses(state_gb, live_medians(path), handover_points(), gb), path


def shown_path(path: Path) -> str:
    """`path` as a report states it: relative to the repository where it lies inside it (a
    relative `--live-resize-results` is read from the working directory), else absolute."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(resolved)


def lognormal_boot(median_s: float, sigma: float, seed: int) -> Callable[[], float]:
    """Boot-to-ready delays: lognormal with this median and shape (sigma of the log), one
    draw per launched node, reproducible by `seed`."""
    rng = random.Random(seed)
    if median_s <= 0:
        return lambda: 0.0
    mu = math.log(median_s)
    return lambda: rng.lognormvariate(mu, sigma)
