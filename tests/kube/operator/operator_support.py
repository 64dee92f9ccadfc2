"""The operator as a real subprocess against the test control plane and the Temporal dev
server, killed and restarted at will; a TrainingJob resource of the simulated job."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.embedded.stack import _die_with_parent as die_with_parent
from spotrain.workers.k8s.crd import API_VERSION
from spotrain.workers.k8s.operator_status import workflow_id
from spotrain.workers.worker import workflow_worker
from tests.jobs import fast_runtime, fast_spec
from tests.kube.k8s_cluster import ROOT, ControlPlane
from tests.kube.kubectl import Kubectl

NS = "team-a"  # where the tests' TrainingJobs live
CRASHED = 3  # workers/k8s/operator.py's crash_point exit status
COMMAND = [sys.executable, "-m", "spotrain.workers.k8s.operator"]


class OperatorProcess:
    """`python -m spotrain.workers.k8s.operator` as the spotrain-operator ServiceAccount."""

    def __init__(self, kubeconfig: Path, temporal: Client, queue: str, logs: Path) -> None:
        self.env = dict(
            os.environ,
            KUBECONFIG=str(kubeconfig),
            TEMPORAL_ADDRESS=temporal.service_client.config.target_host,
        )
        self.queue = queue
        self.logs = logs
        self.runs = 0
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, crash_at: str = "", *options: str) -> subprocess.Popen[bytes]:
        self.runs += 1
        with (self.logs / f"operator-{self.runs}.log").open("wb") as log:
            proc = subprocess.Popen(
                [*COMMAND, "--task-queue", self.queue, "--resync-s", "1", *options],
                env=self.env | {"SPOTRAIN_OPERATOR_CRASH_AT": crash_at},
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
                cwd=ROOT,
            )
        self.procs.append(proc)
        return proc

    def log(self) -> str:
        return (self.logs / f"operator-{self.runs}.log").read_text(errors="replace")[-3000:]

    async def crash_at(self, step: str, timeout: float = 60) -> None:
        """Run an operator until it dies right after `step`'s effect."""
        proc = self.start(step)
        try:
            code = await asyncio.to_thread(proc.wait, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"never reached {step}:\n{self.log()}") from None
        assert code == CRASHED and f"crash point {step}:" in self.log(), self.log()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()

    @contextmanager
    def running(self, *options: str) -> Iterator[None]:
        self.start("", *options)
        try:
            yield
        finally:
            self.kill()


@contextmanager
def operator(
    plane: ControlPlane, kubectl: Kubectl, temporal: Client, queue: str, logs: Path
) -> Iterator[OperatorProcess]:
    """The operator's RBAC applied (infra/k8s/operator-rbac.yaml); every process it starts is
    killed on exit."""
    kubectl("apply", "-f", str(ROOT / "infra/k8s/operator-rbac.yaml"))
    kubeconfig = plane.service_account_kubeconfig("spotrain-operator")
    op = OperatorProcess(kubeconfig, temporal, queue, logs)
    try:
        yield op
    finally:
        op.kill()


@contextmanager
def operator_with_simulated_worker(
    plane: ControlPlane, kubectl: Kubectl, temporal: Client, logs: Path
) -> Iterator[tuple[OperatorProcess, SimulatedCloud, Callable[[], Worker]]]:
    """`operator(...)`, the simulated cloud, and a factory of workers running the TrainingJob
    workflow with that cloud and the fast simulated ranks on the operator's queue (a test
    starts and stops them: `async with worker(): ...`)."""
    cloud, runtime, queue = SimulatedCloud(), fast_runtime(), uuid.uuid4().hex
    with operator(plane, kubectl, temporal, queue, logs) as op, ThreadPoolExecutor(16) as pool:

        def worker() -> Worker:
            activities = cloud.activities() + runtime.activities()
            return workflow_worker(temporal, queue, activities, activity_executor=pool)

        yield op, cloud, worker


def training_job(name: str, replicas: int, **elastic: Any) -> dict[str, Any]:
    """A TrainingJob of the simulated job (tests/jobs.py's fast spec: seconds, not minutes)."""
    # opportunistic off: the target moves only when kubectl moves it (or a reclaim shrinks it)
    spec = fast_spec(total_steps=10_000_000, elastic={"opportunistic": False, **elastic})
    del spec["name"]
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": {"replicas": replicas, **spec},
    }


async def on_two_nodes(
    kubectl: Kubectl, op: OperatorProcess, temporal: Client, name: str
) -> WorkflowHandle[Any, Any]:
    """`training_job(name, 2)` applied and run by an operator until its status shows 2 nodes
    (the caller runs a worker); the operator is stopped again. The job's workflow."""
    kubectl("apply", "-n", NS, "-f", "-", stdin=yaml.safe_dump(training_job(name, 2)))
    with op.running():
        await wait_for(lambda: status(kubectl, name).get("replicas") == 2, "2 nodes")
    uid = resource(kubectl, name)["metadata"]["uid"]
    return temporal.get_workflow_handle(workflow_id(NS, name, uid))


async def wait_for(check: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    """Poll `check` (in a thread: the test's worker shares this event loop) until truthy."""
    deadline = time.monotonic() + timeout
    while not (found := await asyncio.to_thread(check)):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)
    return found


def resource(kubectl: Kubectl, name: str, kind: str = "trainingjob") -> dict | None:
    done = kubectl("get", "-n", NS, f"{kind}/{name}", "-o", "json", check=False)
    return json.loads(done.stdout) if done.returncode == 0 else None


def status(kubectl: Kubectl, name: str) -> dict:
    return (resource(kubectl, name) or {}).get("status") or {}


def outcome(kubectl: Kubectl, name: str, kind: str) -> str | None:
    """A ScaleIn's or ScaleOut's final phase (None while it has none)."""
    phase = ((resource(kubectl, name, kind) or {}).get("status") or {}).get("phase")
    return phase if phase in ("Succeeded", "Failed") else None


def events(kubectl: Kubectl, name: str) -> list[dict]:
    found = kubectl.json("get", "events", "-n", NS, f"--field-selector=involvedObject.name={name}")
    return found["items"]
