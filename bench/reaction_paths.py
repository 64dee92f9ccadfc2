"""The notice paths of bench/reaction.py beyond the local runtime's workflow: the Kubernetes
runtime, EC2 instance metadata, and SIGTERM, each with real rank processes using
`spotrain.elastic`.

- Kubernetes: `KubeRuntime` as its ServiceAccount against the real control plane of the tests
  (tests/kube/k8s_cluster.py: etcd, kube-apiserver, kube-scheduler, built by
  infra/k8s/controlplane/build.sh) with tests/kube/kube_kubelet.py standing in for the kubelet: it
  runs each bound pod's command as a local process with the pod's environment and never
  refreshes the downwardAPI file (a real kubelet does that on its sync period, about a
  minute), so the ranks hear the control record in the store, only.
- IMDS: AWS's ec2-metadata-mock (tests/aws/imds_mock.py) with a spot interruption after a delay.
- SIGTERM: a rank sent SIGTERM, until its checkpoint ack is in the store.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from kubernetes import client
from temporalio.testing import ActivityEnvironment

from spotrain.activities.kube import KubeRuntime
from spotrain.elastic import environment
from spotrain.elastic.job_store import JobStore
from spotrain.workflows.contract import CleanupRequest, GenerationPlan, Member, StopRequest
from tests.aws import imds_mock
from tests.kube.k8s_cluster import NAMESPACE, ControlPlane, binaries
from tests.kube.kube_kubelet import LocalKubelet


def kube_reclaims(root: Path, script: Path, times: Path, reclaims: int, nodes: int) -> list[float]:
    """Per reclaim: a generation of `nodes` pods running the benchmark's script, stopped
    gracefully by `KubeRuntime.stop_generation`; from the activity's start to the last rank's
    elastic event (the library's latch time, which the script records)."""
    samples = []
    env = ActivityEnvironment()
    with ControlPlane.running(binaries(build=True)) as cluster:
        core = client.CoreV1Api(cluster.admin)
        kubelet = LocalKubelet(core, NAMESPACE, root / "kubelet", refresh_volumes=False)
        node_ids = [f"i-kube{i}" for i in range(nodes)]
        for i, iid in enumerate(node_ids):
            cluster.add_node(f"ip-10-0-0-{i}", iid, fake=False)
            kubelet.nodes.add(f"ip-10-0-0-{i}")
        worker = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
        runtime = KubeRuntime(NAMESPACE, worker, gang_timeout_s=60, ack_poll_s=0.05)
        ckpt = f"file://{root / 'kube-checkpoints'}"
        with kubelet.serving():
            try:
                for g in range(1, reclaims + 1):
                    plan = GenerationPlan(
                        job="reaction-kube",
                        generation=g,
                        members=[Member(node_id=iid, address="unused") for iid in node_ids],
                        command=[sys.executable, str(script)],
                        env={"BENCH_TIMES": str(times), "BENCH_PREFIX": "k"},
                        image="bench/none:1",
                        checkpoint=ckpt,
                        total_steps=10**9,
                        graceful_shutdown_s=10,
                    )
                    env.run(runtime.start_generation, plan)
                    wait_first_steps(times, f"k{g}", nodes)
                    req = StopRequest(
                        job=plan.job,
                        generation=g,
                        world_size=nodes,
                        checkpoint=ckpt,
                        graceful=True,
                        grace_s=10,
                    )
                    sent = time.time()
                    env.run(runtime.stop_generation, req)
                    seen = [t["event_seen"] for t in read_times(times, f"k{g}")]
                    samples.append(max(seen) - sent)
            finally:
                env.run(runtime.cleanup_job, CleanupRequest(job="reaction-kube"))
    return samples


def read_times(times: Path, tag: str) -> list[dict[str, float]]:
    return [json.loads(p.read_text()) for p in times.glob(f"{tag}-*.json")]


def wait_first_steps(times: Path, tag: str, ranks: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while len([t for t in read_times(times, tag) if "first_step" in t]) < ranks:
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks of {tag} did not start")
        time.sleep(0.01)


def _rank_env(root: Path, tag: str, **extra: str) -> dict[str, str]:
    """A lone rank (world size 1) of its own job; started already."""
    plan = GenerationPlan(
        job=f"reaction-{tag}",
        generation=1,
        members=[Member(node_id=f"i-{tag}", address="127.0.0.1")],
        command=["unused"],
        checkpoint=f"file://{root / tag}",
        total_steps=10**9,
    )
    JobStore(plan.checkpoint).mark_started(1, time.time())
    env = environment.rank_env(plan, 0, 0, master_port=29500, control_file="")
    return {**os.environ, **env, **extra}


def imds_sample(root: Path, script: Path, times: Path, tag: str) -> float:
    """One rank on a 'node' whose metadata mock posts a spot interruption 2 s after it
    starts; from the notice being visible (the benchmark polls the mock every 5 ms) to the
    rank's elastic event."""
    with imds_mock.serve("spot", "-d", "2") as url:
        env = _rank_env(root, tag, BENCH_TIMES=str(times), SPOTRAIN_IMDS_ENDPOINT=url)
        with _rank(script, {**env, "BENCH_TAG": tag}) as proc:
            visible = _notice_visible(url)
            proc.wait(60)
    return read_times(times, tag)[0]["event_seen"] - visible


@contextmanager
def _rank(script: Path, env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """The benchmark's script as a lone rank (its log lines, one per event, are left out of
    the report); killed if still running at the end."""
    proc = subprocess.Popen(
        [sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _notice_visible(url: str) -> float:
    token_req = urllib.request.Request(
        f"{url}/latest/api/token",
        method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"},
    )
    with urllib.request.urlopen(token_req, timeout=2) as resp:
        token = resp.read().decode()
    get = urllib.request.Request(
        f"{url}/latest/meta-data/spot/instance-action",
        headers={"X-aws-ec2-metadata-token": token},
    )
    while True:
        try:
            urllib.request.urlopen(get, timeout=2).close()
            return time.time()
        except urllib.error.HTTPError as err:
            if err.code != 404:
                raise
        time.sleep(0.005)


def sigterm_sample(root: Path, script: Path, times: Path, tag: str) -> float:
    """One rank sent SIGTERM while training; from the signal to its checkpoint ack."""
    with _rank(script, _rank_env(root, tag, BENCH_TIMES=str(times), BENCH_TAG=tag)) as proc:
        wait_first_steps(times, tag, 1)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return read_times(times, tag)[0]["acked"] - sent


def samples(
    sample: Callable[[Path, Path, Path, str], float],
    root: Path,
    script: Path,
    times: Path,
    n: int,
    prefix: str,
    parallel: int = 4,
) -> list[float]:
    with ThreadPoolExecutor(parallel) as pool:
        futures = [pool.submit(sample, root, script, times, f"{prefix}{i}") for i in range(n)]
        return [f.result() for f in futures]
