"""The Kubernetes rank runtime against a real control plane (tests/kube/k8s_cluster.py): etcd,
kube-apiserver with RBAC, kube-scheduler and kwok, built from their Go modules.

The runtime authenticates as the `spotrain-worker` ServiceAccount that infra/k8s/rbac.yaml
binds, with a token from the TokenRequest API: a verb missing from its Role fails these tests.
What each test checks of the runtime's requests comes from the apiserver's audit log. Pods on
kwok's nodes turn Running and Ready without running anything; the test plays the kubelet's
part where a pod's containers must exit or fail (tests/kube/kube_kubelet.py, labelled there).
Activities run in temporalio's ActivityEnvironment (real heartbeats); the checkpoint store is
real files under tmp_path. The last test alone runs on the in-process double
(tests/kube/kube_double.py), for the kubelet's downwardAPI refresh, which cannot run here.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from temporalio import workflow
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from spotrain.activities.kube import KubeRuntime
from spotrain.elastic.job_store import JobStore
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    CleanupRequest,
    GenerationPlan,
    WatchRequest,
    WatchResult,
)
from tests.kube.k8s_cluster import ControlPlane, Request
from tests.kube.kube_double import KubeDouble
from tests.kube.kube_kubelet import finish_pod, hold_pod, start_pod
from tests.kube.kube_support import (  # noqa: F401 (fixtures)
    JOB,
    NS,
    SPOT_TAINT,
    ack_on_stop,
    add_nodes,
    audit_fixture,
    bound,
    ckpt_fixture,
    core_fixture,
    deletes,
    env_of,
    in_thread,
    kube_fixture,
    plan_for,
    pods,
    run,
    runtime_fixture,
    stop_request,
    wait_until,
    worker_client_fixture,
)


def test_gang_start_waits_for_every_pod_ready(
    cluster: ControlPlane, core: client.CoreV1Api, worker_client: client.ApiClient, ckpt: str
) -> None:
    add_nodes(cluster, fake=False)  # no kwok: this test starts the containers itself
    runtime = KubeRuntime(NS, worker_client, gang_timeout_s=30, watch_s=4)
    started = in_thread(runtime.start_generation, plan_for(ckpt))
    wait_until(lambda: all(bound(core, f"mnist-g1-{i}") for i in range(3)))
    start_pod(core, NS, "mnist-g1-0")
    start_pod(core, NS, "mnist-g1-1")
    time.sleep(0.5)
    assert not started.done(), "returned before the whole gang was Ready"
    assert not JobStore(ckpt).started(1), "ranks let go before the whole gang was Ready"
    start_pod(core, NS, "mnist-g1-2")
    t0 = time.monotonic()
    started.result(timeout=10)
    latency = time.monotonic() - t0
    assert latency < 3, f"the watch should wake at once, not after watch_s=4 ({latency:.2f}s)"
    assert JobStore(ckpt).started(1)  # the training library's wait_for_gang now returns

    found = pods(core)
    assert sorted(found) == ["mnist-g1-0", "mnist-g1-1", "mnist-g1-2"]
    pod = found["mnist-g1-1"]
    assert pod.metadata.labels == {
        "spotrain.io/managed": "true",
        "spotrain.io/job": JOB,
        "spotrain.io/generation": "1",
        "spotrain.io/rank": "1",
        "topology.kubernetes.io/zone": "us-east-1a",  # copied from the node at binding
    }
    assert pod.spec.node_name == "ip-10-0-0-2"  # bound by kube-scheduler: i-0bbb's node
    assert pod.spec.node_selector == {"kubernetes.io/hostname": "ip-10-0-0-2"}
    assert pod.spec.containers[0].image == "ghcr.io/example/train:1"
    env = env_of(pod)
    assert env["WORLD_SIZE"] == "3" and env["RANK"] == "1" and env["NODE_RANK"] == "1"
    assert env["MASTER_ADDR"] == "mnist-g1-0.spotrain-mnist.spotrain-jobs.svc"
    assert env["SPOTRAIN_CONTROL_FILE"] == "/etc/spotrain/control"
    svc = core.read_namespaced_service("spotrain-mnist", NS)
    assert svc.spec.cluster_ip == "None" and svc.spec.publish_not_ready_addresses
    assert svc.spec.selector == {"spotrain.io/job": JOB}
    assert pod.spec.hostname == "mnist-g1-1" and pod.spec.subdomain == "spotrain-mnist"
    # /dev/shm is a memory volume, not the container's 64 MB: the background checkpoint
    # stages the state there (checkpoint_writer.py)
    shm = next(m for m in pod.spec.containers[0].volume_mounts if m.mount_path == "/dev/shm")
    volume = next(v for v in pod.spec.volumes if v.name == shm.name)
    assert volume.empty_dir.medium == "Memory"


def test_multi_process_node_runs_once_with_local_world_size(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    plan = plan_for(ckpt, nodes=2, gpus_per_proc=1)
    plan.members[0].procs = 4
    plan.members[1].procs = 4
    run(runtime.start_generation, plan)
    pod = core.read_namespaced_pod("mnist-g1-1", NS)
    env = env_of(pod)
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"]) == ("8", "4", "0")
    assert env["LOCAL_WORLD_SIZE"] == "4"
    assert pod.spec.containers[0].resources.limits == {"nvidia.com/gpu": "4"}
    assert pod.spec.node_name == "ip-10-0-0-2"  # the scheduler found 4 GPUs free there


def test_gang_timeout_rolls_back_and_names_stuck_pods(
    cluster: ControlPlane, core: client.CoreV1Api, worker_client: client.ApiClient, ckpt: str
) -> None:
    cluster.add_node("ip-10-0-0-1", "i-0aaa", taints=[SPOT_TAINT])
    cluster.add_node("ip-10-0-0-2", "i-0bbb", taints=[SPOT_TAINT], fake=False)
    cluster.add_node("ip-10-0-0-3", "i-0ccc", taints=[{"key": "gpu", "effect": "NoSchedule"}])
    runtime = KubeRuntime(NS, worker_client, gang_timeout_s=6, watch_s=1)

    def kubelet_cannot_pull() -> None:  # the kubelet of ip-10-0-0-2, stood in for
        wait_until(lambda: bound(core, "mnist-g1-1"))
        hold_pod(core, NS, "mnist-g1-1", "ErrImagePull", "registry unreachable")

    threading.Thread(target=kubelet_cannot_pull, daemon=True).start()
    beats: list[float] = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *_: beats.append(time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(ApplicationError) as info:
        env.run(runtime.start_generation, plan_for(ckpt))
    took = time.monotonic() - t0
    assert 6 <= took < 12, took
    gaps = [b - a for a, b in zip([t0, *beats], [*beats, t0 + took], strict=True)]
    assert max(gaps) < 3, f"heartbeats about every watch_s=1s, got gaps {gaps}"
    msg = str(info.value)
    assert info.value.type == "GangStartError"
    assert "mnist-g1-0" not in msg  # it was Running and Ready
    assert "mnist-g1-1 (Pending, ErrImagePull: registry unreachable)" in msg
    # the real scheduler's own words
    assert "mnist-g1-2 (Pending, Unschedulable: 0/3 nodes are available" in msg
    assert "untolerated taint" in msg
    assert pods(core) == {}  # grace 0: gone at once
    assert not JobStore(ckpt).started(1)  # a rolled-back gang never lets its ranks go


def test_node_that_never_joins_fails_the_gang(
    kube: ControlPlane,
    worker_client: client.ApiClient,
    audit: Callable[[], list[Request]],
    ckpt: str,
) -> None:
    runtime = KubeRuntime(NS, worker_client, gang_timeout_s=1, watch_s=1)
    plan = plan_for(ckpt, nodes=1)
    plan.members[0].node_id = "i-0fff"
    with pytest.raises(ApplicationError, match=r"i-0fff'\] did not join the cluster"):
        run(runtime.start_generation, plan)
    assert not [r for r in audit() if r.verb == "create" and r.resource == "pods"]


def test_retried_create_is_idempotent(
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    audit: Callable[[], list[Request]],
    ckpt: str,
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    uids = {n: p.metadata.uid for n, p in pods(core).items()}
    run(runtime.start_generation, plan_for(ckpt))  # e.g. the worker crashed before completing
    assert {n: p.metadata.uid for n, p in pods(core).items()} == uids
    creates = [r.code for r in audit() if r.verb == "create" and r.resource == "pods"]
    assert creates == [201] * 3 + [409] * 3  # the retry's creates answered AlreadyExists
    services = [r.code for r in audit() if r.verb == "create" and r.resource == "services"]
    assert services == [201, 409]


def test_a_pod_found_made_differently_is_replaced(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    """A pod under a generation's name is kept only if the start would make it the same
    (a head start's): one made from another plan (here another image) is made again."""
    run(runtime.start_generation, plan_for(ckpt))
    old = {n: p.metadata.uid for n, p in pods(core).items()}
    run(runtime.start_generation, plan_for(ckpt, image="ghcr.io/example/train:2"))
    new = pods(core)
    assert new.keys() == old.keys()
    assert all(new[n].metadata.uid != uid for n, uid in old.items())
    assert {p.spec.containers[0].image for p in new.values()} == {"ghcr.io/example/train:2"}


def test_missing_image_is_a_config_error(runtime: KubeRuntime, ckpt: str) -> None:
    with pytest.raises(ApplicationError) as info:
        run(runtime.start_generation, plan_for(ckpt, image=None))
    assert info.value.type == contract.CONFIG_ERROR and info.value.non_retryable


def test_server_side_validation_is_a_config_error_naming_the_field(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    """The job's env is the user's: a name Kubernetes refuses fails the job, non-retryable,
    with the apiserver's reason (the field and the rule), not a bare status code."""
    with pytest.raises(ApplicationError) as info:
        run(runtime.start_generation, plan_for(ckpt, env={"BAD=NAME": "1"}))
    assert info.value.type == contract.CONFIG_ERROR and info.value.non_retryable
    assert "422" in str(info.value)
    assert "spec.containers[0].env[0].name" in str(info.value)
    assert pods(core) == {}


def test_graceful_stop_raises_event_waits_for_acks_then_deletes_with_grace(
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    audit: Callable[[], list[Request]],
    ckpt: str,
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    assert pods(core)["mnist-g1-0"].metadata.annotations.get("spotrain.io/control") is None
    JobStore(ckpt).write_latest_checkpoint(40, "ckpt/step-40")
    ack_on_stop(core, ckpt, {"mnist-g1-0": [0], "mnist-g1-1": [1], "mnist-g1-2": [2]})
    t0 = time.monotonic()
    result = run(runtime.stop_generation, stop_request(ckpt, grace_s=10))
    took = time.monotonic() - t0
    assert result.acked_ranks == [0, 1, 2] and not result.forced
    assert result.checkpoint_step == 40
    assert took < 8, f"should stop once all acked, not after the grace period ({took:.1f}s)"
    assert sorted(deletes(audit())) == [(f"mnist-g1-{i}", "10") for i in range(3)]
    patched = {r.name for r in audit() if r.verb == "patch" and r.resource == "pods"}
    assert patched == {"mnist-g1-0", "mnist-g1-1", "mnist-g1-2"}
    assert pods(core, "spotrain.io/generation=1") == {}


def test_grace_period_is_honoured_for_a_pod_that_does_not_exit(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    """kwok's pods never exit on their own: deleted with 3 s of grace, they stay Terminating
    for those 3 s (as a container ignoring SIGTERM would) and stop_generation waits for it."""
    run(runtime.start_generation, plan_for(ckpt, nodes=1))
    t0 = time.monotonic()
    result = run(runtime.stop_generation, stop_request(ckpt, world_size=1, grace_s=1.2))
    took = time.monotonic() - t0
    assert result.forced and result.acked_ranks == []
    # 1.2 s for acks, then 2 s of grace (ceil of 1.2), less up to 1 s: deletionTimestamp is
    # kept to the second
    assert 1.2 + 1 <= took < 20, took
    assert pods(core) == {}


def test_stop_forces_ranks_that_do_not_ack(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    ack_on_stop(core, ckpt, {"mnist-g1-0": [0]})
    t0 = time.monotonic()
    result = run(runtime.stop_generation, stop_request(ckpt, grace_s=1))
    assert time.monotonic() - t0 >= 1
    assert result.acked_ranks == [0] and result.forced


def test_not_graceful_stop_deletes_at_once(
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    audit: Callable[[], list[Request]],
    ckpt: str,
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    result = run(runtime.stop_generation, stop_request(ckpt, graceful=False, grace_s=30))
    assert result.forced and result.acked_ranks == []
    assert sorted(deletes(audit())) == [(f"mnist-g1-{i}", "0") for i in range(3)]
    assert not [r for r in audit() if r.verb == "patch" and r.resource == "pods"]
    assert pods(core) == {}
    # stopping again (a retry) finds nothing and succeeds
    assert not run(runtime.stop_generation, stop_request(ckpt, graceful=False, grace_s=30)).forced


def test_lost_node_pods_go_at_once_the_rest_gracefully(
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    audit: Callable[[], list[Request]],
    ckpt: str,
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    ack_on_stop(core, ckpt, {"mnist-g1-0": [0], "mnist-g1-2": [2]})
    result = run(runtime.stop_generation, stop_request(ckpt, lost_node_ids=["i-0bbb"]))
    sent = deletes(audit())
    assert sent[0] == ("mnist-g1-1", "0")
    assert sorted(sent[1:]) == [("mnist-g1-0", "5"), ("mnist-g1-2", "5")]
    patched = {r.name for r in audit() if r.verb == "patch" and r.resource == "pods"}
    assert "mnist-g1-1" not in patched
    assert result.acked_ranks == [0, 2] and not result.forced


def test_pods_on_a_vanished_node_are_lost_without_being_named(
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    audit: Callable[[], list[Request]],
    ckpt: str,
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    core.delete_node("ip-10-0-0-1")
    ack_on_stop(core, ckpt, {"mnist-g1-1": [1], "mnist-g1-2": [2]})
    result = run(runtime.stop_generation, stop_request(ckpt, grace_s=5))
    assert deletes(audit())[0] == ("mnist-g1-0", "0")
    assert result.acked_ranks == [1, 2] and not result.forced


@workflow.defn
class KubeProbe:
    """Calls the runtime's activities by their contract names, as TrainingJob does."""

    @workflow.run
    async def run(self, plan: GenerationPlan) -> WatchResult:
        opts: dict[str, Any] = {
            "start_to_close_timeout": timedelta(seconds=60),
            "heartbeat_timeout": timedelta(seconds=10),
        }
        await workflow.execute_activity(contract.START_GENERATION, plan, **opts)
        watch = WatchRequest(
            job=plan.job,
            generation=plan.generation,
            world_size=plan.world_size,
            checkpoint=plan.checkpoint,
            report_after_s=30,
        )
        result = await workflow.execute_activity(
            contract.WATCH_GENERATION, watch, result_type=WatchResult, **opts
        )
        await workflow.execute_activity(contract.CLEANUP_JOB, CleanupRequest(job=plan.job), **opts)
        return result


async def pending_activities(handle: WorkflowHandle[Any, Any]) -> list[str]:
    desc = await handle.describe()
    return [a.activity_type.name for a in desc.raw_description.pending_activities]


async def test_activities_run_in_a_temporal_worker(
    dev_env: WorkflowEnvironment,
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    ckpt: str,
) -> None:
    """Registration, the pydantic data converter and the thread pool, on the real dev server."""
    queue = uuid.uuid4().hex
    with ThreadPoolExecutor(4) as pool:
        async with Worker(
            dev_env.client,
            task_queue=queue,
            workflows=[KubeProbe],
            activities=runtime.activities(),
            activity_executor=pool,
            workflow_runner=UnsandboxedWorkflowRunner(),
        ):
            handle = await dev_env.client.start_workflow(
                KubeProbe.run, plan_for(ckpt), id=queue, task_queue=queue
            )
            while contract.WATCH_GENERATION not in await pending_activities(handle):
                await asyncio.sleep(0.05)
            JobStore(ckpt).write_done(step=100, time=time.time())
            for i in range(3):
                await asyncio.to_thread(finish_pod, core, NS, f"mnist-g1-{i}", 0)
            result = await asyncio.wait_for(handle.result(), 30)
    assert result.outcome == "completed"
    assert pods(core) == {} and core.list_namespaced_service(NS).items == []


def test_the_control_annotation_reaches_the_library_through_the_downward_api(
    tmp_path: Path, ckpt: str
) -> None:
    """On tests/kube/kube_double.py, for the one step the real control plane here cannot take:
    the kubelet's downwardAPI refresh, which turns the pod's `spotrain.io/control` annotation
    into the file the training library polls. The double renders the pod's volume item as the
    kubelet would; the real library, in its own process with the pod's environment, reads it."""
    double = KubeDouble()
    with double.serve():
        double.add_node("ip-10-0-0-1", "i-0aaa")
        runtime = KubeRuntime(NS, double.api_client(), gang_timeout_s=5, ack_poll_s=0.05)
        run(runtime.start_generation, plan_for(ckpt, nodes=1))
        pod = double.get("pods", NS, "mnist-g1-0")
        assert pod is not None
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        control = tmp_path / env["SPOTRAIN_CONTROL_FILE"].lstrip("/")
        control.parent.mkdir(parents=True)

        def rank_sees_event() -> bool:
            control.write_text(double.projected_file(NS, "mnist-g1-0", "control"))  # kubelet
            probe = "from spotrain import elastic; print(elastic.elastic_event_detected())"
            local = env | {"SPOTRAIN_CONTROL_FILE": str(control)}
            out = subprocess.run(
                [sys.executable, "-c", probe], env=os.environ | local, capture_output=True
            )
            return out.stdout.strip() == b"True"

        assert not rank_sees_event()
        # The rank's probe is a Python start-up (seconds under load): the stop's grace must
        # not run out first, or it deletes the pod before the probe reads it. It returns at
        # the ack, so a long grace costs nothing.
        stop = stop_request(ckpt, world_size=1, grace_s=120)
        stopping = in_thread(runtime.stop_generation, stop)
        wait_until(rank_sees_event, timeout=120)
        JobStore(ckpt).write_ack(1, 0, step=40, time=time.time())
        assert stopping.result(timeout=10).acked_ranks == [0]
