"""The Kubernetes worker runtime against an HTTP double of the kube-apiserver.

No kube-apiserver can run on these machines, so tests/kube_double.py stands in for it (and
for the scheduler and kubelet): the runtime talks to it with the real `kubernetes` client over
loopback HTTP. Activities run in temporalio's ActivityEnvironment (a real activity context with
heartbeats); the checkpoint store is real files under tmp_path.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from kubernetes import client
from temporalio import workflow
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.store import JobStore
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    CleanupRequest,
    GenerationPlan,
    Member,
    StopRequest,
    WatchRequest,
    WatchResult,
)
from tests.kube_double import KubeDouble

NS = "spotrain"
JOB = "mnist"
NODES = {"ip-10-0-0-1": "i-0aaa", "ip-10-0-0-2": "i-0bbb", "ip-10-0-0-3": "i-0ccc"}
SPOT_TAINT = {"key": "karpenter.sh/capacity-type", "value": "spot", "effect": "NoSchedule"}
ROOT = Path(__file__).resolve().parent.parent
R = TypeVar("R")


@pytest.fixture
def kube() -> Iterator[KubeDouble]:
    double = KubeDouble()
    with double.serve():
        for name, iid in NODES.items():
            double.add_node(name, iid, taints=[SPOT_TAINT])
        yield double


@pytest.fixture
def runtime(kube: KubeDouble) -> KubeRuntime:
    return KubeRuntime(NS, kube.api_client(), gang_timeout_s=3, watch_s=1, ack_poll_s=0.05)


def plan_for(ckpt: str, generation: int = 1, nodes: int = 3, **kw: Any) -> GenerationPlan:
    members = [Member(node_id=iid, address="unused") for iid in list(NODES.values())[:nodes]]
    fields: dict[str, Any] = {
        "job": JOB,
        "generation": generation,
        "members": members,
        "command": ["python", "train.py"],
        "image": "ghcr.io/example/train:1",
        "checkpoint": ckpt,
        "total_steps": 100,
    }
    return GenerationPlan(**{**fields, **kw})


def run(fn: Callable[..., R], *args: Any) -> R:
    return ActivityEnvironment().run(fn, *args)


def in_thread(fn: Callable[..., R], *args: Any) -> Future[R]:
    return ThreadPoolExecutor(1).submit(run, fn, *args)


def assert_valid(kind: type, obj: dict[str, Any] | None) -> None:
    """What the runtime sent is a valid object of the client's models (no unknown field)."""
    assert obj is not None
    sent = {k: v for k, v in obj.items() if k != "status"}  # less what the server added
    sent["metadata"] = {
        k: v for k, v in obj["metadata"].items() if k not in ("uid", "creationTimestamp")
    }
    assert client.ApiClient().sanitize_for_serialization(kind.from_dict(sent)) == sent


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


def stop_request(ckpt: str, **kw: Any) -> StopRequest:
    defaults: dict[str, Any] = dict(
        job=JOB, generation=1, world_size=3, checkpoint=ckpt, graceful=True, grace_s=5
    )
    return StopRequest(**{**defaults, **kw})


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    return f"file://{tmp_path}/ckpt"


