"""Sizes that travel through Temporal (issue 46): a 1.05 MB command made every workflow task
fail from the first continue-as-new on, with the job's nodes held, because the spec travelled
twice in a payload Temporal caps at 2 MB. Every size in the spec is bounded (in the pydantic
model and, generated from it, in the CRD), the whole spec's JSON is at most MAX_SPEC_BYTES, and
continue-as-new carries it once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.k8s.crd import training_job_spec_schema
from spotrain.workflows.job.state import JobStatus
from spotrain.workflows.spec import (
    MAX_ARG_CHARS,
    MAX_ARGS,
    MAX_SPEC_BYTES,
    SpecError,
    parse_spec,
)
from tests.jobs import continue_as_new_now, fast_runtime, fast_spec, job_spec, simulated, until


def refusal(spec: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as refused:
        parse_spec(spec)
    return str(refused.value)


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        ({"command": ["x" * (MAX_ARG_CHARS + 1)]}, "command.0: String should have at most 16384"),
        ({"command": ["x"] * (MAX_ARGS + 1)}, "command: List should have at most 1000 items"),
        ({"env": {"A": "v" * (MAX_ARG_CHARS + 1)}}, "env.A: String should have at most 16384"),
        ({"env": {f"K{i}": "v" for i in range(MAX_ARGS + 1)}}, "env: Dictionary should have"),
        ({"env": {"A=B": "1"}}, "env: name 'A=B' must be 1 to 253 characters, without '='"),
        ({"env": {"": "1"}}, "env: name '' must be"),
        ({"image": "r/" + "i" * 3000}, "image: String should have at most 2048"),
        ({"spot": {"zones": ["z" * 300]}}, "spot.zones.0: String should have at most 253"),
        # each argument within its bound, together 1.6 MB (the issue's was one of 1.05 MB)
        ({"command": ["x" * MAX_ARG_CHARS] * 100}, "the spec is 1,6"),  # 1,640,018 bytes
        ({"scale_config": {4: {"s": "v" * 70_000}}}, "over 65,536"),
    ],
)
def test_each_size_is_bounded_naming_the_field(overrides: dict[str, Any], said: str) -> None:
    assert said in refusal(job_spec(**overrides))


def test_the_crd_mirrors_the_bounds() -> None:
    """The API server refuses the same sizes before the operator sees them."""
    fields = training_job_spec_schema()["properties"]
    assert fields["command"]["maxItems"] == MAX_ARGS
    assert fields["command"]["items"]["maxLength"] == MAX_ARG_CHARS
    assert fields["env"]["maxProperties"] == MAX_ARGS
    assert fields["env"]["additionalProperties"]["maxLength"] == MAX_ARG_CHARS
    assert fields["spot"]["properties"]["zones"]["items"]["maxLength"] == 253


def largest_spec(total_steps: int) -> dict[str, Any]:
    """A job whose spec is just under MAX_SPEC_BYTES, one marker argument among its arguments."""
    spec = fast_spec(total_steps=total_steps)
    spec["command"] = ["train", "marker-0123456789"]

    def size() -> int:
        return len(parse_spec(spec).model_dump_json())

    while size() + MAX_ARG_CHARS + 3 <= MAX_SPEC_BYTES:  # 3: the quotes and comma
        spec["command"].append("a" * MAX_ARG_CHARS)
    spec["command"].append("b" * (MAX_SPEC_BYTES - size() - 3))
    assert MAX_SPEC_BYTES - 100 < len(parse_spec(spec).model_dump_json()) <= MAX_SPEC_BYTES
    return spec


async def test_the_largest_spec_continues_as_new_three_times_carrying_the_spec_once(
    ts_env: WorkflowEnvironment,
) -> None:
    """Each run's input holds the spec once and stays well under Temporal's payload limits,
    and every run answers its queries (a 1 MB command failed every task from the first
    continue-as-new on, queries included)."""
    async with simulated(ts_env.client, runtime=fast_runtime()) as sim:
        spec = largest_spec(total_steps=900)
        handle = await sim.start(spec)
        await until(sim, handle, lambda s: s.phase == "Running" and s.step > 0, timeout=60)
        latest = ts_env.client.get_workflow_handle(spec["name"])
        for _ in range(3):
            new_run = await continue_as_new_now(handle)
            run = ts_env.client.get_workflow_handle(spec["name"], run_id=new_run)
            started = (await run.fetch_history()).events[0]
            payload = b"".join(
                p.data for p in started.workflow_execution_started_event_attributes.input.payloads
            )
            assert payload.count(b"marker-0123456789") == 1, "the spec travels more than once"
            assert len(payload) < 2 * MAX_SPEC_BYTES
            status = await latest.query("status", result_type=JobStatus)
            assert status.phase == "Running", status.phase
        result = await asyncio.wait_for(handle.result(), timeout=120)  # a wedged task: never
    assert (result.phase, result.steps_done) == ("Succeeded", 900)


async def test_started_through_temporal_the_issues_command_fails_at_once(
    ts_env: WorkflowEnvironment,
) -> None:
    """`temporal workflow start` with the 1.05 MB argument: refused by the workflow's own
    validation before any node, not a job wedged at its first continue-as-new."""
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(job_spec(command=["python", "x" * 1_050_000]))
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), timeout=60)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "InvalidSpec", cause
    assert "command.1: String should have at most 16384 characters" in str(cause)
    assert sim.cloud.launches == []
