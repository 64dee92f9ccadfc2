"""A job's command that cannot start: the local runtime runs a bare `python` as the
interpreter spotrain runs under (not PATH's), and a command that fails the same way on every
rank before its first step fails the job at once, saying why, instead of restarting it
`max_restarts` times. Real rank processes; the whole job on the Temporal dev server."""

from __future__ import annotations

import asyncio
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from spotrain.activities.command_launch import job_command
from spotrain.activities.local import LocalRuntime
from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.contract import (
    CleanupRequest,
    GenerationPlan,
    Member,
    WatchRequest,
    WatchResult,
)
from spotrain.workflows.job.start_failure import cannot_start
from spotrain.workflows.job.state import JobResult
from tests.jobs import leftover_processes, record_history
from tests.workflows.test_planner_job import node, running, state

MISSING = "ModuleNotFoundError: No module named 'no_such_module_spotrain'"


def run_generation(tmp_path: Path, command: list[str], ranks: int = 2) -> WatchResult:
    """Start one generation of `command` on `ranks` single-process nodes; its watch's answer."""
    env, rt = ActivityEnvironment(), LocalRuntime(tmp_path / "rt")
    members = [Member(node_id=f"n{i}", address="127.0.0.1") for i in range(ranks)]
    plan = GenerationPlan(
        job="job",
        generation=1,
        members=members,
        command=command,
        checkpoint=f"file://{tmp_path}/store",
        total_steps=10,
    )
    env.run(rt.start_generation, plan)
    req = WatchRequest(
        job="job", generation=1, world_size=ranks, checkpoint=plan.checkpoint, report_after_s=60
    )
    try:
        return env.run(rt.watch_generation, req)
    finally:
        env.run(rt.cleanup_job, CleanupRequest(job="job"))


def test_bare_python_runs_as_spotrain_s_interpreter_whatever_path_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No `python` on PATH at all (an unactivated venv, a machine with only python3): the
    ranks still run, under this interpreter."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    script = "import sys; print('interpreter', sys.executable); sys.exit(5)"
    for word in ("python", "python3"):
        w = run_generation(tmp_path, [word, "-c", script])
        assert w.exit_codes == {0: 5, 1: 5}, w
        assert w.output[0].endswith(f"interpreter {sys.executable}"), w


def test_explicit_interpreters_and_other_programs_run_as_written() -> None:
    assert job_command(["python", "t.py"], "/venv/bin/python") == ["/venv/bin/python", "t.py"]
    for command in (["/usr/bin/python3", "t.py"], ["python3.11", "t.py"], ["bash", "-c", "x"]):
        assert job_command(command, "/venv/bin/python") == command
    assert job_command(["python", "t.py"], None) == ["python", "t.py"]  # Kubernetes: the image's


def test_every_rank_failing_at_start_is_reported_with_its_output(tmp_path: Path) -> None:
    """The watch waits for the other ranks of a generation that failed before its first step,
    and hands over each failed rank's last lines."""
    w = run_generation(tmp_path, [sys.executable, "-c", "import no_such_module_spotrain"], 3)
    assert w.outcome == "failed" and w.exit_codes == {0: 1, 1: 1, 2: 1}, w
    assert w.stepped is False
    assert all(w.output[r].endswith(MISSING) for r in range(3)), w.output
    assert w.detail.endswith(f"exited with code 1: {MISSING}"), w.detail


def failed(codes: dict[int, int], lasts: dict[int, str], stepped: bool = False) -> WatchResult:
    return WatchResult(
        outcome="failed", exit_codes=codes, stepped=stepped, output=lasts, detail="rank 0 failed"
    )


def test_only_the_same_failure_on_every_rank_before_any_step_cannot_start() -> None:
    s = running(state(), [0, 1])
    s.nodes = [node(0), node(1)]
    same = failed({0: 1, 1: 1}, {0: f"Traceback\n{MISSING}", 1: MISSING})
    why = cannot_start(s, same)
    assert why is not None and why.endswith(f"Traceback\n{MISSING}") and "code 1" in why
    assert cannot_start(s, failed({0: 127, 1: 127}, {})) is not None  # no output, same code
    for other in (
        failed({0: 1, 1: 1}, {0: MISSING, 1: "RuntimeError: gloo"}),  # different errors
        failed({0: 1}, {0: MISSING}),  # rank 1 still running
        failed({0: 1, 1: 2}, {0: MISSING, 1: MISSING}),  # different codes
        failed({0: -9, 1: -9}, {}),  # killed (a node lost), not a command failing
        failed({0: 1, 1: 1}, {0: MISSING, 1: MISSING}, stepped=True),  # it trained
        WatchResult(outcome="failed", exit_codes={0: 1, 1: 1}),  # the runtime cannot tell
    ):
        assert cannot_start(s, other) is None, other
    s.step = 40  # a job that trained before: a failure now may be transient
    assert cannot_start(s, same) is None


def job(name: str, command: list[str], tmp_path: Path) -> dict[str, Any]:
    return {
        "name": name,
        "command": command,
        "total_steps": 100,
        "checkpoint": f"file://{tmp_path / 'ckpt'}",
        "elastic": {"min_nodes": 2, "max_nodes": 2, "max_restarts": 5},
        "spot": {
            "instance_types": [{"name": "m5.large", "on_demand_price": 0.1, "spot_price": 0.03}],
            "zones": ["us-east-1a"],
        },
    }


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        (["python", "-c", "import no_such_module_spotrain"], MISSING),
        (["no-such-program-spotrain"], "cannot start 'no-such-program-spotrain'"),
    ],
)
async def test_a_command_that_cannot_start_fails_the_job_at_once_saying_why(
    dev_env: WorkflowEnvironment, tmp_path: Path, command: list[str], reason: str
) -> None:
    name = f"nostart-{uuid.uuid4().hex[:8]}"
    runtime = LocalRuntime(tmp_path / "rt")
    with ThreadPoolExecutor(8) as pool:
        async with workflow_worker(
            dev_env.client,
            name,
            SimulatedCloud(zones=["us-east-1a"]).activities() + runtime.activities(),
            activity_executor=pool,
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob", job(name, command, tmp_path), id=name, task_queue=name
            )
            with pytest.raises(WorkflowFailureError) as err:
                await asyncio.wait_for(handle.result(), 120)
            if command[0] == "python":
                await record_history(handle, "cannot_start")
    failure = err.value.cause
    assert "the job's command cannot start" in str(failure) and reason in str(failure), failure
    result = JobResult.model_validate(failure.details[0])  # type: ignore[attr-defined]
    assert result.generations == 1, result  # not max_restarts + 1 of them
    assert not (left := leftover_processes(name)), left
