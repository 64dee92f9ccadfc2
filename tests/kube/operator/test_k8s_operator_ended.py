"""A TrainingJob whose workflow ended without its own teardown (issue 46): `temporal workflow
terminate`, a namespace cleanup. It showed Running for ever, `kubectl delete` hung on the
finalizer (waiting for the ended workflow to release nodes it never would) and the nodes stayed
billed. Now the resource turns Failed, saying how the workflow ended, a ReleaseJob releases
every node of the job by its ownership, and delete completes. The operator is a subprocess as
its ServiceAccount on the real apiserver; the worker runs the simulated cloud."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from spotrain.workflows.release import release_job_id
from tests.jobs import record_history
from tests.kube.k8s_cluster import ControlPlane
from tests.kube.kubectl import Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture
from tests.kube.operator.operator_support import (
    NS,
    on_two_nodes,
    operator_with_simulated_worker,
    resource,
    status,
    wait_for,
)


def released(s: dict) -> bool:
    return any(c["type"] == "NodesReleased" and c["status"] == "True" for c in s["conditions"])


@pytest.mark.parametrize("deleted_at_once", [False, True])
async def test_a_job_whose_workflow_was_terminated_releases_its_nodes_and_deletes(
    dev_env: WorkflowEnvironment,
    control_plane: ControlPlane,
    kubectl: Kubectl,
    tmp_path: Path,
    deleted_at_once: bool,
) -> None:
    """`deleted_at_once`: deleted right after the terminate, the operator down, then killed
    right after it started the release: the next one finds that release, not a second."""
    control_plane.ensure_namespace(NS)
    name = f"ended-{int(deleted_at_once)}"
    with operator_with_simulated_worker(control_plane, kubectl, dev_env.client, tmp_path) as (
        op,
        cloud,
        worker,
    ):
        async with worker():
            job = await on_two_nodes(kubectl, op, dev_env.client, name)
            await job.terminate(reason="a namespace cleanup")
            assert len(cloud.running()) == 2  # the ended workflow released nothing
            if deleted_at_once:
                kubectl("delete", "-n", NS, f"tj/{name}", "--wait=false")
                await op.crash_at("release-started")
            with op.running():
                if not deleted_at_once:
                    s = await wait_for(
                        lambda: (
                            (x := status(kubectl, name)).get("phase") == "Failed"
                            and released(x)
                            and x
                        ),
                        "Failed, its nodes released",
                    )
                    assert "the workflow ended (TERMINATED)" in s["message"], s
                    assert "released 2 node(s)" in s["message"] and s["nodes"] == [], s
                    kubectl("delete", "-n", NS, f"tj/{name}", "--wait=false")
                await wait_for(lambda: resource(kubectl, name) is None, "the resource deleted")
        assert cloud.running() == []
        release = dev_env.client.get_workflow_handle(release_job_id(job.id))
        assert (await release.describe()).status == WorkflowExecutionStatus.COMPLETED
        await record_history(release, f"release_job_{int(deleted_at_once)}")
        runs = [w async for w in dev_env.client.list_workflows(f'WorkflowId = "{release.id}"')]
        assert len(runs) == 1  # started once, whatever the operator's restarts


async def test_a_workflow_whose_trainingjob_is_gone_is_cancelled_and_releases_its_nodes(
    dev_env: WorkflowEnvironment, control_plane: ControlPlane, kubectl: Kubectl, tmp_path: Path
) -> None:
    """ "Stuck in Terminating? Remove the finalizer": the resource goes, its workflow trained on
    with its nodes billed, and nothing looked for it. The operator's sweep finds it: with
    `--orphans report` it only says so; by default it cancels it, and the job's own teardown
    releases its nodes."""
    control_plane.ensure_namespace(NS)
    name = "orphan"
    with operator_with_simulated_worker(control_plane, kubectl, dev_env.client, tmp_path) as (
        op,
        cloud,
        worker,
    ):
        async with worker():
            job = await on_two_nodes(kubectl, op, dev_env.client, name)
            kubectl("delete", "-n", NS, f"tj/{name}", "--wait=false")
            unfinalized = '{"metadata": {"finalizers": null}}'
            kubectl("patch", "-n", NS, f"tj/{name}", "--type=merge", "-p", unfinalized)
            assert resource(kubectl, name) is None
            sweep = ("--orphan-sweep-s", "0.5")
            with op.running("--orphans", "report", *sweep):
                await wait_for(lambda: "no longer exists: left running" in op.log(), "a report")
            assert len(cloud.running()) == 2
            assert (await job.describe()).status == WorkflowExecutionStatus.RUNNING
            with op.running(*sweep):
                await wait_for(lambda: cloud.running() == [], "its nodes released")
                assert "no longer exists: cancelled" in op.log()
            # the nodes go before the teardown's last step: wait for the workflow's end
            with pytest.raises(WorkflowFailureError):
                await asyncio.wait_for(job.result(), timeout=60)
            assert (await job.describe()).status == WorkflowExecutionStatus.CANCELED
