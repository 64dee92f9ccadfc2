"""The Kubernetes tests' control plane: one per test process, started by the first test that
needs it and stopped at the end of the run; each test module leaves it as it found it
(spotrain's objects, nodes and custom resources removed), so a module sees no other's. A test
that asks for `karpenter` gets a Karpenter controller on it (one per test process too)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kube.k8s_cluster import ControlPlane, control_plane_or_skip
from tests.kube.karpenter import RBAC, Karpenter, KarpenterNodes
from tests.kube.kubectl import Kubectl, kubectl_binary

_started: list[ControlPlane] = []  # the process's plane, once a test has asked for it


@pytest.fixture(scope="session", name="control_plane")
def control_plane_fixture() -> Iterator[ControlPlane]:
    """Its processes lead their own process groups, are stopped here, and are SIGKILLed by
    the kernel if this process dies first (tests/kube/test_kube_apiserver.py checks both)."""
    with ControlPlane.running(control_plane_or_skip()) as plane:
        _started.append(plane)
        yield plane
        _started.clear()


@pytest.fixture(autouse=True, scope="module")
def _module_leaves_the_plane_empty() -> Iterator[None]:
    yield
    for plane in _started:
        plane.reset()


@pytest.fixture(name="cluster")
def cluster_fixture(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The shared control plane, emptied of spotrain's objects and nodes after the test."""
    yield control_plane
    control_plane.reset()


@pytest.fixture(scope="session", name="karpenter")
def karpenter_fixture(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Karpenter]:
    """One controller per test process, as the control plane (each module's reset removes
    the NodeClaims it left). The worker's grant is applied as docs/guides/eks.md says."""
    control_plane_or_skip("karpenter")
    controller = Karpenter(control_plane, tmp_path_factory.mktemp("karpenter"))
    controller.install()
    kubectl = Kubectl(kubectl_binary(control_plane), control_plane.admin_kubeconfig)
    kubectl("apply", "-f", str(RBAC))
    control_plane.wait_until_allowed(
        "spotrain-worker", "create", "nodeclaims", "", group="karpenter.sh"
    )
    controller.start()
    try:
        yield controller
    finally:
        controller.stop()


@pytest.fixture(name="nodes")
def nodes_fixture(cluster: ControlPlane, karpenter: Karpenter) -> Iterator[KarpenterNodes]:
    with KarpenterNodes(cluster).serving() as nodes:
        yield nodes
