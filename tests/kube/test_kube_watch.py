"""The Kubernetes runtime's watch, Horovod hostfile, cleanup, namespaces and RBAC, on the real
control plane (tests/kube/k8s_cluster.py), as the `spotrain-worker` ServiceAccount; fixtures and
helpers in tests/kube/kube_support.py, kubelet stand-ins in tests/kube/kube_kubelet.py."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from kubernetes import client, utils, watch
from temporalio.common import SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.kube_objects import owner_selector
from spotrain.elastic.job_store import JobStore
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    CleanupRequest,
)
from spotrain.workflows.job import attributes
from tests.kube.k8s_cluster import ControlPlane, Request
from tests.kube.kube_kubelet import finish_pod
from tests.kube.kube_support import (  # noqa: F401 (fixtures)
    JOB,
    NS,
    ROOT,
    WORKER,
    ack_on_stop,
    audit_fixture,
    ckpt_fixture,
    core_fixture,
    env_of,
    granted,
    in_thread,
    kube_fixture,
    plan_for,
    pods,
    rbac_fixture,
    run,
    runtime_fixture,
    spotrain,
    stop_request,
    wait_until,
    watch_request,
    worker_client_fixture,
)


def test_watch_reports_progress_then_completion(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    store = JobStore(ckpt)
    store.write_progress(1, step=17, time=time.time())
    store.write_latest_checkpoint(10, "ckpt/step-10")
    rank2 = {"step": 17, "time": time.time() - 3, "recent_s": 0.5, "usual_s": 0.1}
    store.write_rank_steps(1, 2, rank2)  # what every rank leaves for straggler detection
    t0 = time.monotonic()
    result = run(runtime.watch_generation, watch_request(ckpt, report_after_s=1))
    assert 1 <= time.monotonic() - t0 < 5
    assert (result.outcome, result.step, result.checkpoint_step) == ("progress", 17, 10)
    [steps] = result.ranks
    assert (steps.rank, steps.step, steps.recent_s, steps.usual_s) == (2, 17, 0.5, 0.1)
    assert steps.since_step_s >= 3

    watching = in_thread(runtime.watch_generation, watch_request(ckpt))
    store.write_done(step=100, time=time.time())
    for i in range(3):
        finish_pod(core, NS, f"mnist-g1-{i}", 0)
    result = watching.result(timeout=10)
    assert result.outcome == "completed" and result.exit_codes == {0: 0, 1: 0, 2: 0}


def test_watch_fails_on_nonzero_exit(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    watching = in_thread(runtime.watch_generation, watch_request(ckpt))
    finish_pod(core, NS, "mnist-g1-2", 3)
    result = watching.result(timeout=10)
    assert result.outcome == "failed" and result.exit_codes == {2: 3}


def test_watch_fails_when_a_pod_is_deleted(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    """An operator's `kubectl delete pod` (30 s of grace): the pod is Terminating long before
    it vanishes, and the watch fails at the first sign, not 30 s later."""
    run(runtime.start_generation, plan_for(ckpt))
    watching = in_thread(runtime.watch_generation, watch_request(ckpt))
    time.sleep(0.5)
    t0 = time.monotonic()
    core.delete_namespaced_pod("mnist-g1-1", NS)
    result = watching.result(timeout=20)
    assert time.monotonic() - t0 < 10
    assert result.outcome == "failed" and "mnist-g1-1" in result.detail


def test_watch_fails_when_the_node_is_gone(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt))
    watching = in_thread(runtime.watch_generation, watch_request(ckpt))
    time.sleep(0.5)
    t0 = time.monotonic()
    core.delete_node("ip-10-0-0-3")  # no pod event: only the node object disappears
    result = watching.result(timeout=10)
    assert time.monotonic() - t0 < 5  # noticed within a few watch_s ticks
    assert result.outcome == "failed" and "ip-10-0-0-3" in result.detail


def test_watch_survives_410_gone_by_listing_again(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    """etcd compacted past the watch's resourceVersion (a quiet generation outlives the
    apiserver's 5-minute compaction): the next watch answers 410 Gone; the runtime lists again
    and goes on watching, instead of failing the activity."""
    run(runtime.start_generation, plan_for(ckpt))
    seen = core.list_namespaced_pod(NS).metadata.resource_version
    watching = in_thread(runtime.watch_generation, watch_request(ckpt, report_after_s=30))
    time.sleep(1.5)
    for _ in range(2):  # move etcd's revision past the pods' last change
        core.create_namespaced_config_map(
            "default", {"metadata": {"name": f"tick-{uuid.uuid4().hex[:6]}"}}
        )
    kube.compact_etcd()
    with pytest.raises(client.ApiException) as gone:  # what the runtime's next watch meets
        for _ in watch.Watch().stream(
            core.list_namespaced_pod, NS, resource_version=seen, timeout_seconds=1
        ):
            pass
    assert gone.value.status == 410
    time.sleep(2.5)  # the runtime's next watch (watch_s=1) starts from a compacted version
    assert not watching.done()
    JobStore(ckpt).write_done(step=100, time=time.time())
    for i in range(3):
        finish_pod(core, NS, f"mnist-g1-{i}", 0)
    assert watching.result(timeout=15).outcome == "completed"


def hostfile_hosts(core: client.CoreV1Api) -> list[str]:
    cm = core.read_namespaced_config_map("spotrain-mnist-hosts", NS)
    script = cm.data["discover_hosts.sh"]
    out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True)
    listed = [line.split(" ")[0] for line in cm.data["hostfile"].splitlines()]
    assert [line.rsplit(":", 1)[0] for line in out.stdout.splitlines()] == listed
    return out.stdout.splitlines()


def test_horovod_hostfile_follows_scale_in_and_out(
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    audit: Callable[[], list[Request]],
    ckpt: str,
) -> None:
    svc = "spotrain-mnist.spotrain-jobs.svc"
    run(runtime.start_generation, plan_for(ckpt, generation=1, nodes=3, job_type="horovod"))
    assert hostfile_hosts(core) == [f"mnist-g1-{i}.{svc}:1" for i in range(3)]
    pod = core.read_namespaced_pod("mnist-g1-0", NS)
    assert env_of(pod)["SPOTRAIN_DISCOVER_HOSTS"] == "/etc/spotrain/hosts/discover_hosts.sh"
    mounted = [v.config_map for v in pod.spec.volumes if v.config_map]
    assert [(v.name, v.default_mode) for v in mounted] == [("spotrain-mnist-hosts", 0o755)]

    run(runtime.stop_generation, stop_request(ckpt, graceful=False))
    run(runtime.start_generation, plan_for(ckpt, generation=2, nodes=2, job_type="horovod"))
    assert hostfile_hosts(core) == [f"mnist-g2-{i}.{svc}:1" for i in range(2)]  # scale in

    run(runtime.stop_generation, stop_request(ckpt, generation=2, graceful=False))
    plan = plan_for(ckpt, generation=3, nodes=3, job_type="horovod")
    plan.members[2].procs = 2
    run(runtime.start_generation, plan)
    assert hostfile_hosts(core) == [  # scale out
        f"mnist-g3-0.{svc}:1",
        f"mnist-g3-1.{svc}:1",
        f"mnist-g3-2.{svc}:2",
    ]
    cm = core.read_namespaced_config_map("spotrain-mnist-hosts", NS)
    assert cm.metadata.labels["spotrain.io/generation"] == "3"
    writes = [(r.verb, r.code) for r in audit() if r.resource == "configmaps"]
    update = [("create", 409), ("patch", 200)]  # create-or-update: AlreadyExists, then patch
    assert writes == [("create", 201), *update, *update]


@pytest.mark.parametrize("keep", [False, True])
def test_cleanup_deletes_the_job_or_keeps_failed_pods(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str, keep: bool
) -> None:
    run(runtime.start_generation, plan_for(ckpt, job_type="horovod"))
    other = plan_for(ckpt, nodes=1).model_copy(update={"job": "other"})
    run(runtime.start_generation, other)
    finish_pod(core, NS, "mnist-g1-1", 1)
    # The fault stops the generation: the failed pod outlives the stop, for debugging.
    run(runtime.stop_generation, stop_request(ckpt, graceful=False))
    assert sorted(pods(core)) == ["mnist-g1-1", "other-g1-0"]
    run(runtime.start_generation, plan_for(ckpt, generation=2, job_type="horovod"))
    run(runtime.cleanup_job, CleanupRequest(job=JOB, keep=keep))
    # Deleted with the default grace (30 s): Terminating until kwok's "kubelet" removes them.
    staying = sorted(n for n, p in pods(core).items() if not p.metadata.deletion_timestamp)
    assert staying == (["mnist-g1-1", "other-g1-0"] if keep else ["other-g1-0"])
    services = core.list_namespaced_service(NS).items
    assert [s.metadata.name for s in services] == ["spotrain-other"]
    assert core.list_namespaced_config_map(NS, label_selector="spotrain.io/managed").items == []
    run(runtime.cleanup_job, CleanupRequest(job=JOB, keep=keep))  # idempotent


@pytest.fixture(name="cli_env")
def cli_env_fixture(
    kube: ControlPlane, dev_env: WorkflowEnvironment, moto_endpoint: str
) -> dict[str, str]:
    """The CLI's environment: the Temporal dev server, moto, and the worker's kubeconfig."""
    return os.environ | {
        "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host,
        "SPOTRAIN_EC2_ENDPOINT": moto_endpoint,
        "SPOTRAIN_K8S_NAMESPACE": NS,
        "KUBECONFIG": str(kube.service_account_kubeconfig("spotrain-worker")),
    }


def test_release_deletes_a_stuck_jobs_pods_and_objects_and_no_others(
    core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str, cli_env: dict[str, str], tmp_path: Path
) -> None:
    """`spotrain release --runtime kubernetes` (a real CLI process, as the worker's
    ServiceAccount) for a job whose workflow cannot clean up (here Temporal has no record of
    it): its pods, Failed ones too, Service, hostfile ConfigMap and SSH Secrets go; another
    job's stay. Without a kubeconfig it refuses before changing anything."""
    run(runtime.start_generation, plan_for(ckpt, job_type="horovod"))
    other = plan_for(ckpt, nodes=1, job_type="horovod").model_copy(update={"job": "other"})
    run(runtime.start_generation, other)
    finish_pod(core, NS, "mnist-g1-1", 1)

    def release(**extra: str) -> subprocess.CompletedProcess[str]:
        argv = ["release", JOB, "--runtime", "kubernetes", "--state-dir", str(tmp_path), "--json"]
        return spotrain(*argv, env=cli_env | extra)

    refused = release(KUBECONFIG=str(tmp_path / "missing"))
    assert refused.returncode == 2 and "set KUBECONFIG" in refused.stderr, refused
    assert "Traceback" not in refused.stderr and len(pods(core)) == 4
    done = release()
    assert done.returncode == 0, done
    assert json.loads(done.stdout)["pods"] == [f"mnist-g1-{i}" for i in range(3)], done.stdout
    staying = sorted(n for n, p in pods(core).items() if not p.metadata.deletion_timestamp)
    assert staying == ["other-g1-0"]
    assert [s.metadata.name for s in core.list_namespaced_service(NS).items] == ["spotrain-other"]
    mine = owner_selector(JOB)
    assert core.list_namespaced_config_map(NS, label_selector=mine).items == []
    assert core.list_namespaced_secret(NS, label_selector=mine).items == []
    for kind in (core.list_namespaced_config_map, core.list_namespaced_secret):
        assert kind(NS, label_selector=owner_selector("other")).items
    again = release()  # idempotent: only the terminating pods are left to find
    assert again.returncode == 0 and json.loads(again.stdout)["workflow"] == "unknown to Temporal"


