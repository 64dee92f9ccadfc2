"""Bad job specs through the real `temporal workflow start`: each one fails fast with a message
naming the problem (ApplicationError type InvalidSpec); none hangs on a workflow task retry.

"Fast" is read from the history, not a stopwatch (CI's load once made two CLI starts and one
workflow task take 10.6 s): the job fails in the first workflow task the worker completes,
before any activity, and no task fails."""

from __future__ import annotations

import copy
import json
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from spotrain.workers.embedded.binaries import temporal_cli
from spotrain.workflows.spec import SpecError, parse_spec
from tests.chaos.harness import FULL, ChaosEnv, WorkerProcess

QUEUE = "bad-specs"
HANG_GUARD_S = 120.0  # a CLI call that outlives this is a hang
VALID: dict[str, Any] = {
    "name": "bad-spec",
    "command": ["python", "train.py"],
    "total_steps": 100,
    "checkpoint": "file:///tmp/spotrain-bad-spec",
    "spot": {"instance_types": [{"name": "g5.xlarge", "gpus": 1, "on_demand_price": 1.0}]},
}
FIELDS = [
    ("name",),
    ("command",),
    ("total_steps",),
    ("checkpoint",),
    ("procs_per_node",),
    ("type",),
    ("no_such_field",),
    ("elastic", "min_nodes"),
    ("elastic", "max_nodes"),
    ("elastic", "discrete_sizes"),
    ("elastic", "graceful_shutdown_timeout_s"),
    ("spot", "instance_types"),
    ("spot", "max_price"),
    ("on_demand", "base_nodes"),
]
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 0),
    st.floats(max_value=0, allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.lists(st.integers(-3, 9), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def with_value(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    spec = copy.deepcopy(VALID)
    spec.setdefault("elastic", {})
    spec.setdefault("on_demand", {})
    target = spec
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return spec


def without(key: str) -> dict[str, Any]:
    return {k: v for k, v in VALID.items() if k != key}


BAD_SPECS = st.one_of(
    st.builds(with_value, st.sampled_from(FIELDS), JUNK),
    st.builds(without, st.sampled_from(["name", "command", "total_steps", "checkpoint", "spot"])),
    JUNK,  # not a mapping at all
)


@pytest.fixture(scope="module")
def worker(chaos_session: ChaosEnv) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(chaos_session, QUEUE)
    yield proc
    proc.stop()


def temporal(env: ChaosEnv, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [temporal_cli(), *args, "--address", env.server.address],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        check=False,
    )


@settings(
    max_examples=100 if FULL else 25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(spec=BAD_SPECS)
def test_bad_spec_fails_fast_with_a_message(
    chaos_env: ChaosEnv, worker: WorkerProcess, spec: Any, tmp_path_factory: Any
) -> None:
    try:
        parse_spec(spec)
    except SpecError:
        pass
    else:
        assume(False)  # the mutation happened to be valid
    path = tmp_path_factory.mktemp("spec") / "job.json"
    path.write_text(json.dumps(spec))
    workflow_id = f"bad-{time.monotonic_ns()}"
    start = temporal(
        chaos_env, "workflow", "start", "--type", "TrainingJob", "--task-queue", QUEUE,
        "--workflow-id", workflow_id, "--input-file", str(path),
    )  # fmt: skip
    assert start.returncode == 0, start.stderr
    result = temporal(chaos_env, "workflow", "result", "--workflow-id", workflow_id, "-o", "json")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "InvalidSpec" in output and "invalid job spec" in output, output
    assert without_timed_out_tasks(event_types(chaos_env, workflow_id)) == FAILED_IN_FIRST_TASK


FAILED_IN_FIRST_TASK = [
    "WORKFLOWEXECUTIONSTARTED",
    "WORKFLOWTASKSCHEDULED",
    "WORKFLOWTASKSTARTED",
    "WORKFLOWTASKCOMPLETED",
    "WORKFLOWEXECUTIONFAILED",
]


def without_timed_out_tasks(events: list[str]) -> list[str]:
    """The history less each workflow task the worker took too long over (10 s), which Temporal
    schedules again: the worker's first task loads the workflow sandbox, and on a loaded machine
    (a CI run beside two busy loops) the first example's took longer. A slow worker is not the
    spec's doing; a failed task would be, and stays in."""
    kept: list[str] = []
    for event in events:
        if event == "WORKFLOWTASKTIMEDOUT" and kept[-2:] == TASK_RAN:
            del kept[-2:]
        else:
            kept.append(event)
    return kept


TASK_RAN = ["WORKFLOWTASKSCHEDULED", "WORKFLOWTASKSTARTED"]


def event_types(env: ChaosEnv, workflow_id: str) -> list[str]:
    """The history's event types, spelled alike whichever JSON form the CLI prints."""
    shown = temporal(env, "workflow", "show", "--workflow-id", workflow_id, "-o", "json")
    assert shown.returncode == 0, shown.stderr
    names = (e["eventType"] for e in json.loads(shown.stdout)["events"])
    return [n.upper().replace("_", "").removeprefix("EVENTTYPE") for n in names]
