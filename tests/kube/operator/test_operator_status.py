"""The operator's pure decisions on a job's status, without a cluster."""

from __future__ import annotations

import pytest

from spotrain.workers.k8s.operator_status import (
    invalid_message,
    job_input,
    job_name,
    needs_release,
)
from spotrain.workflows.job.state import JobState, NodeState, Phase
from spotrain.workflows.spec import SpecError, parse_spec
from tests.jobs import job_spec
from tests.workflows.test_planner_job import T0, node


def test_a_job_needs_a_release_until_it_is_over_and_holds_no_node() -> None:
    """The finalizer stays while the status says the job runs, or lists a node it still
    holds (its teardown cut short: a ReleaseJob must release it), whatever its phase."""
    s = JobState.new(parse_spec(job_spec()))
    s.nodes = [node(0), node(1, state=NodeState.RELEASED)]
    s.phase = Phase.RUNNING
    assert needs_release(s.status(T0))
    for phase in (Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED):
        s.phase = phase
        assert needs_release(s.status(T0)), phase  # node 0 is still held
    s.nodes[0].state = NodeState.REQUESTED  # ordered, never ready: still billed once it is
    assert needs_release(s.status(T0))
    s.nodes[0].state = NodeState.GONE
    assert not needs_release(s.status(T0))


def test_a_refused_spec_is_told_in_the_resources_terms() -> None:
    """The TrainingJob's author wrote spec.replicas and spec.elastic.*; the job spec's
    refusal names initial_nodes and elastic.*: the Invalid message speaks the resource's."""
    spec = {k: v for k, v in job_spec().items() if k != "name"}
    spec["replicas"] = 9
    spec["elastic"] = spec["elastic"] | {"min_nodes": "2"}
    resource = {"metadata": {"name": "mnist", "uid": "0123456789ab"}, "spec": spec}
    with pytest.raises(SpecError) as err:
        parse_spec(job_input(resource))
    said = invalid_message(str(err.value))
    assert said.splitlines() == [
        "invalid TrainingJob spec:",
        "  spec.elastic.min_nodes: Input should be a valid integer",
    ], said
    spec["elastic"]["min_nodes"] = 2
    with pytest.raises(SpecError) as err:
        parse_spec(job_input(resource))
    said = invalid_message(str(err.value))
    assert "spec.replicas" not in str(err.value) and "initial_nodes" not in said
    assert "replicas (9) outside" in said, said


@pytest.mark.parametrize("name", ["a.b", "team.a.mnist", "x" * 40 + ".y", "a" * 253])
def test_any_name_the_apiserver_accepts_makes_a_valid_job(name: str) -> None:
    """A TrainingJob's name is a DNS subdomain (dots, up to 253); the job's name, a DNS label
    of at most 50, is derived from it and the uid, and the job spec accepts it."""
    spec = {k: v for k, v in job_spec().items() if k != "name"}
    resource = {"metadata": {"name": name, "uid": "0123-4567-89ab"}, "spec": spec}
    assert parse_spec(job_input(resource)).name == job_name(name, "0123-4567-89ab")
    assert job_name(name, "0123-4567-89ab").endswith("-01234567")
