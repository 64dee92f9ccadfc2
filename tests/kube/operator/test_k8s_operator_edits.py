"""Spec edits of a running TrainingJob (issue 46): the API server stores any valid edit, but
only `spec.replicas` reaches the job; an edit of anything else (total_steps, max_nodes) was
stored and silently ignored, so the resource showed values the job did not run with. The
status now says so (condition SpecApplied False) with a Warning Event. The operator is a
subprocess as its ServiceAccount on the real apiserver; the worker runs the simulated cloud."""

from __future__ import annotations

import json
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from spotrain.workers.k8s.operator_status import SPEC_IGNORED
from tests.kube.k8s_cluster import ControlPlane
from tests.kube.kubectl import Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture
from tests.kube.operator.operator_support import (
    NS,
    events,
    on_two_nodes,
    operator_with_simulated_worker,
    status,
    wait_for,
)


def applied(kubectl: Kubectl, name: str) -> str | None:
    conditions = status(kubectl, name).get("conditions", [])
    return next((c["status"] for c in conditions if c["type"] == "SpecApplied"), None)


async def test_an_edit_the_job_cannot_apply_is_shown_not_silently_stored(
    dev_env: WorkflowEnvironment, control_plane: ControlPlane, kubectl: Kubectl, tmp_path: Path
) -> None:
    control_plane.ensure_namespace(NS)
    name = "edited"
    with operator_with_simulated_worker(control_plane, kubectl, dev_env.client, tmp_path) as (
        op,
        _,
        worker,
    ):
        async with worker():
            await on_two_nodes(kubectl, op, dev_env.client, name)
            with op.running():
                assert applied(kubectl, name) == "True"
                kubectl("scale", "-n", NS, f"tj/{name}", "--replicas=3")  # reaches the job
                await wait_for(lambda: status(kubectl, name).get("target") == 3, "target 3")
                assert applied(kubectl, name) == "True"
                edit = json.dumps({"spec": {"total_steps": 5}})
                kubectl("patch", "-n", NS, f"tj/{name}", "--type=merge", "-p", edit)
                await wait_for(lambda: applied(kubectl, name) == "False", "SpecApplied False")
                warned = await wait_for(
                    lambda: [e for e in events(kubectl, name) if e["reason"] == "SpecIgnored"],
                    "a SpecIgnored Event",
                )
                assert [e["message"] for e in warned] == [SPEC_IGNORED]  # posted once
                assert status(kubectl, name)["phase"] == "Running"  # the job trains on as it was