def test_gang_start_waits_for_every_pod_ready(kube: KubeDouble, ckpt: str) -> None:
    runtime = KubeRuntime(NS, kube.api_client(), gang_timeout_s=10, watch_s=4)
    kube.auto_start = False  # the kubelet holds containers in ContainerCreating
    started = in_thread(runtime.start_generation, plan_for(ckpt))
    deadline = time.monotonic() + 2
    while len(kube.list("pods", NS)) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    kube.start_pod(NS, "mnist-g1-0")
    kube.start_pod(NS, "mnist-g1-1")
    time.sleep(0.3)
    assert not started.done(), "returned before the whole gang was Ready"
    assert not JobStore(ckpt).started(1), "ranks let go before the whole gang was Ready"
    kube.start_pod(NS, "mnist-g1-2")
    t0 = time.monotonic()
    started.result(timeout=3)
    latency = time.monotonic() - t0
    assert latency < 1.5, f"the watch should wake at once, not after watch_s=4 ({latency:.2f}s)"
    assert JobStore(ckpt).started(1)  # the training library's wait_for_gang now returns

    pods = {p["metadata"]["name"]: p for p in kube.list("pods", NS)}
    assert sorted(pods) == ["mnist-g1-0", "mnist-g1-1", "mnist-g1-2"]
    pod = pods["mnist-g1-1"]
    assert pod["metadata"]["labels"] == {
        "spotrain.io/managed": "true",
        "spotrain.io/job": JOB,
        "spotrain.io/generation": "1",
        "spotrain.io/rank": "1",
    }
    assert pod["spec"]["nodeName"] == "ip-10-0-0-2"  # i-0bbb, found through providerID
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "ip-10-0-0-2"}
    assert pod["spec"]["containers"][0]["image"] == "ghcr.io/example/train:1"
    env = env_of(pod)
    assert env["WORLD_SIZE"] == "3" and env["RANK"] == "1" and env["NODE_RANK"] == "1"
    assert env["MASTER_ADDR"] == "mnist-g1-0.spotrain-mnist.spotrain.svc"
    assert env["SPOTRAIN_CONTROL_FILE"] == "/etc/spotrain/control"
    assert_valid(client.V1Pod, pod)
    svc = kube.get("services", NS, "spotrain-mnist")
    assert_valid(client.V1Service, svc)
    assert svc is not None and svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"] == {"spotrain.io/job": JOB}
    assert pod["spec"]["hostname"] == "mnist-g1-1" and pod["spec"]["subdomain"] == "spotrain-mnist"


