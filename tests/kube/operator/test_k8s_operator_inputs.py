"""The operator (in this process, as its ServiceAccount) on resources a careless user
writes: a name longer than a label allows, and a spec the operator refuses that is then
fixed. No worker runs: the workflow is started, not driven."""

from __future__ import annotations

import asyncio
import json

from temporalio.testing import WorkflowEnvironment

from spotrain.workers.k8s.operator import Operator
from spotrain.workers.k8s.operator_status import job_name, workflow_id
from tests.kube.k8s_cluster import ROOT, ControlPlane
from tests.kube.kubectl import Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture
from tests.kube.operator.test_k8s_crd import apply, example
from tests.kube.operator.test_k8s_crd import ns_fixture as ns_fixture


def as_operator(plane: ControlPlane, kubectl: Kubectl, temporal: object) -> Operator:
    kubectl("apply", "-f", str(ROOT / "infra/k8s/operator-rbac.yaml"))
    kubeconfig = plane.service_account_kubeconfig("spotrain-operator")
    return Operator(ControlPlane.api_client(kubeconfig), temporal, "nobody")  # type: ignore[arg-type]


async def test_a_trainingjob_with_a_long_name_gets_its_events(
    control_plane: ControlPlane, kubectl: Kubectl, ns: str
) -> None:
    """A 70-character name (the apiserver allows 253): its Events carry the job's label as its
    pods do (a DNS label of at most 50), so none fails the 63-character label limit (every
    Event post failed, and the finalizer waited on them: the job could not be deleted)."""
    name = "a" * 70
    assert apply(kubectl, ns, example(name))[0] == 0
    job = kubectl.json("get", "-n", ns, f"trainingjob/{name}")
    op = as_operator(control_plane, kubectl, None)
    await op._event(job, "Normal", "Submitted", "the workflow started", "submitted")
    events = kubectl.json("get", "events", "-n", ns, f"--field-selector=involvedObject.name={name}")
    (event,) = events["items"]
    assert event["metadata"]["labels"]["spotrain.io/job"] == job_name(name, job["metadata"]["uid"])


async def test_an_invalid_trainingjob_is_read_again_once_its_spec_is_fixed(
    control_plane: ControlPlane, kubectl: Kubectl, ns: str, dev_env: WorkflowEnvironment
) -> None:
    """A spec the CRD takes but the job spec refuses (a deadline past 2100) is Invalid for its
    generation; an edit of the spec (a new generation) is read again and the job starts (it
    stayed Invalid for ever)."""
    op = as_operator(control_plane, kubectl, dev_env.client)
    doc = example("fixable")
    doc["spec"]["deadline"] = {"at": "9999-01-01T00:00:00Z"}
    assert apply(kubectl, ns, doc)[0] == 0

    def status() -> dict[str, object]:
        return kubectl.json("get", "-n", ns, "trainingjob/fixable").get("status") or {}

    for _ in range(2):  # the finalizer, then the spec
        await op.reconcile_all()
    assert status()["phase"] == "Invalid" and "2100" in str(status()["message"]), status()
    await op.reconcile_all()
    assert status()["phase"] == "Invalid"  # the same generation: not read again
    doc["spec"]["deadline"] = {"at": "2099-01-01T00:00:00Z"}
    assert apply(kubectl, ns, doc)[0] == 0
    await op.reconcile_all()
    job = kubectl.json("get", "-n", ns, "trainingjob/fixable")
    meta = job["metadata"]
    handle = dev_env.client.get_workflow_handle(workflow_id(ns, "fixable", meta["uid"]))
    try:
        assert (await handle.describe()).id == handle.id  # started
        assert job["status"]["phase"] == "Pending", job["status"]
    finally:
        await handle.terminate()


async def test_a_scale_request_for_a_job_whose_workflow_is_gone_fails_once(
    control_plane: ControlPlane, kubectl: Kubectl, ns: str, dev_env: WorkflowEnvironment
) -> None:
    """A ScaleOut for a TrainingJob whose workflow does not exist (never started, or ended and
    gone): Failed, saying so, instead of Pending for ever with a Temporal call per resync."""
    op = as_operator(control_plane, kubectl, dev_env.client)
    assert apply(kubectl, ns, example("no-workflow"))[0] == 0
    out = {
        "apiVersion": "spotrain.io/v1alpha1",
        "kind": "ScaleOut",
        "metadata": {"name": "more"},
        "spec": {"trainingJob": "no-workflow", "count": 1},
    }
    assert apply(kubectl, ns, out)[0] == 0
    for kind in ("ScaleIn", "ScaleOut"):
        for req in op._list(f"{kind.lower()}s")["items"]:
            if req["metadata"]["namespace"] == ns:
                op._start_request(kind, req)
    await asyncio.gather(*op.requests.values())
    status = kubectl.json("get", "-n", ns, "scaleout/more")["status"]
    assert status["phase"] == "Failed" and "no workflow" in status["message"], status


async def test_the_status_is_output_not_memory(
    control_plane: ControlPlane, kubectl: Kubectl, ns: str, dev_env: WorkflowEnvironment
) -> None:
    """A valid resource whose status says Invalid for its very generation (written by hand, or
    left by an older operator): the spec decides, and its job starts (the operator used to take
    the status at its word and skip the resource for ever)."""
    op = as_operator(control_plane, kubectl, dev_env.client)
    assert apply(kubectl, ns, example("trusted"))[0] == 0
    await op.reconcile_all()  # the finalizer
    job = kubectl.json("get", "-n", ns, "trainingjob/trusted")
    forged = {"status": {"phase": "Invalid", "observedGeneration": job["metadata"]["generation"]}}
    kubectl(
        "patch",
        "-n",
        ns,
        "trainingjob/trusted",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(forged),
    )
    await op.reconcile_all()
    handle = dev_env.client.get_workflow_handle(workflow_id(ns, "trusted", job["metadata"]["uid"]))
    try:
        assert (await handle.describe()).id == handle.id  # started
        status = kubectl.json("get", "-n", ns, "trainingjob/trusted")["status"]
        assert status["phase"] == "Pending", status
    finally:
        await handle.terminate()
