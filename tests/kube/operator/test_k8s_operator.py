"""The operator on the real kube-apiserver and Temporal dev server, driven with kubectl, and
killed right after every effect of create, scale and delete: a TrainingJob's workflow starts
once, carrying the job's name from its start, a `kubectl scale` moves its target once, a
ScaleIn by name removes that worker, a reclaim shows as an Event (each posted once), and
`kubectl delete` ends only once every node is released. The worker runs the workflow with
the simulated cloud and job (tests/jobs.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import yaml
from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.k8s.crd import API_VERSION, FINALIZER
from spotrain.workers.k8s.operator import HOLDING, TIMELINE_AT
from spotrain.workers.k8s.operator_status import job_name, workflow_id
from spotrain.workflows.job import attributes
from tests.kube.k8s_cluster import ControlPlane
from tests.kube.kubectl import Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture
from tests.kube.operator.operator_support import (
    NS,
    events,
    operator_with_simulated_worker,
    outcome,
    resource,
    status,
    training_job,
    wait_for,
)
from tests.workflows.test_workflow_scenarios import in_seconds

RUNNING = WorkflowExecutionStatus.RUNNING
CONTINUED = WorkflowExecutionStatus.CONTINUED_AS_NEW


async def test_operator_killed_at_every_step(
    dev_env: WorkflowEnvironment, control_plane: ControlPlane, kubectl: Kubectl, tmp_path: Path
) -> None:
    control_plane.ensure_namespace(NS)
    with operator_with_simulated_worker(control_plane, kubectl, dev_env.client, tmp_path) as (
        op,
        cloud,
        worker,
    ):
        job = training_job("mnist", 2, min_nodes=1, max_nodes=6)
        kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(job))
        # create, no worker yet: killed after the finalizer, after the start
        for step in ("finalizer-added", "workflow-started"):
            await op.crash_at(step)
        meta = resource(kubectl, "mnist")["metadata"]
        assert meta["finalizers"] == [FINALIZER]
        wid = workflow_id(NS, "mnist", meta["uid"])
        # before any worker runs it, the workflow carries the name that its nodes' tags, pods
        # and store carry: `spotrain gc` and `release` find the job by it
        started = await dev_env.client.get_workflow_handle(wid).describe()
        name = started.typed_search_attributes.get(attributes.JOB)
        assert name == job_name("mnist", meta["uid"]), started.typed_search_attributes
        async with worker():
            await op.crash_at("status-written")  # killed after the first status
            with op.running():
                up = await wait_for(
                    lambda: status(kubectl, "mnist").get("replicas") == 2, "2 nodes"
                )
                assert up and status(kubectl, "mnist")["phase"] == "Running"
            runs = [w async for w in dev_env.client.list_workflows(f'WorkflowId = "{wid}"')]
            # started once: one chain of runs (a long job continues as new), one still open
            assert [r.status for r in runs if r.status != CONTINUED] == [RUNNING], runs

            # scale: killed right after the update; a double would make 6 (max_nodes)
            kubectl("scale", "-n", NS, "trainingjob/mnist", "--replicas=4")
            await op.crash_at("scale-sent")
            with op.running():
                s = await wait_for(
                    lambda: (x := status(kubectl, "mnist")).get("replicas") == 4 and x, "4 nodes"
                )
                gen = resource(kubectl, "mnist")["metadata"]["generation"]
                assert s["target"] == 4 and s["observedGeneration"] == gen
                out = kubectl("get", "-n", NS, "tj/mnist").stdout.splitlines()[1].split()
                assert out[:4] == ["mnist", "Running", "4", "4"]

                # a ScaleIn by name removes exactly that worker
                victim = s["nodes"][1]["id"]
                scale_in = {
                    "apiVersion": API_VERSION,
                    "kind": "ScaleIn",
                    "metadata": {"name": "drop-one"},
                    "spec": {"trainingJob": "mnist", "workers": [victim]},
                }
                kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(scale_in))
                done = await wait_for(
                    lambda: outcome(kubectl, "drop-one", "scalein"),
                    "the ScaleIn's outcome",
                )
                assert done == "Succeeded"
                s = await wait_for(
                    lambda: (x := status(kubectl, "mnist")).get("replicas") == 3 and x, "3 nodes"
                )
                assert victim not in {n["id"] for n in s["nodes"]}

                # a ScaleOut with a timeout answers once its node came
                scale_out = {
                    "apiVersion": API_VERSION,
                    "kind": "ScaleOut",
                    "metadata": {"name": "add-one"},
                    "spec": {"trainingJob": "mnist", "count": 1, "timeoutSeconds": 60},
                }
                kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(scale_out))
                done = await wait_for(lambda: outcome(kubectl, "add-one", "scaleout"), "ScaleOut")
                said = resource(kubectl, "add-one", "scaleout")["status"]["message"]
                assert done == "Succeeded" and said == "scaled out: 4 nodes ready", said
                s = await wait_for(
                    lambda: (x := status(kubectl, "mnist")).get("replicas") == 4 and x, "4 nodes"
                )

                # a reclaim notice: the job shrinks, and the cluster hears of it as Events
                handle = dev_env.client.get_workflow_handle(wid)
                noticed = s["nodes"][0]["id"]
                await handle.signal("reclaim", {"node_id": noticed, "deadline": in_seconds(60)})
                await wait_for(
                    lambda: any(e["reason"] == "NodeGone" for e in events(kubectl, "mnist")),
                    "a NodeGone Event",
                )

        # delete with the worker down: the cancel is sent (killed right after), and the
        # finalizer stays while the job cannot release its nodes
        kubectl("delete", "-n", NS, "tj/mnist", "--wait=false")
        await op.crash_at("cancel-sent")
        with op.running():
            await wait_for(lambda: op.log().count(HOLDING) >= 2, "the finalizer held")
            assert resource(kubectl, "mnist") is not None and cloud.running()
        async with worker():  # back: it tears down; the finalizer comes off (killed after)
            await op.crash_at("finalizer-removed")
            assert resource(kubectl, "mnist") is None
            assert cloud.running() == []
            assert (await handle.describe()).status.name == "CANCELED"

    posted = events(kubectl, "mnist")
    assert all(e["involvedObject"]["uid"] == meta["uid"] for e in posted)
    # nothing posted twice: one Event per timeline entry (alike entries a moment apart, as a
    # shrink and a growth back at once may make, are two)
    kinds = Counter(
        (e["reason"], e["message"], e["metadata"].get("annotations", {}).get(TIMELINE_AT))
        for e in posted
    )
    assert kinds and max(kinds.values()) == 1, kinds
    reasons = {r for r, _, _ in kinds}
    assert {"NodeGone", "GenerationStarted", "ScaleIn", "ScaleOut", "Cancelled"} <= reasons
    assert any(e["type"] == "Warning" and e["reason"] == "NodeGone" for e in posted)