def test_namespace_per_job(
    kube: ControlPlane, core: client.CoreV1Api, worker_client: client.ApiClient, ckpt: str
) -> None:
    """`train-{job}`: the namespace and the Role's binding in it exist beforehand."""
    kube.ensure_namespace("train-mnist")
    for doc in yaml.safe_load_all((ROOT / "infra/k8s/rbac.yaml").read_text()):
        if doc["kind"] in ("Role", "RoleBinding"):
            doc["metadata"]["namespace"] = "train-mnist"
            try:
                utils.create_from_dict(kube.admin, doc, namespace="train-mnist")
            except utils.FailToCreateError as err:
                assert all(e.status == 409 for e in err.api_exceptions)
    kube.wait_until_allowed("spotrain-worker", "create", "services", "train-mnist")
    runtime = KubeRuntime("train-{job}", worker_client, gang_timeout_s=30, watch_s=1)
    run(runtime.start_generation, plan_for(ckpt, nodes=1))
    pod = core.read_namespaced_pod("mnist-g1-0", "train-mnist")
    assert env_of(pod)["MASTER_ADDR"] == "mnist-g1-0.spotrain-mnist.train-mnist.svc"


def test_another_identity_is_forbidden_and_that_is_a_config_error(
    kube: ControlPlane, ckpt: str
) -> None:
    """The webhook's ServiceAccount may only read nodes: the apiserver refuses it the pods."""
    webhook = kube.api_client(kube.service_account_kubeconfig("spotrain-webhook"))
    runtime = KubeRuntime(NS, webhook, gang_timeout_s=5, watch_s=1)
    with pytest.raises(ApplicationError) as info:
        run(runtime.start_generation, plan_for(ckpt))
    assert info.value.type == contract.CONFIG_ERROR and info.value.non_retryable
    assert "403" in str(info.value) and "spotrain-webhook" in str(info.value)


