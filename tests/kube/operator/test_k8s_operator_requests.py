"""The operator killed right after a ScaleIn, a ScaleOut and a `kubectl scale` reach it, before
it acts (it marked the request Pending) and after (the workflow took the update, the outcome
is not written yet), with the job continuing as new in between: the restarted operator sends
the update again under the same id, and the workflow answers it from its books. Each resize
happens once and every request ends Succeeded with the first answer. The apiserver's audit
log of that whole run shows the operator's ServiceAccount using every verb its ClusterRole
grants, and no other (least privilege: nothing granted for nothing).

Real: kube-apiserver with the CRDs, kubectl, the operator as a subprocess, the Temporal dev
server and the TrainingJob workflow; the cloud and the ranks are simulated (tests/jobs.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.k8s.crd import API_VERSION
from spotrain.workers.k8s.operator_status import workflow_id
from spotrain.workflows.job.state import JobStatus, TimelineEntry
from tests.jobs import continue_as_new_now, polled
from tests.kube.k8s_cluster import ControlPlane
from tests.kube.kube_support import ROOT, granted
from tests.kube.kubectl import Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture
from tests.kube.operator.operator_support import (
    NS,
    operator_with_simulated_worker,
    outcome,
    resource,
    status,
    training_job,
    wait_for,
)

JOB = "resized"
OPERATOR = "system:serviceaccount:spotrain:spotrain-operator"


def moved(size: int) -> Callable[[JobStatus], bool]:
    """The workflow's target is `size` (a queued resize moves it at the workflow's next turn)."""
    return lambda s: s.target_nodes == size


def request(kind: str, name: str, spec: dict[str, Any]) -> str:
    body = {
        "apiVersion": API_VERSION,
        "kind": kind,
        "metadata": {"name": name},
        "spec": {"trainingJob": JOB, **spec},
    }
    return yaml.safe_dump(body)


async def test_operator_killed_around_each_resize_across_continue_as_new(
    dev_env: WorkflowEnvironment, control_plane: ControlPlane, kubectl: Kubectl, tmp_path: Path
) -> None:
    control_plane.ensure_namespace(NS)
    mark = control_plane.audit_mark()
    with operator_with_simulated_worker(control_plane, kubectl, dev_env.client, tmp_path) as (
        op,
        cloud,
        worker,
    ):
        async with worker():
            job = training_job(JOB, 3, min_nodes=1, max_nodes=6)
            kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(job))
            with op.running():
                await wait_for(lambda: status(kubectl, JOB).get("replicas") == 3, "3 nodes", 120)
            uid = resource(kubectl, JOB)["metadata"]["uid"]
            handle = dev_env.client.get_workflow_handle(workflow_id(NS, JOB, uid))

            async def target() -> int:
                return (await handle.query("status", result_type=JobStatus)).target_nodes

            asks = [
                ("ScaleIn", "drop-one", {"count": 1}, 2, "scaling in by 1 node(s)"),
                ("ScaleOut", "add-two", {"count": 2, "timeoutSeconds": 60}, 4, "scaled out: 4"),
            ]
            for kind, name, spec, size, said in asks:
                before = await target()
                kubectl("apply", "-n", NS, "-f", "-", stdin=request(kind, name, spec))
                await op.crash_at(f"{kind.lower()}-pending")  # seen, not acted on
                assert outcome(kubectl, name, kind) is None and await target() == before
                await op.crash_at(f"{kind.lower()}-sent")  # acted on, outcome unwritten
                assert outcome(kubectl, name, kind) is None
                await polled(lambda: handle.query("status", result_type=JobStatus), moved(size))
                await continue_as_new_now(handle)
                with op.running():
                    done = await wait_for(lambda n=name, k=kind: outcome(kubectl, n, k), kind, 120)
                    shown = await wait_for(
                        lambda n=size: (s := status(kubectl, JOB)).get("replicas") == n and s,
                        f"{size} nodes",
                        120,
                    )
                message = resource(kubectl, name, kind)["status"]["message"]
                assert done == "Succeeded" and message.startswith(said), message
                assert shown["target"] == size == await target()

            # kubectl scale: killed after the update, the run continued as new, sent again
            kubectl("scale", "-n", NS, f"trainingjob/{JOB}", "--replicas=5")
            await op.crash_at("scale-sent")
            await continue_as_new_now(handle)
            with op.running():
                await wait_for(lambda: status(kubectl, JOB).get("replicas") == 5, "5 nodes", 120)
                assert await target() == 5
                kubectl("delete", "-n", NS, f"trainingjob/{JOB}", "--wait=false")
                await wait_for(lambda: resource(kubectl, JOB) is None, "the resource gone", 90)
            timeline = await handle.query("timeline", result_type=list[TimelineEntry])
    told = [e.event for e in timeline]
    assert told.count("scale in") == 1 and told.count("scale out") == 2, told
    assert cloud.running() == []
    calls = control_plane.requests(OPERATOR, mark)
    assert [r for r in calls if r.code == 403] == []
    used = {(r.verb, r.resource) for r in calls}
    assert used == granted(ROOT / "infra/k8s/operator-rbac.yaml", "spotrain-operator")
