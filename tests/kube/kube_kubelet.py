"""Stand-ins for the kubelet, which cannot run here (no container runtime).

Each does what a kubelet does through the API, as the node's identity would, and nothing the
runtime under test could lean on: it writes pod status (container started, exited with a
code, waiting on a fault) and deletes a terminated pod that is being deleted (the kubelet's
final delete). `LocalKubelet` also runs each bound pod's command as a local process with the
pod's environment, its downwardAPI and ConfigMap volumes written to a local directory, and
`nodes_follow_instances` registers (and removes) a node per instance of the simulated cloud,
as an instance's kubelet would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import urllib3
from kubernetes import client

if TYPE_CHECKING:
    from spotrain.activities.simulated import SimulatedCloud
    from tests.kube.k8s_cluster import ControlPlane

log = logging.getLogger(__name__)


@contextmanager
def syncing(sync: Callable[[], None], every_s: float, what: str) -> Iterator[None]:
    """`sync()` every `every_s` in a thread while the block runs (stopped and joined on leaving,
    also on a failure). An API error is ridden out as a kubelet would (404 or 409: an object
    went or changed meanwhile; the rest, a loaded apiserver, logged): the next round retries."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every_s):
            try:
                sync()
            except (client.ApiException, OSError, urllib3.exceptions.HTTPError) as err:
                if getattr(err, "status", None) not in (404, 409):
                    log.warning("%s: sync failed, retrying", what, exc_info=err)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(pod: client.V1Pod, phase: str, state: dict[str, Any]) -> dict[str, Any]:
    ready = "True" if phase == "Running" else "False"
    # Every pod of this stand-in runs in this machine's network, as with hostNetwork.
    address = {} if phase == "Pending" else {"podIP": "127.0.0.1", "hostIP": "127.0.0.1"}
    return {
        "phase": phase,
        **address,
        "conditions": [
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": ready},
            {"type": "Ready", "status": ready},
        ],
        "containerStatuses": [
            {
                "name": c.name,
                "image": c.image,
                "imageID": "",
                "ready": ready == "True",
                "restartCount": 0,
                "state": state,
            }
            for c in pod.spec.containers
        ],
    }


def start_pod(core: client.CoreV1Api, ns: str, name: str) -> None:
    """The containers started: Running and Ready."""
    pod = core.read_namespaced_pod(name, ns)
    status = _status(pod, "Running", {"running": {"startedAt": _now()}})
    core.patch_namespaced_pod_status(name, ns, {"status": status})


def hold_pod(core: client.CoreV1Api, ns: str, name: str, reason: str, message: str) -> None:
    """The containers cannot start (e.g. ErrImagePull): Pending, waiting for that reason."""
    pod = core.read_namespaced_pod(name, ns)
    status = _status(pod, "Pending", {"waiting": {"reason": reason, "message": message}})
    core.patch_namespaced_pod_status(name, ns, {"status": status})


def finish_pod(core: client.CoreV1Api, ns: str, name: str, exit_code: int) -> None:
    """The container exited (restartPolicy Never): Succeeded on 0, else Failed. A pod being
    deleted is then removed, as the kubelet does once its containers have stopped."""
    pod = core.read_namespaced_pod(name, ns)
    terminated = {
        "exitCode": exit_code,
        "reason": "Completed" if exit_code == 0 else "Error",
        "finishedAt": _now(),
    }
    phase = "Succeeded" if exit_code == 0 else "Failed"
    core.patch_namespaced_pod_status(
        name, ns, {"status": _status(pod, phase, {"terminated": terminated})}
    )
    try:
        if core.read_namespaced_pod(name, ns).metadata.deletion_timestamp:
            core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
    except client.ApiException as err:
        if err.status != 404:  # (deleted meanwhile: nothing left to remove)
            raise


def downward_files(pod: client.V1Pod) -> dict[str, dict[str, str]]:
    """mountPath -> {file: content} of the pod's downwardAPI volumes (annotations only)."""
    volumes = {v.name: v for v in pod.spec.volumes or []}
    files: dict[str, dict[str, str]] = {}
    for mount in pod.spec.containers[0].volume_mounts or []:
        volume = volumes[mount.name]
        if volume.downward_api:
            annotations = pod.metadata.annotations or {}
            items = {}
            for item in volume.downward_api.items:
                key = re.fullmatch(r"metadata\.annotations\['(.+)'\]", item.field_ref.field_path)
                assert key, f"stand-in renders annotations only: {item.field_ref.field_path}"
                items[item.path] = annotations.get(key[1], "")
            files[mount.mount_path] = items
    return files


@dataclass
class _Container:
    proc: subprocess.Popen[bytes]
    root: Path
    uid: str  # the pod's: one deleted and made again under its name is another pod
    stopping_at: float | None = None


