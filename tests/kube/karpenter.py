"""A real Karpenter controller on the test control plane: Karpenter's kwok provider (the `kwok`
command of sigs.k8s.io/karpenter, built by `infra/k8s/controlplane/build.sh karpenter`) with
its CRDs, one KWOKNodeClass, a NodePool (in two zones) and instance types that offer spot and
on-demand at their prices.

Karpenter does the real work of a NodeClaim: launch (its kwok provider makes the Node), the
registration and initialization, the deletion and drain of a claim (its termination
controller), consolidation. What its kwok provider leaves out, a kubelet and kube-controller-
manager's node lifecycle controller would do: `KarpenterNodes` stands in for them (each new
node posts Ready and loses the not-ready taint; with a LocalKubelet, that kubelet runs its
pods' commands). kwok makes boot time zero.

Spot capacity that runs out is modelled as Karpenter sees it: instance types without a spot
offering (its kwok provider reads them at start, so `offer_spot` restarts the controller).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, utils

from spotrain.activities.karpenter import KarpenterProvider
from tests.kube.k8s_cluster import ROOT, ControlPlane, _killed_with_parent, binaries
from tests.kube.kube_kubelet import LocalKubelet, syncing

NODE_CLASS = "karpenter.kwok.sh/KWOKNodeClass/default"
NODEPOOL = "training"
ZONES = ("us-east-1a", "us-east-1b")
# name -> (GPUs, spot price, on-demand price) per hour
TYPES = {"g5.xlarge": (1, 0.40, 1.01), "g5.2xlarge": (1, 0.48, 1.21)}
KWOK_NODE = "kwok.x-k8s.io/node"  # Karpenter's kwok provider marks its nodes so
NOT_READY = "node.kubernetes.io/not-ready"
RBAC = ROOT / "infra/k8s/karpenter/rbac.yaml"

CLUSTER_OBJECTS = f"""
apiVersion: karpenter.kwok.sh/v1alpha1
kind: KWOKNodeClass
metadata: {{name: default}}
---
apiVersion: karpenter.sh/v1
kind: NodePool
metadata: {{name: {NODEPOOL}}}
spec:
  template:
    spec:
      nodeClassRef: {{group: karpenter.kwok.sh, kind: KWOKNodeClass, name: default}}
      requirements:
      - {{key: karpenter.sh/capacity-type, operator: In, values: [spot, on-demand]}}
      # (what the provider offers a spec without zones in: activities/karpenter.offer_zones)
      - {{key: topology.kubernetes.io/zone, operator: In, values: [{", ".join(ZONES)}]}}
      expireAfter: Never
  # As eager to consolidate as Karpenter can be: a node it may take, it takes at once.
  disruption: {{consolidationPolicy: WhenEmptyOrUnderutilized, consolidateAfter: 0s}}
