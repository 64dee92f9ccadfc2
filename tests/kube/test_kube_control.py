"""The control channel on the Kubernetes runtime: KubeRuntime, as its ServiceAccount, on the
real control plane (tests/kube/k8s_cluster.py), with real rank processes run by the kubelet
stand-in (tests/kube/kube_kubelet.py) with `refresh_volumes` off: it runs each bound pod's command
with the pod's environment and never refreshes the downwardAPI file, as a kubelet between
syncs, so the ranks can hear the control record in the store only."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client
from temporalio.testing import ActivityEnvironment

from bench.reaction import SCRIPT
from bench.reaction_paths import read_times, wait_first_steps
from spotrain.activities.kube import KubeRuntime
from spotrain.elastic.job_store import JobStore
from spotrain.workflows.contract import (
    CleanupRequest,
    GenerationPlan,
    Member,
    StopRequest,
    WatchRequest,
)
from tests.kube.k8s_cluster import (
    NAMESPACE,
    ControlPlane,
)
from tests.kube.kube_kubelet import LocalKubelet

NODES = {"ip-10-0-0-1": "i-0aaa", "ip-10-0-0-2": "i-0bbb"}


@pytest.fixture
def kubelet(cluster: ControlPlane, tmp_path: Path) -> Iterator[LocalKubelet]:
    core = client.CoreV1Api(cluster.admin)
    stand_in = LocalKubelet(core, NAMESPACE, tmp_path / "kubelet", refresh_volumes=False)
    for name, iid in NODES.items():
        cluster.add_node(name, iid, fake=False)
        stand_in.nodes.add(name)
    with stand_in.serving():
        yield stand_in


@pytest.fixture
def runtime(cluster: ControlPlane, kubelet: LocalKubelet) -> Iterator[KubeRuntime]:
    """The runtime as the worker's ServiceAccount; job `ctl` cleaned up afterwards."""
    worker = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    rt = KubeRuntime(NAMESPACE, worker, gang_timeout_s=30, watch_s=1, ack_poll_s=0.05)
    yield rt
    ActivityEnvironment().run(rt.cleanup_job, CleanupRequest(job="ctl"))


def plan(tmp_path: Path) -> GenerationPlan:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "times").mkdir(exist_ok=True)
    return GenerationPlan(
        job="ctl",
        generation=1,
        members=[Member(node_id=iid, address="unused") for iid in NODES.values()],
        command=[sys.executable, str(script)],
        env={"BENCH_TIMES": str(tmp_path / "times"), "BENCH_PREFIX": "k"},
        image="example/train:1",
        checkpoint=f"file://{tmp_path / 'ckpt'}",
        total_steps=10**9,
        graceful_shutdown_s=45.2,
    )


def test_ranks_in_pods_hear_the_control_record_and_pods_get_the_graceful_timeout(
    tmp_path: Path, kubelet: LocalKubelet, runtime: KubeRuntime
) -> None:
    env, p = ActivityEnvironment(), plan(tmp_path)
    env.run(runtime.start_generation, p)
    pods = kubelet.core.list_namespaced_pod(NAMESPACE).items
    assert [pod.spec.termination_grace_period_seconds for pod in pods] == [46, 46]
    wait_first_steps(tmp_path / "times", "k1", 2)
    req = StopRequest(
        job="ctl", generation=1, world_size=2, checkpoint=p.checkpoint, graceful=True, grace_s=20
    )
    started = time.monotonic()
    result = env.run(runtime.stop_generation, req)
    assert result.acked_ranks == [0, 1] and not result.forced
    assert time.monotonic() - started < 15  # acked through the store, not after the kubelet
    assert len(read_times(tmp_path / "times", "k1")) == 2
    for pod in pods:
        log = (kubelet.root / pod.metadata.name / "log").read_text()
        assert "elastic event from control record" in log, log
    record = JobStore(p.checkpoint).store.get_json(JobStore.control_key(1))
    assert record["kind"] == "stop" and record["event_id"] == "stop-ctl-1"


def test_watch_hands_over_notices_ranks_found(tmp_path: Path, runtime: KubeRuntime) -> None:
    env, p = ActivityEnvironment(), plan(tmp_path)
    env.run(runtime.start_generation, p)
    notice = {"kind": "interruption", "node_id": "i-0bbb", "deadline": None, "event_id": "imds-x"}
    JobStore(p.checkpoint).report_notice(1, notice)
    watch = WatchRequest(
        job="ctl", generation=1, world_size=2, checkpoint=p.checkpoint, report_after_s=30
    )
    started = time.monotonic()
    found = env.run(runtime.watch_generation, watch)
    assert time.monotonic() - started < 10
    assert [json.loads(n.model_dump_json()) for n in found.notices] == [notice]
    known = watch.model_copy(update={"known_events": ["imds-x"], "report_after_s": 1})
    assert env.run(runtime.watch_generation, known).notices == []
