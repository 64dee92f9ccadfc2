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

from spotrain.activities.local import LocalRuntime
from spotrain.workers.embedded.demo import Progress
from spotrain.workflows.contract import CleanupRequest
from spotrain.workflows.job.state import JobStatus, Phase
from tests.jobs import leftover_processes

pytest.importorskip("torch")

# Enough that the job grows back before it ends: live resizes cost well under a second, so
# 600 steps could finish at the shrunk size while the replacement's scaling timeout runs. 900
# leave 630 steps after the notice (about 25 s quiet) for a growth that took 5 s quiet.
pytestmark = pytest.mark.slow

STEPS = 900


def steps_by_generation(record: Path) -> dict[int, list[dict]]:
    """Rank 0's record of every step it trained, per generation that trained any (one
    stopped again before its first step, as a live resize's may be, leaves an empty file)."""
    out: dict[int, list[dict]] = {}
    for f in record.glob("gen-*-rank-0.jsonl"):
        generation = int(f.stem.split("-")[1])
        if steps := [json.loads(line) for line in f.read_text().splitlines()]:
            out[generation] = steps
    return dict(sorted(out.items()))


def test_without_a_terminal_progress_comes_as_lines() -> None:
    """A line per note, per change of phase, generation or world size, and every `every_s`
    seconds; nothing more."""
    progress, notes = Progress(every_s=10), []

    def status(generation: int, world: int, step: int) -> JobStatus:
        return JobStatus.model_construct(  # (the fields a progress line shows)
            name="demo-1",
            phase=Phase.RUNNING,
            generation=generation,
            world_size=world,
            step=step,
            total_steps=100,
            cost_so_far=0.0,
        )

    first = progress.lines(status(1, 4, 5), notes, now=0)
    assert [line.split(" ", 1)[1] for line in first] == [
        "demo-1: Running, generation 1, world size 4, step 5/100, cost $0.0000"
    ]
    assert progress.lines(status(1, 4, 9), notes, now=9) == []
    assert len(progress.lines(status(1, 4, 12), notes, now=10)) == 1  # every 10 s
    notes.append("reclaiming i-1 with 20 s notice")
    assert progress.lines(status(1, 4, 13), notes, now=11) == notes
    assert "world size 3" in progress.lines(status(2, 3, 14), notes, now=12)[0]


def tail(run: subprocess.CompletedProcess[str]) -> str:
    return run.stdout[-2000:] + "\n--- stderr ---\n" + run.stderr[-4000:]


# Each line the demo prints without a terminal while the job runs.
PROGRESS = re.compile(
    r"^\d\d:\d\d:\d\d demo-\d+: (\w+), generation (\d+), world size (\d+), step (\d+)/"
)


@pytest.mark.timeout(420)
def test_demo_survives_two_reclaims_and_leaves_nothing(tmp_path: Path) -> None:
    """As a newcomer runs it: no state dir given (a temporary one, under TMPDIR here), the job's
    bare `python` with no `python` on PATH."""
    record, tmp = tmp_path / "record", tmp_path / "tmp"
    tmp.mkdir()
    command = [sys.executable, "-m", "spotrain.workers.embedded.demo", "--steps", str(STEPS)]
    command += ["--step-time", "0.02", "--record", str(record)]
    env = os.environ | {"TMPDIR": str(tmp), "PATH": str(tmp_path / "nothing")}
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    finally:  # even if the demo was killed: its detached ranks must not outlive the test
        for state in tmp.glob("spotrain-demo-*"):
            for job in (state / "jobs").glob("*"):
                LocalRuntime(state).cleanup_job(CleanupRequest(job=job.name, keep=True))
    assert run.returncode == 0, tail(run)
    assert list(tmp.glob("spotrain-demo-*")) == []  # its state went with it
    assert "placement scores" not in run.stdout + run.stderr  # the market answers them
    assert "Failed handling activation" not in run.stderr, tail(run)  # e.g. a deadlock
    assert "left running: 0 instance(s), 0 worker process(es)" in run.stdout
    job = re.search(r"(demo-\d+): Succeeded", run.stdout)
    assert job, run.stdout[-2000:]
    left = leftover_processes(job.group(1))  # /proc, not the demo's word for it
    assert not left, left
    # (stderr too: the worker's errors, such as an activation it failed, are logged there)
    assert re.search(r"reclaims survived\s*│\s*2\s", run.stdout), tail(run)
    # examples/job.yaml resizes live: the loss without notice costs at most the step in
    # flight (restarting, it would cost everything since the last periodic checkpoint).
    assert re.search(rf"steps done / lost\s*│\s*{STEPS} / [01]\s", run.stdout), run.stdout[-2000:]
    # Checkpoints went to the stack's S3; their figures reached the job's result.
    assert re.search(r"checkpoints\s*│\s*checkpoints \d+ kept", run.stdout), run.stdout[-3000:]
    assert re.search(r"notice -> checkpoint durable\s*│\s*\d+\.\d+ s", run.stdout)
    # No terminal here (the output is a pipe): progress came as lines while it ran, before
    # the summary, through both reclaims and the sizes they caused.
    during = run.stdout.split("reclaims survived")[0]
    progress = [m.groups() for line in during.splitlines() if (m := PROGRESS.match(line))]
    assert len(progress) >= 6, during[-3000:]
    assert {world for _, _, world, _ in progress} >= {"3", "4"}, progress
    steps = [int(step) for *_, step in progress]
    assert steps == sorted(steps) and steps[-1] > steps[0], steps
    assert "with 20 s notice" in during and "without notice" in during, during[-3000:]

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
    # Loss falls, and every resize carries the trained state: each later generation starts far
    # below the first step's loss (about 8; restarted from the initial weights, near it). One
    # step's loss is noisy (0.006-0.14 within a generation late in a run): the last step's
    # was once above the second generation's first, so single steps are not compared.
    losses = [e["loss"] for steps in chain for e in steps]
    assert sum(losses[-50:]) / 50 < 0.5 * sum(losses[:50]) / 50
    first = chain[0][0]["loss"]
    assert all(steps[0]["loss"] < 0.1 * first for steps in chain[1:]), [s[0] for s in chain]
