"""The demo scenario end to end on the embedded stack: the real Temporal dev server, moto as
EC2, the webhook, the spot market and real PyTorch DDP processes (gloo on CPU)."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spotrain.activities.local import LocalRuntime, job_processes
from spotrain.workflows.contract import CleanupRequest

pytest.importorskip("torch")

# Enough that the job grows back before it ends: live resizes cost well under a second, so
# 600 steps could finish at the shrunk size while the replacement's scaling timeout runs.
STEPS = 1200


def steps_by_generation(record: Path) -> dict[int, list[dict]]:
    """Rank 0's record of every step it trained, per generation that trained any (one
    stopped again before its first step, as a live resize's may be, leaves an empty file)."""
    out: dict[int, list[dict]] = {}
    for f in record.glob("gen-*-rank-0.jsonl"):
        generation = int(f.stem.split("-")[1])
        if steps := [json.loads(line) for line in f.read_text().splitlines()]:
            out[generation] = steps
    return dict(sorted(out.items()))


@pytest.mark.timeout(420)
def test_demo_survives_two_reclaims_and_leaves_nothing(tmp_path: Path) -> None:
    """As a newcomer runs it: no state dir given (a temporary one, under TMPDIR here), the job's
    bare `python` with no `python` on PATH."""
    record, tmp = tmp_path / "record", tmp_path / "tmp"
    tmp.mkdir()
    command = [sys.executable, "-m", "spotrain.workers.demo", "--steps", str(STEPS)]
    command += ["--step-time", "0.02", "--record", str(record)]
    env = os.environ | {"TMPDIR": str(tmp), "PATH": str(tmp_path / "nothing")}
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    finally:  # even if the demo was killed: its detached ranks must not outlive the test
        for state in tmp.glob("spotrain-demo-*"):
            for job in (state / "jobs").glob("*"):
                LocalRuntime(state).cleanup_job(CleanupRequest(job=job.name, keep=True))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert list(tmp.glob("spotrain-demo-*")) == []  # its state went with it
    assert "placement scores" not in run.stdout + run.stderr  # the market answers them
    assert "left running: 0 instance(s), 0 worker process(es)" in run.stdout
    job = re.search(r"(demo-\d+): Succeeded", run.stdout)
    assert job, run.stdout[-2000:]
    assert job_processes(job.group(1)) == []  # /proc, not the demo's word for it
    assert re.search(r"reclaims survived\s*│\s*2\s", run.stdout), run.stdout[-2000:]
    # examples/job.yaml resizes live: the loss without notice costs at most the step in
    # flight (restarting, it would cost everything since the last periodic checkpoint).
    assert re.search(rf"steps done / lost\s*│\s*{STEPS} / [01]\s", run.stdout), run.stdout[-2000:]
    # Checkpoints went to the stack's S3; their figures reached the job's result.
    assert re.search(r"checkpoints\s*│\s*checkpoints \d+ kept", run.stdout), run.stdout[-3000:]
    assert re.search(r"notice -> checkpoint durable\s*│\s*\d+\.\d+ s", run.stdout)

    gens = steps_by_generation(record)
    assert len(gens) >= 3, gens.keys()
    # World sizes followed the plan: 4 nodes, 3 after the reclaim with notice, back to 4;
    # after the loss without notice the survivors go on at 3 at once (live: they wait on no
    # replacement) and grow back to 4 once the replacement's ranks are up, if steps remain.
    worlds = [steps[0]["world"] for steps in gens.values()]
    assert worlds[:4] == [4, 3, 4, 3] and set(worlds[4:]) <= {4}, worlds
    assert max(gens) >= 4, gens.keys()  # grew back after the notice, resized after the loss
    # Steps add up: each generation resumes where the one before stopped (or, had no rank
    # survived, right after its last checkpoint), the last one ends exactly at the total.
    chain = list(gens.values())
    for before, after in itertools.pairwise(chain):
        assert 1 <= after[0]["step"] <= before[-1]["step"] + 1
    assert chain[0][0]["step"] == 1 and chain[-1][-1]["step"] == STEPS
    assert [e["step"] for e in chain[-1]] == list(range(chain[-1][0]["step"], STEPS + 1))
    # Loss keeps falling across resizes.
    losses = [e["loss"] for steps in chain for e in steps]
    assert sum(losses[-50:]) / 50 < 0.5 * sum(losses[:50]) / 50
    assert chain[-1][-1]["loss"] < chain[1][0]["loss"] < chain[0][0]["loss"]
