"""`kubectl`, built from the same pinned Kubernetes module as the control plane
(infra/k8s/controlplane/build.sh), driving the tests as a user would; and the spotrain custom
resources (infra/k8s/crds.yaml) installed on the test control plane."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.kube.k8s_cluster import ROOT, ControlPlane

CRDS = ROOT / "infra/k8s/crds.yaml"


@dataclass(frozen=True)
class Kubectl:
    binary: Path
    kubeconfig: Path

    def __call__(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(self.binary), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and done.returncode:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
            )
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json").stdout)

    def as_user(self, kubeconfig: Path) -> Kubectl:
        return Kubectl(self.binary, kubeconfig)


def kubectl_binary(plane: ControlPlane) -> Path:
    """kubectl beside the control plane's binaries; without it skip, except in CI."""
    found = plane.bin / "kubectl"
    if not found.is_file():
        why = f"no kubectl in {plane.bin}: run infra/k8s/controlplane/build.sh"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return found


@pytest.fixture(scope="module", name="kubectl")  # as the control plane's
def kubectl_fixture(control_plane: ControlPlane) -> Kubectl:
    """kubectl as the cluster's admin, the spotrain CRDs applied and established."""
    kubectl = Kubectl(kubectl_binary(control_plane), control_plane.admin_kubeconfig)
    kubectl("apply", "-f", str(CRDS))
    # `kubectl wait` fails at once, not waits, on a CRD the apiserver has not yet given any
    # condition ("accessor error: <nil>"): seen in CI on a loaded machine. Asked again then.
    deadline = time.monotonic() + 60
    while True:
        wait = (
            "wait",
            "--for=condition=Established",
            "crd",
            "-l",
            "app.kubernetes.io/part-of=spotrain",
        )
        done = kubectl(*wait, check=False)
        if done.returncode == 0:
            return kubectl
        if "accessor error" not in done.stderr or time.monotonic() > deadline:
            raise AssertionError(
                f"kubectl {' '.join(wait)} exited {done.returncode}:\n{done.stderr}"
            )
        time.sleep(0.5)