def test_rbac_grants_exactly_the_calls_the_runtime_makes(
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    audit: Callable[[], list[Request]],
    ckpt: str,
) -> None:
    """Drive every code path that talks to the API as the worker's ServiceAccount; every
    request was allowed (else it fails above), and the audit log shows each granted
    (verb, resource) in use: nothing in infra/k8s/rbac.yaml is granted for nothing."""
    run(runtime.start_generation, plan_for(ckpt, job_type="horovod"))
    run(runtime.start_generation, plan_for(ckpt, job_type="horovod"))
    run(runtime.watch_generation, watch_request(ckpt, report_after_s=1))
    ack_on_stop(core, ckpt, {"mnist-g1-1": [1], "mnist-g1-2": [2]})
    run(runtime.stop_generation, stop_request(ckpt, lost_node_ids=["i-0aaa"]))
    run(runtime.cleanup_job, CleanupRequest(job=JOB))
    requests = audit()
    assert [r for r in requests if r.code == 403] == []
    assert {(r.verb, r.resource) for r in requests} == granted(
        ROOT / "infra/k8s/rbac.yaml", "spotrain-runtime", "spotrain-node-reader"
    )


def test_a_verb_missing_from_the_role_fails(
    kube: ControlPlane, rbac: client.RbacAuthorizationV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    """Real authorization: take `list` out of the Role and the gang start is refused (it
    lists its pods before it watches them; a watch is skipped when all are Ready at once)."""
    role = rbac.read_namespaced_role("spotrain-runtime", NS)
    original = client.ApiClient().sanitize_for_serialization(role.rules)
    stripped = [dict(r, verbs=[v for v in r["verbs"] if v != "list"]) for r in original]
    rbac.patch_namespaced_role("spotrain-runtime", NS, {"rules": stripped})
    try:
        wait_until(lambda: not may_list_pods(kube))  # the authorizer's cache catches up
        with pytest.raises(ApplicationError) as info:
            run(runtime.start_generation, plan_for(ckpt))
        assert info.value.type == contract.CONFIG_ERROR
        assert 'cannot list resource "pods"' in str(info.value)
    finally:
        rbac.patch_namespaced_role("spotrain-runtime", NS, {"rules": original})
        wait_until(lambda: may_list_pods(kube))


def may_list_pods(kube: ControlPlane) -> bool:
    review = client.V1SubjectAccessReview(
        spec=client.V1SubjectAccessReviewSpec(
            user=WORKER,
            groups=["system:serviceaccounts", "system:serviceaccounts:spotrain"],
            resource_attributes=client.V1ResourceAttributes(
                namespace=NS, verb="list", resource="pods"
            ),
        )
    )
    answer = client.AuthorizationV1Api(kube.admin).create_subject_access_review(review)
    return bool(answer.status.allowed)


async def test_gc_releases_the_objects_of_jobs_that_do_not_run_and_no_others(
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    ckpt: str,
    cli_env: dict[str, str],
    dev_env: WorkflowEnvironment,
    tmp_path: Path,
) -> None:
    """`spotrain gc --runtime kubernetes`: pods of a job Temporal does not know are orphans;
    those of a job whose workflow runs, by its name or (the operator's) by a `k8s/...` id that
    carries the name as SpotrainJob, are not. `release` of the operator's job by its name finds
    its workflow, which is not stuck, and refuses."""
    jobs = {"gone": "gone-job", "submitted": "cli-job", "operator": "op-job-1a2b3c4d"}
    for name in jobs.values():
        plan = plan_for(ckpt, nodes=1).model_copy(update={"job": name})
        await asyncio.to_thread(run, runtime.start_generation, plan)
    # Running workflows (no worker polls their queue): by name, and as the operator starts one.
    start = functools.partial(dev_env.client.start_workflow, "TrainingJob", task_queue="nobody")
    operator = TypedSearchAttributes([SearchAttributePair(attributes.JOB, jobs["operator"])])
    pending = [
        await start(id=jobs["submitted"]),
        await start(id=f"k8s/{NS}/op-job/{uuid.uuid4()}", search_attributes=operator),
    ]
    try:
        argv = ["gc", "--runtime", "kubernetes", "--state-dir", str(tmp_path), "--json"]
        dry = await asyncio.to_thread(spotrain, *argv, env=cli_env)
        assert dry.returncode == 0, dry
        assert json.loads(dry.stdout)["pods"] == [{"job": "gone-job", "pods": ["gone-job-g1-0"]}]
        assert len(pods(core)) == 3  # a dry run
        applied = await asyncio.to_thread(spotrain, *argv, "--apply", env=cli_env)
        assert applied.returncode == 0, applied
        staying = sorted(n for n, p in pods(core).items() if not p.metadata.deletion_timestamp)
        assert staying == ["cli-job-g1-0", "op-job-1a2b3c4d-g1-0"]
        release = ["release", jobs["operator"], "--runtime", "kubernetes"]
        refused = await asyncio.to_thread(spotrain, *release, env=cli_env)
        assert refused.returncode == 2 and "is running and not stuck" in refused.stderr, refused
    finally:
        for handle in pending:
            await handle.terminate()
