"""Whole TrainingJobs on the Karpenter provider, against a real Karpenter controller on the real
apiserver (tests/kube/karpenter.py), with the worker's Karpenter notices (workers/
karpenter_notices.py) as the only notice path:

- a zone-bound job whose spec names no zone gets every NodeClaim required into one zone of the
  NodePool's, and its nodes all land there (issue 49); its run uses every verb the worker's
  Karpenter grant (infra/k8s/karpenter/rbac.yaml) gives, and no other, by the audit log;
- spot that Karpenter can no longer launch falls back to on-demand, and the job goes back to
  spot when spot returns; a NodeClaim deleted as Karpenter's interruption handling deletes it
  is a notice; cancel leaves no NodeClaim behind (the simulated runtime: no pods needed);
- with real ranks (`resize: live`, the example in every pod): the job grows onto NodeClaims, a
  deleted NodeClaim is a notice the survivors resize through live while a replacement claim
  comes, a node gone without a drain is a loss that costs at most one step, and it completes
  with no NodeClaim or pod left;
- the operator's TrainingJob through kubectl on this provider: applied, scaled, deleted, with
  no NodeClaim or pod left once the resource is gone.

Stood in for: the kubelet (tests/kube/kube_kubelet.py's LocalKubelet runs each pod's command
as a local process) and the node lifecycle controller (KarpenterNodes).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.kube_live import PORT_SPAN
from spotrain.workers import karpenter_notices as karpenter_notices_module
from spotrain.workers.embedded.stack import port_block
from spotrain.workers.k8s.operator_status import job_name
from spotrain.workers.karpenter_notices import KarpenterNotices
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.job.state import JobResult, JobStatus
from tests.elastic.test_control_channel import wait_status
from tests.elastic.test_live_resize import live_job_spec
from tests.elastic.test_local_runtime import WORKER
from tests.jobs import fast_runtime, fast_spec
from tests.kube.k8s_cluster import NAMESPACE, ControlPlane
from tests.kube.karpenter import RBAC, TYPES, ZONES, Karpenter, KarpenterNodes, provider
from tests.kube.kube_kubelet import LocalKubelet
from tests.kube.kube_support import WORKER as WORKER_SA
from tests.kube.kube_support import granted
from tests.kube.kubectl import Kubectl
from tests.kube.kubectl import kubectl_fixture as kubectl_fixture
from tests.kube.operator.operator_support import NS, operator, resource, wait_for
from tests.kube.operator.test_k8s_operator_kube import JOB as OPERATOR_JOB
from tests.kube.operator.test_k8s_operator_kube import on_deletion, trainingjob

GPUS, SPOT, ON_DEMAND = TYPES["g5.xlarge"]
SPOT_POLICY = {
    "instance_types": [
        {"name": "g5.xlarge", "gpus": 0, "on_demand_price": ON_DEMAND, "spot_price": SPOT}
    ],
    "zones": ["us-east-1a"],
}
GROUP = ("karpenter.sh", "v1", "nodeclaims")


@asynccontextmanager
async def karpenter_notices(temporal: Client, cluster: ControlPlane) -> AsyncIterator[None]:
    """The worker's notice watch, as the worker's ServiceAccount."""
    worker = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    stop = asyncio.Event()
    task = asyncio.create_task(KarpenterNotices(temporal, worker).run(stop))
    try:
        yield
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def interrupt(karpenter: Karpenter, claim: str) -> None:
    """What Karpenter's interruption controller does on a spot notice: delete the claim (its
    termination controller then drains and terminates the node)."""
    karpenter.custom.delete_cluster_custom_object(*GROUP, claim)


def lose(cluster: ControlPlane, karpenter: Karpenter, claim: str) -> None:
    """The instance vanishes without a drain: its Node and NodeClaim are gone at once."""
    core = client.CoreV1Api(cluster.admin)
    node = karpenter.claims()[claim]["status"]["nodeName"]
    for patch, delete, args in (
        (core.patch_node, core.delete_node, (node,)),
        (
            karpenter.custom.patch_cluster_custom_object,
            karpenter.custom.delete_cluster_custom_object,
            (*GROUP, claim),
        ),
    ):
        patch(*args, {"metadata": {"finalizers": None}})
        delete(*args)


def members(status: JobStatus) -> list[str]:
    return [n.node_id or "" for n in status.nodes if n.rank is not None]


def none_left(karpenter: Karpenter, job: str) -> Callable[[], bool]:
    return lambda: not karpenter.claims(f"spotrain.io/job={job}")


async def until_true(check: Callable[[], bool], timeout: float) -> None:
    """`check` (an API call: in a thread, off the worker's event loop) until it holds."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.1)


def required_zones(claim: dict[str, Any]) -> list[str]:
    """The zones a NodeClaim requires ([] for none: Karpenter's pick)."""
    return [
        zone
        for r in claim["spec"]["requirements"]
        if r["key"] == "topology.kubernetes.io/zone" and r["operator"] == "In"
        for zone in r["values"]
    ]


async def test_a_zone_bound_job_without_zones_keeps_its_first_nodeclaims_in_one_zone(
    dev_env: WorkflowEnvironment,
    cluster: ControlPlane,
    karpenter: Karpenter,
    nodes: KarpenterNodes,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`placement: zone` (the default) and no `spot.zones`: the provider offers the NodePool's
    zones, the job picks one home, and its first generation's claims all require it."""
    # A watch is in the audit log once it ends: short ones, so the notices' shows up.
    monkeypatch.setattr(karpenter_notices_module, "WATCH_S", 1)
    spec = fast_spec(total_steps=10**6, spot=dict(SPOT_POLICY, zones=[]))
    spec["elastic"] |= {"min_nodes": 3, "max_nodes": 3}
    name, queue = spec["name"], uuid.uuid4().hex
    mark = cluster.audit_mark()
    with ThreadPoolExecutor(16) as pool:
        async with (
            workflow_worker(
                dev_env.client,
                queue,
                provider(cluster).activities() + fast_runtime().activities(),
                activity_executor=pool,
            ),
            karpenter_notices(dev_env.client, cluster),
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob", spec, id=name, task_queue=queue, result_type=JobResult
            )
            status = await wait_status(handle, lambda s: s.world_size == 3, 120)
            claims = await asyncio.to_thread(karpenter.claims, f"spotrain.io/job={name}")
            core = client.CoreV1Api(cluster.admin)
            landed = {
                c["metadata"]["name"]: core.read_node(c["status"]["nodeName"]).metadata.labels[
                    "topology.kubernetes.io/zone"
                ]
                for c in claims.values()
            }
            await handle.cancel()
            await wait_status(handle, lambda s: s.phase == "Cancelled", 60)
            await until_true(none_left(karpenter, name), 60)
    # Three slots; a slot may hold a second attempt (s0-a2 beside s0-a1: its first launch was
    # slow to come up, in a run at four test processes beside two busy loops), which must
    # keep to the zone as well.
    slots = {n.rsplit("-", 1)[0] for n in claims}
    assert status.generation == 1 and len(slots) == 3, (status.generation, sorted(claims))
    required = {n: required_zones(c) for n, c in claims.items()}
    home = next(iter(landed.values()))
    assert home in ZONES and required == {n: [home] for n in claims}, required
    assert landed == {n: home for n in claims}, landed
    assert {n.zone for n in status.nodes if n.rank is not None} == {home}
    # The worker's Karpenter grant, every verb of it in use and no other (get on its NodePool
    # for the zones; nodes are listed under infra/k8s/rbac.yaml's node reader).
    requests = await asyncio.to_thread(cluster.requests, WORKER_SA, mark)
    assert [r for r in requests if r.code == 403] == []
    used = {(r.verb, r.resource) for r in requests if r.resource in ("nodeclaims", "nodepools")}
    assert used == granted(RBAC, "spotrain-nodeclaims")


async def test_spot_refused_falls_back_to_on_demand_and_returns_to_spot(
    dev_env: WorkflowEnvironment, cluster: ControlPlane, karpenter: Karpenter, nodes: KarpenterNodes
) -> None:
    spec = fast_spec(total_steps=10**6, spot=SPOT_POLICY)
    spec["elastic"] |= {"min_nodes": 1, "max_nodes": 2}
    name, queue = spec["name"], uuid.uuid4().hex
    nodeclaims = provider(cluster, launch_timeout_s=8)  # (Ready takes ~1 s, more when busy)
    with ThreadPoolExecutor(16) as pool:
        async with (
            workflow_worker(
                dev_env.client,
                queue,
                nodeclaims.activities() + fast_runtime().activities(),
                activity_executor=pool,
            ),
            karpenter_notices(dev_env.client, cluster),
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob", spec, id=name, task_queue=queue, result_type=JobResult
            )
            on_spot = await wait_status(handle, lambda s: s.world_size == 2, 60)
            assert {n.lifecycle for n in on_spot.nodes if n.rank is not None} == {"spot"}
            await asyncio.to_thread(karpenter.offer_spot, False)  # spot runs out...
            interrupted = members(on_spot)[1]
            # ...and Karpenter's interruption queue says so
            await asyncio.to_thread(interrupt, karpenter, interrupted)

            def with_on_demand(s: JobStatus) -> bool:
                kinds = [n.lifecycle for n in s.nodes if n.rank is not None]
                return s.world_size == 2 and "on-demand" in kinds

            fallback = await wait_status(handle, with_on_demand, 90)
            await asyncio.to_thread(karpenter.offer_spot, True)

            def all_spot(s: JobStatus) -> bool:
                ready = [n for n in s.nodes if n.state == "ready"]
                return s.world_size == 2 and all(n.lifecycle == "spot" for n in ready)

            back = await wait_status(handle, all_spot, 90)
            await handle.cancel()
            await wait_status(handle, lambda s: s.phase == "Cancelled", 60)
            await until_true(none_left(karpenter, name), 60)
    timeline = "\n".join(f"{e.event}: {e.detail}" for e in back.timeline)
    assert interrupted not in members(fallback), timeline
    assert f"reclaim notice for {interrupted}" in timeline, timeline  # (through Karpenter)
    on_demand = next(n for n in fallback.nodes if n.lifecycle == "on-demand" and n.rank is not None)
    assert "swapped back to spot" in timeline and on_demand.node_id in timeline, timeline
    assert fallback.generation < back.generation
    assert back.cost["on-demand"] > 0


async def test_a_live_job_on_nodeclaims_through_a_notice_and_a_loss(
    dev_env: WorkflowEnvironment, cluster: ControlPlane, karpenter: Karpenter, tmp_path: Path
) -> None:
    name = f"karp-{uuid.uuid4().hex[:8]}"
    spec = live_job_spec(name, tmp_path, image="ghcr.io/example/train:1", spot=SPOT_POLICY)
    core = client.CoreV1Api(cluster.admin)
    worker_sa = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    kubelet = LocalKubelet(core, NAMESPACE, tmp_path / "kubelet")
    with (
        port_block(PORT_SPAN) as rendezvous,  # every pod here shares this machine's network
        kubelet.serving(),
        KarpenterNodes(cluster, kubelet).serving(),
        ThreadPoolExecutor(16) as pool,
    ):
        runtime = KubeRuntime(
            NAMESPACE, worker_sa, master_port=rendezvous, gang_timeout_s=60, watch_s=1
        )
        activities: list[Any] = provider(cluster).activities() + runtime.activities()
        async with (
            workflow_worker(dev_env.client, name, activities, activity_executor=pool),
            karpenter_notices(dev_env.client, cluster),
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob", spec, id=name, task_queue=name, result_type=JobResult
            )
            status = await wait_status(handle, lambda s: s.world_size == 3 and s.step > 10, 120)
            first = status.generation
            noticed = members(status)[-1]
            await asyncio.to_thread(interrupt, karpenter, noticed)
            status = await wait_status(
                handle, lambda s: s.generation >= first + 2 and s.world_size == 3, 120
            )
            grown = status.step
            status = await wait_status(handle, lambda s: s.step > grown + 10, 60)
            lost = members(status)[0]
            await asyncio.to_thread(lose, cluster, karpenter, lost)
            result = await asyncio.wait_for(handle.result(), 240)
        await until_true(none_left(karpenter, name), 60)
        deadline = time.monotonic() + 60
        selector = f"spotrain.io/job={name}"
        while left := core.list_namespaced_pod(NAMESPACE, label_selector=selector).items:
            assert time.monotonic() < deadline, [p.metadata.name for p in left]
            await asyncio.sleep(0.2)
    timeline = [(e.generation, e.event, e.detail) for e in result.timeline]
    told = "\n".join(map(str, timeline))
    assert any(f"reclaim notice for {noticed}" in e[2] for e in timeline), told
    gone = [e[2] for e in timeline if e[1] == "node gone"]
    assert any(noticed in g for g in gone) and any(lost in g for g in gone), told
    assert result.steps_done == 1200 and result.steps_lost <= 1, result
    parked = [e for e in timeline if e[1] == "generation parked (live resize)"]
    assert parked, told  # the survivors resized live (no restart from a checkpoint)
    assert kubelet.running == {}


async def test_kubectl_drives_a_training_job_on_nodeclaims(
    dev_env: WorkflowEnvironment,
    cluster: ControlPlane,
    karpenter: Karpenter,
    kubectl: Kubectl,
    tmp_path: Path,
) -> None:
    (tmp_path / "worker.py").write_text(WORKER)
    cluster.ensure_namespace(NS)
    core = client.CoreV1Api(cluster.admin)
    worker_sa = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    runtime = KubeRuntime(NAMESPACE, worker_sa, gang_timeout_s=60, watch_s=1, ack_poll_s=0.1)
    kubelet = LocalKubelet(core, NAMESPACE, tmp_path / "kubelet")
    queue = uuid.uuid4().hex
    with (
        operator(cluster, kubectl, dev_env.client, queue, tmp_path) as op,
        kubelet.serving(),
        KarpenterNodes(cluster, kubelet).serving(),
        ThreadPoolExecutor(16) as pool,
    ):
        activities = provider(cluster).activities() + runtime.activities()
        async with (
            workflow_worker(dev_env.client, queue, activities, activity_executor=pool),
            karpenter_notices(dev_env.client, cluster),
        ):
            with op.running():
                body = trainingjob(tmp_path, 2)
                body["spec"]["spot"] = SPOT_POLICY
                kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(body))
                uid = resource(kubectl, OPERATOR_JOB)["metadata"]["uid"]
                job = job_name(OPERATOR_JOB, uid)
                selector = f"spotrain.io/managed=true,spotrain.io/job={job}"

                def running(size: int) -> list[str] | None:
                    """The job's NodeClaims once `size` rank pods run, one on each."""
                    found = kubectl.json("get", "pods", "-n", NAMESPACE, "-l", selector)["items"]
                    up = [p for p in found if p["status"].get("phase") == "Running"]
                    claims = karpenter.claims(f"spotrain.io/job={job}")
                    nodes = {c.get("status", {}).get("nodeName") for c in claims.values()}
                    if len(up) != size or len(claims) != size:
                        return None
                    return sorted(claims) if {p["spec"]["nodeName"] for p in up} == nodes else None

                await wait_for(lambda: running(2), "2 ranks on 2 NodeClaims", 120)
                kubectl("scale", "-n", NS, f"trainingjob/{OPERATOR_JOB}", "--replicas=3")
                await wait_for(lambda: running(3), "3 ranks on 3 NodeClaims", 120)

                def leftovers() -> dict[str, list[str]]:
                    pods = core.list_namespaced_pod(NAMESPACE, label_selector=selector).items
                    live = {
                        name
                        for name, c in karpenter.claims(f"spotrain.io/job={job}").items()
                        if not c["metadata"].get("deletionTimestamp")
                    }
                    return {"pods": [p.metadata.name for p in pods], "claims": sorted(live)}

                version = resource(kubectl, OPERATOR_JOB)["metadata"]["resourceVersion"]
                with ThreadPoolExecutor(1) as one:
                    gone = one.submit(on_deletion, cluster.admin, OPERATOR_JOB, version, leftovers)
                    kubectl("delete", "-n", NS, f"trainingjob/{OPERATOR_JOB}", "--wait=false")
                    left = await asyncio.wait_for(asyncio.wrap_future(gone), 120)
                # every claim released by then; Karpenter finishes terminating them
                assert left == {"pods": [], "claims": []}
                await until_true(none_left(karpenter, job), 60)
    assert kubelet.running == {}