@dataclass
class LocalKubelet:
    """Stands in for the kubelet of `nodes` (names; see k8s_cluster's `fake=False`): runs each
    pod bound to them as a local process, keeps its status, stops it on deletion (SIGTERM,
    SIGKILL after the grace period) and kills it when its node object goes (the instance is
    gone). Volumes: downwardAPI files are rewritten every `refresh_s` (a real kubelet: about
    a minute) and so are ConfigMaps, unless `refresh_volumes` is off (a kubelet between two
    syncs: the files stay as the pod started); env values under a mount path point into
    `root`."""

    core: client.CoreV1Api
    namespace: str
    root: Path
    nodes: set[str] = field(default_factory=set)
    refresh_s: float = 0.2
    refresh_volumes: bool = True
    running: dict[str, _Container] = field(default_factory=dict)
    started: list[tuple[str, str, str]] = field(default_factory=list)  # pod, node, node-id

    @contextmanager
    def serving(self) -> Iterator[LocalKubelet]:
        try:
            with syncing(self.sync, self.refresh_s, "kubelet stand-in"):
                yield self
        finally:
            for container in self.running.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(container.proc.pid, signal.SIGKILL)
                container.proc.wait()
            self.running.clear()

    def sync(self) -> None:
        live_nodes = {n.metadata.name for n in self.core.list_node().items} & self.nodes
        pods = {p.metadata.name: p for p in self.core.list_namespaced_pod(self.namespace).items}
        for name, container in list(self.running.items()):
            pod = pods.get(name)
            if (
                pod is None
                or pod.metadata.uid != container.uid
                or pod.spec.node_name not in live_nodes
            ):
                os.killpg(container.proc.pid, signal.SIGKILL)  # force-deleted, or node gone
                container.proc.wait()
                del self.running[name]
                continue
            if self.refresh_volumes:
                self._volumes(pod, container.root)
            if pod.metadata.deletion_timestamp and container.stopping_at is None:
                grace = pod.metadata.deletion_grace_period_seconds or 0
                container.stopping_at = time.monotonic() + grace
                os.killpg(container.proc.pid, signal.SIGTERM)
            if container.stopping_at is not None and time.monotonic() >= container.stopping_at:
                os.killpg(container.proc.pid, signal.SIGKILL)
            code = container.proc.poll()
            if code is not None:
                del self.running[name]
                finish_pod(self.core, self.namespace, name, 0 if code == 0 else max(code, 1))
        for name, pod in pods.items():
            new = name not in self.running and pod.status.phase == "Pending"
            if new and pod.spec.node_name in live_nodes and not pod.metadata.deletion_timestamp:
                self._start(pod)

    def _start(self, pod: client.V1Pod) -> None:
        root = self.root / pod.metadata.name
        self._volumes(pod, root)
        mounts = {m.mount_path: root / m.mount_path.strip("/") for m in self._mounts(pod)}
        env = {}
        for var in pod.spec.containers[0].env or []:
            value = var.value or ""
            for path, local in sorted(mounts.items(), key=lambda m: -len(m[0])):
                if value == path or value.startswith(path + "/"):
                    value = str(local) + value[len(path) :]
                    break
            env[var.name] = value
        with (root / "log").open("wb") as log:
            proc = subprocess.Popen(
                pod.spec.containers[0].command,
                env={**os.environ, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.running[pod.metadata.name] = _Container(proc, root, pod.metadata.uid)
        node_id = (pod.metadata.annotations or {}).get("spotrain.io/node-id", "")
        self.started.append((pod.metadata.name, pod.spec.node_name, node_id))
        start_pod(self.core, self.namespace, pod.metadata.name)

    @staticmethod
    def _mounts(pod: client.V1Pod) -> list[client.V1VolumeMount]:
        return pod.spec.containers[0].volume_mounts or []

    def _volumes(self, pod: client.V1Pod, root: Path) -> None:
        for path, files in downward_files(pod).items():
            self._write(root / path.strip("/"), files)
        volumes = {v.name: v for v in pod.spec.volumes or []}
        for mount in self._mounts(pod):
            source = volumes[mount.name].config_map
            if source:
                cm = self.core.read_namespaced_config_map(source.name, self.namespace)
                self._write(root / mount.mount_path.strip("/"), cm.data or {}, source.default_mode)

    @staticmethod
    def _write(directory: Path, files: dict[str, str], mode: int | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            tmp = directory / f".{name}.tmp"
            tmp.write_text(content)
            if mode is not None:
                tmp.chmod(mode)
            tmp.replace(directory / name)  # atomic, as the kubelet's symlink swap is


def node_name(instance: str) -> str:
    """The node an instance of the simulated cloud registers as (EKS's naming)."""
    return f"ip-{instance}.ec2.internal"


@contextmanager
def nodes_follow_instances(
    cloud: SimulatedCloud, cluster: ControlPlane, kubelet: LocalKubelet
) -> Iterator[None]:
    """Each running instance of the simulated cloud is a node (its kubelet: `kubelet`); an
    instance that is gone takes its node with it."""
    core = client.CoreV1Api(cluster.admin)

    def sync() -> None:
        running = {node_name(n.node_id): n for n in cloud.running()}
        for name in set(running) - kubelet.nodes:
            info = running[name]
            cluster.add_node(name, info.node_id, zone=info.zone, fake=False)
            kubelet.nodes.add(name)
        for name in kubelet.nodes - set(running):
            core.delete_node(name)
            kubelet.nodes.discard(name)

    try:
        with syncing(sync, 0.2, "nodes following instances"):
            yield
    finally:
        sync()  # the instances released as the job ended take their nodes too