"""


def instance_types(spot: bool) -> list[dict[str, Any]]:
    """The kwok provider's instance types file: every type in every zone on demand, and on
    spot when `spot`."""

    def offering(price: float, capacity: str, zone: str) -> dict[str, Any]:
        requirements = [
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": [capacity]},
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [zone]},
        ]
        return {"Price": price, "Available": True, "Requirements": requirements}

    return [
        {
            "name": name,
            "architecture": "amd64",
            "operatingSystems": ["linux"],
            "resources": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": str(gpus), "pods": "110"},
            "offerings": [
                offering(price, capacity, zone)
                for zone in ZONES
                for capacity, price in (("spot", spot_price), ("on-demand", od_price))
                if capacity == "on-demand" or spot
            ],
        }
        for name, (gpus, spot_price, od_price) in TYPES.items()
    ]


class Karpenter:
    """The controller's process, started on `plane` (as system:masters) and restartable."""

    def __init__(self, plane: ControlPlane, work: Path) -> None:
        self.plane = plane
        self.work = work
        self.bin = binaries(component="karpenter")
        self.types_file = work / "instance-types.json"
        self.log = work / "karpenter.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.custom = client.CustomObjectsApi(plane.admin)

    def install(self) -> None:
        """The CRDs (once per control plane: they stay), the NodeClass and the NodePool."""
        ext = client.ApiextensionsV1Api(self.plane.admin)
        for path in sorted((self.bin / "crds").glob("*.yaml")):
            with contextlib.suppress(utils.FailToCreateError):  # installed by an earlier module
                utils.create_from_yaml(self.plane.admin, str(path))
            name = yaml.safe_load(path.read_text())["metadata"]["name"]
            _wait(lambda name=name: _established(ext.read_custom_resource_definition(name)), 30)
        for body in yaml.safe_load_all(CLUSTER_OBJECTS):
            group, version = body["apiVersion"].split("/")
            kind = body["kind"].lower()
            plural = kind + ("es" if kind.endswith("s") else "s")
            try:
                self.custom.create_cluster_custom_object(group, version, plural, body)
            except client.ApiException as err:
                if err.status != 409:  # (made by an earlier module: the same objects)
                    raise
        self.plane.ensure_namespace("karpenter")

    def start(self, spot: bool = True) -> None:
        self.types_file.write_text(json.dumps(instance_types(spot)))
        mark = self.log.stat().st_size if self.log.exists() else 0
        env = dict(
            os.environ,
            KUBECONFIG=str(self.plane.admin_kubeconfig),
            SYSTEM_NAMESPACE="karpenter",
            DISABLE_LEADER_ELECTION="true",
            METRICS_PORT="0",
            HEALTH_PROBE_PORT="0",
            INSTANCE_TYPES_FILE_PATH=str(self.types_file),
            LOG_LEVEL="debug",
        )
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(self.bin / "karpenter-kwok")],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_killed_with_parent,
            )
        _wait(lambda: self._serving(mark), 60, self.log_tail)

    def _serving(self, mark: int) -> bool:
        """Its controllers have started (their log lines after `mark`)."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"karpenter exited {self.proc.returncode}:\n{self.log_tail()}")
        with self.log.open("rb") as log:
            log.seek(mark)
            return b'"Starting workers"' in log.read()

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def offer_spot(self, spot: bool) -> None:
        """Spot capacity runs out (no spot offering left) or comes back: a restart."""
        self.stop()
        self.start(spot)

    def claims(self, selector: str = "spotrain.io/managed=true") -> dict[str, dict[str, Any]]:
        found = self.custom.list_cluster_custom_object(
            "karpenter.sh", "v1", "nodeclaims", label_selector=selector
        )
        return {c["metadata"]["name"]: c for c in found["items"]}

    def log_tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class KarpenterNodes:
    """Stands in for the kubelet of every node Karpenter's kwok provider makes (it posts the
    node Ready, as a kubelet's status would, with a LocalKubelet to run its pods) and for the
    node lifecycle controller (it lifts the not-ready taint from a Ready node)."""

    def __init__(self, plane: ControlPlane, kubelet: LocalKubelet | None = None) -> None:
        self.core = client.CoreV1Api(plane.admin)
        self.kubelet = kubelet

    @contextmanager
    def serving(self) -> Iterator[KarpenterNodes]:
        # (every 0.2 s, as the kubelet stand-in: each round lists every node, and Karpenter's
        # own loops take seconds, so 20 rounds a second only loaded the apiserver)
        with syncing(self.sync, 0.2, "Karpenter nodes' stand-in"):
            yield self

    def sync(self) -> None:
        for node in self.core.list_node().items:
            name = node.metadata.name
            if KWOK_NODE not in (node.metadata.annotations or {}):
                continue
            if self.kubelet is not None:
                self.kubelet.nodes.add(name)
            conditions = (node.status and node.status.conditions) or []
            if not any(c.type == "Ready" and c.status == "True" for c in conditions):
                ready = [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]
                self.core.patch_node_status(name, {"status": {"conditions": ready}})
                continue
            taints = node.spec.taints or []
            if any(t.key == NOT_READY for t in taints):
                kept = [t.to_dict() for t in taints if t.key != NOT_READY]
                self.core.patch_node(name, {"spec": {"taints": kept or None}})


def provider(cluster: ControlPlane, launch_timeout_s: float = 60) -> KarpenterProvider:
    """The Karpenter provider as the worker's ServiceAccount, on the NodePool above."""
    worker = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    return KarpenterProvider(
        worker, node_class=NODE_CLASS, nodepool=NODEPOOL, launch_timeout_s=launch_timeout_s
    )


def _established(crd: Any) -> bool:
    return any(c.type == "Established" and c.status == "True" for c in crd.status.conditions or [])


def _wait(check: Any, timeout: float, explain: Any = None) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"not ready in {timeout:g}s" + (f":\n{explain()}" if explain else "")
            )
        time.sleep(0.1)