def test_multi_process_node_runs_once_with_local_world_size(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    plan = plan_for(ckpt, nodes=2, gpus_per_proc=1)
    plan.members[0].procs = 4
    plan.members[1].procs = 4
    run(runtime.start_generation, plan)
    pod = kube.get("pods", NS, "mnist-g1-1")
    assert pod is not None
    env = env_of(pod)
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_RANK"]) == ("8", "4", "0")
    assert env["LOCAL_WORLD_SIZE"] == "4"
    assert pod["spec"]["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "4"}}


def test_gang_timeout_rolls_back_and_names_stuck_pods(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    kube.remove_node("ip-10-0-0-3")
    kube.add_node("ip-10-0-0-3", "i-0ccc", taints=[{"key": "gpu", "effect": "NoSchedule"}])
    kube.kubelet_faults["ip-10-0-0-2"] = ("ErrImagePull", "registry unreachable")
    beats: list[float] = []
    env = ActivityEnvironment()
    env.on_heartbeat = lambda *_: beats.append(time.monotonic())
    t0 = time.monotonic()
    with pytest.raises(ApplicationError) as info:
        env.run(runtime.start_generation, plan_for(ckpt))
    took = time.monotonic() - t0
    assert 3 <= took < 5, took
    gaps = [b - a for a, b in zip([t0, *beats], [*beats, t0 + took], strict=True)]
    assert max(gaps) < 2.5, f"heartbeats about every watch_s=1s, got gaps {gaps}"
    msg = str(info.value)
    assert info.value.type == "GangStartError"
    assert "mnist-g1-0" not in msg  # it was Running and Ready
    assert "mnist-g1-1 (Pending, ErrImagePull: registry unreachable)" in msg
    assert "mnist-g1-2 (Pending, Unschedulable: 0/3 nodes are available" in msg
    assert kube.list("pods", NS) == []
    assert ("pods", "mnist-g1-0", 0) in kube.deletes
    assert not JobStore(ckpt).started(1)  # a rolled-back gang never lets its ranks go


def test_node_that_never_joins_fails_the_gang(kube: KubeDouble, ckpt: str) -> None:
    runtime = KubeRuntime(NS, kube.api_client(), gang_timeout_s=1, watch_s=1)
    plan = plan_for(ckpt, nodes=1)
    plan.members[0].node_id = "i-0fff"
    with pytest.raises(ApplicationError, match=r"i-0fff'\] did not join the cluster"):
        run(runtime.start_generation, plan)
    assert ("create", "pods") not in kube.calls


def test_retried_create_is_idempotent(kube: KubeDouble, runtime: KubeRuntime, ckpt: str) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.list("pods", NS)}
    run(runtime.start_generation, plan_for(ckpt))  # e.g. the worker crashed before completing
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in kube.list("pods", NS)} == uids
    assert kube.calls.count(("create", "pods")) == 6  # three of them answered 409
    assert kube.events("pods", "mnist-g1-0").count("ADDED") == 1


def test_missing_image_is_a_config_error(runtime: KubeRuntime, ckpt: str) -> None:
    with pytest.raises(ApplicationError) as info:
        run(runtime.start_generation, plan_for(ckpt, image=None))
    assert info.value.type == contract.CONFIG_ERROR and info.value.non_retryable


def _ack_on_stop(kube: KubeDouble, ckpt: str, pods: dict[str, list[int]]) -> threading.Thread:
    """Stand-in for the training processes: each pod reads its projected control file and,
    once it says stop, checkpoints (acks) its ranks, as spotrain.workers' library would."""

    def worker() -> None:
        waiting = dict(pods)
        deadline = time.monotonic() + 10
        while waiting and time.monotonic() < deadline:
            for name in list(waiting):
                if kube.projected_file(NS, name, "control") == "stop":
                    for rank in waiting.pop(name):
                        JobStore(ckpt).write_ack(1, rank, step=40, time=time.time())
            time.sleep(0.02)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    return thread


def test_graceful_stop_raises_event_waits_for_acks_then_deletes_with_grace(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    assert kube.projected_file(NS, "mnist-g1-0", "control") == ""
    JobStore(ckpt).write_latest_checkpoint(40, "ckpt/step-40")
    _ack_on_stop(kube, ckpt, {"mnist-g1-0": [0], "mnist-g1-1": [1], "mnist-g1-2": [2]})
    t0 = time.monotonic()
    result = run(runtime.stop_generation, stop_request(ckpt, grace_s=10))
    took = time.monotonic() - t0
    assert result.acked_ranks == [0, 1, 2] and not result.forced
    assert result.checkpoint_step == 40
    assert took < 3, f"should stop once all acked, not after the grace period ({took:.1f}s)"
    assert sorted(kube.deletes) == [("pods", f"mnist-g1-{i}", 10) for i in range(3)]
    assert ("pods", "mnist-g1-0", "application/merge-patch+json") in kube.patches
    assert kube.list("pods", NS, "spotrain.io/generation=1") == []


def test_stop_forces_ranks_that_do_not_ack(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    _ack_on_stop(kube, ckpt, {"mnist-g1-0": [0]})
    t0 = time.monotonic()
    result = run(runtime.stop_generation, stop_request(ckpt, grace_s=1))
    assert time.monotonic() - t0 >= 1
    assert result.acked_ranks == [0] and result.forced


def test_not_graceful_stop_deletes_at_once(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    result = run(runtime.stop_generation, stop_request(ckpt, graceful=False, grace_s=30))
    assert result.forced and result.acked_ranks == []
    assert sorted(kube.deletes) == [("pods", f"mnist-g1-{i}", 0) for i in range(3)]
    assert not any(p[0] == "pods" for p in kube.patches)
    # stopping again (a retry) finds nothing and succeeds
    assert not run(runtime.stop_generation, stop_request(ckpt, graceful=False, grace_s=30)).forced


def test_lost_node_pods_go_at_once_the_rest_gracefully(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    _ack_on_stop(kube, ckpt, {"mnist-g1-0": [0], "mnist-g1-2": [2]})
    result = run(runtime.stop_generation, stop_request(ckpt, lost_node_ids=["i-0bbb"]))
    assert kube.deletes[0] == ("pods", "mnist-g1-1", 0)
    assert sorted(kube.deletes[1:]) == [("pods", "mnist-g1-0", 5), ("pods", "mnist-g1-2", 5)]
    assert ("pods", "mnist-g1-1", "application/merge-patch+json") not in kube.patches
    assert result.acked_ranks == [0, 2] and not result.forced


def test_pods_on_a_vanished_node_are_lost_without_being_named(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    kube.remove_node("ip-10-0-0-1")
    _ack_on_stop(kube, ckpt, {"mnist-g1-1": [1], "mnist-g1-2": [2]})
    result = run(runtime.stop_generation, stop_request(ckpt, grace_s=2))
    assert kube.deletes[0] == ("pods", "mnist-g1-0", 0)
    assert result.acked_ranks == [1, 2] and not result.forced


def watch_request(ckpt: str, report_after_s: float = 10) -> WatchRequest:
    return WatchRequest(
        job=JOB, generation=1, world_size=3, checkpoint=ckpt, report_after_s=report_after_s
    )


def test_watch_reports_progress_then_completion(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    store = JobStore(ckpt)
    store.write_progress(1, step=17, time=time.time())
    store.write_latest_checkpoint(10, "ckpt/step-10")
    t0 = time.monotonic()
    result = run(runtime.watch_generation, watch_request(ckpt, report_after_s=1))
    assert 1 <= time.monotonic() - t0 < 2.5
    assert (result.outcome, result.step, result.checkpoint_step) == ("progress", 17, 10)

    watching = in_thread(runtime.watch_generation, watch_request(ckpt))
    store.write_done(step=100, time=time.time())
    for i in range(3):
        kube.finish_pod(NS, f"mnist-g1-{i}", 0)
    result = watching.result(timeout=3)
    assert result.outcome == "completed" and result.exit_codes == {0: 0, 1: 0, 2: 0}


def test_watch_fails_on_nonzero_exit(kube: KubeDouble, runtime: KubeRuntime, ckpt: str) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    watching = in_thread(runtime.watch_generation, watch_request(ckpt))
    kube.finish_pod(NS, "mnist-g1-2", 3)
    result = watching.result(timeout=3)
    assert result.outcome == "failed" and result.exit_codes == {2: 3}


def test_watch_fails_when_a_pod_vanishes(kube: KubeDouble, runtime: KubeRuntime, ckpt: str) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    watching = in_thread(runtime.watch_generation, watch_request(ckpt))
    time.sleep(0.2)
    # an operator's `kubectl delete pod`, through the API
    client.CoreV1Api(kube.api_client()).delete_namespaced_pod("mnist-g1-1", NS)
    result = watching.result(timeout=3)
    assert result.outcome == "failed" and "1 pod(s) vanished" in result.detail


def test_watch_fails_when_the_node_is_gone(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    watching = in_thread(runtime.watch_generation, watch_request(ckpt))
    time.sleep(0.2)
    t0 = time.monotonic()
    kube.remove_node("ip-10-0-0-3")  # no pod event: only the node object disappears
    result = watching.result(timeout=4)
    assert time.monotonic() - t0 < 2.5  # noticed within one watch_s tick
    assert result.outcome == "failed" and "ip-10-0-0-3" in result.detail


def hostfile_hosts(kube: KubeDouble) -> list[str]:
    cm = kube.get("configmaps", NS, "spotrain-mnist-hosts")
    assert_valid(client.V1ConfigMap, cm)
    assert cm is not None
    script = cm["data"]["discover_hosts.sh"]
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    listed = [line.split(" ")[0] for line in cm["data"]["hostfile"].splitlines()]
    assert [line.rsplit(":", 1)[0] for line in out.stdout.splitlines()] == listed
    return out.stdout.splitlines()


def test_horovod_hostfile_follows_scale_in_and_out(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    svc = "spotrain-mnist.spotrain.svc"
    run(runtime.start_generation, plan_for(ckpt, generation=1, nodes=3, job_type="horovod"))
    assert hostfile_hosts(kube) == [f"mnist-g1-{i}.{svc}:1" for i in range(3)]
    pod = kube.get("pods", NS, "mnist-g1-0")
    assert pod is not None
    assert env_of(pod)["SPOTRAIN_DISCOVER_HOSTS"] == "/etc/spotrain/hosts/discover_hosts.sh"
    assert {"name": "spotrain-mnist-hosts", "defaultMode": 0o755} in [
        v.get("configMap") for v in pod["spec"]["volumes"]
    ]

    run(runtime.stop_generation, stop_request(ckpt, graceful=False))
    run(runtime.start_generation, plan_for(ckpt, generation=2, nodes=2, job_type="horovod"))
    assert hostfile_hosts(kube) == [f"mnist-g2-{i}.{svc}:1" for i in range(2)]  # scale in

    run(runtime.stop_generation, stop_request(ckpt, generation=2, graceful=False))
    plan = plan_for(ckpt, generation=3, nodes=3, job_type="horovod")
    plan.members[2].procs = 2
    run(runtime.start_generation, plan)
    assert hostfile_hosts(kube) == [  # scale out
        f"mnist-g3-0.{svc}:1",
        f"mnist-g3-1.{svc}:1",
        f"mnist-g3-2.{svc}:2",
    ]
    assert kube.events("configmaps", "spotrain-mnist-hosts") == ["ADDED", "MODIFIED", "MODIFIED"]


@pytest.mark.parametrize("keep", [False, True])
def test_cleanup_deletes_the_job_or_keeps_failed_pods(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str, keep: bool
) -> None:
    run(runtime.start_generation, plan_for(ckpt, job_type="horovod"))
    other = plan_for(ckpt, nodes=1).model_copy(update={"job": "other"})
    run(runtime.start_generation, other)
    kube.finish_pod(NS, "mnist-g1-1", 1)
    # The fault stops the generation: the failed pod outlives the stop, for debugging.
    run(runtime.stop_generation, stop_request(ckpt, graceful=False))
    left = sorted(p["metadata"]["name"] for p in kube.list("pods", NS))
    assert left == ["mnist-g1-1", "other-g1-0"]
    run(runtime.start_generation, plan_for(ckpt, generation=2, job_type="horovod"))
    run(runtime.cleanup_job, CleanupRequest(job=JOB, keep=keep))
    left = sorted(p["metadata"]["name"] for p in kube.list("pods", NS))
    assert left == (["mnist-g1-1", "other-g1-0"] if keep else ["other-g1-0"])
    assert [s["metadata"]["name"] for s in kube.list("services", NS)] == ["spotrain-other"]
    assert kube.list("configmaps", NS) == []
    run(runtime.cleanup_job, CleanupRequest(job=JOB, keep=keep))  # idempotent


def test_namespace_per_job(kube: KubeDouble, ckpt: str) -> None:
    runtime = KubeRuntime("train-{job}", kube.api_client(), gang_timeout_s=1, watch_s=1)
    run(runtime.start_generation, plan_for(ckpt, nodes=1))
    pod = kube.get("pods", "train-mnist", "mnist-g1-0")
    assert pod is not None
    assert env_of(pod)["MASTER_ADDR"] == "mnist-g1-0.spotrain-mnist.train-mnist.svc"


def test_forbidden_is_a_config_error(kube: KubeDouble, runtime: KubeRuntime, ckpt: str) -> None:
    kube.deny.add(("create", "pods"))  # as a Role without that verb would answer
    with pytest.raises(ApplicationError) as info:
        run(runtime.start_generation, plan_for(ckpt))
    assert info.value.type == contract.CONFIG_ERROR and info.value.non_retryable
    assert "403" in str(info.value)


def granted(path: Path) -> set[tuple[str, str]]:
    pairs = set()
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc["kind"] in ("Role", "ClusterRole") and "spotrain" in doc["metadata"]["name"]:
            for rule in doc["rules"]:
                pairs |= {(v, r) for v in rule["verbs"] for r in rule["resources"]}
    return pairs


def test_rbac_grants_exactly_the_calls_the_runtime_makes(
    kube: KubeDouble, runtime: KubeRuntime, ckpt: str
) -> None:
    """Drive every code path that talks to the API, then compare with infra/k8s/rbac.yaml."""
    run(runtime.start_generation, plan_for(ckpt, job_type="horovod"))
    run(runtime.start_generation, plan_for(ckpt, job_type="horovod"))
    run(runtime.watch_generation, watch_request(ckpt, report_after_s=1))
    _ack_on_stop(kube, ckpt, {"mnist-g1-1": [1], "mnist-g1-2": [2]})
    run(runtime.stop_generation, stop_request(ckpt, lost_node_ids=["i-0aaa"]))
    run(runtime.cleanup_job, CleanupRequest(job=JOB))
    assert set(kube.calls) == granted(ROOT / "infra/k8s/rbac.yaml")


@workflow.defn
class KubeProbe:
    """Calls the runtime's activities by their contract names, as TrainingJob does."""

    @workflow.run
    async def run(self, plan: GenerationPlan) -> WatchResult:
        opts: dict[str, Any] = {
            "start_to_close_timeout": timedelta(seconds=30),
            "heartbeat_timeout": timedelta(seconds=5),
        }
        await workflow.execute_activity(contract.START_GENERATION, plan, **opts)
        watch = WatchRequest(
            job=plan.job,
            generation=plan.generation,
            world_size=plan.world_size,
            checkpoint=plan.checkpoint,
            report_after_s=20,
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
    dev_env: WorkflowEnvironment, kube: KubeDouble, runtime: KubeRuntime, ckpt: str
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
                kube.finish_pod(NS, f"mnist-g1-{i}", 0)
            result = await asyncio.wait_for(handle.result(), 20)
    assert result.outcome == "completed"
    assert kube.list("pods", NS) == [] and kube.list("services", NS) == []
