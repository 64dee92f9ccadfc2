"""A real Kubernetes control plane on loopback ports, for tests and local runs.

etcd, kube-apiserver (RBAC on: `--authorization-mode=Node,RBAC`, a service-account issuer and
signing key), kube-scheduler and kwok, built from their Go modules by
infra/k8s/controlplane/build.sh (never downloaded). Certificates are generated per run.
Identities: `admin` (system:masters, for the test's own setup and inspection), and any
ServiceAccount through the TokenRequest API, each written as a kubeconfig file.

Only the kubelet is missing (no container runtime here). Two stand-ins, each on its own nodes:
- kwok manages the nodes created with `fake=True` (annotation spotrain.test/kwok=fake): it
  keeps them Ready and turns every pod bound to them Running and Ready, running nothing; a
  pod deleted with a grace period goes at its deletionTimestamp, as if its container ignored
  SIGTERM (tests/kube/k8s_config.py).
- nodes created with `fake=False` are left to the test, e.g. tests/kube/kube_kubelet.py, which runs
  a bound pod's command as a local process.

Run `python -m tests.kube.k8s_cluster` to start one and keep it until Ctrl-C (README).
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kubernetes import client, config, utils

from spotrain.workers.embedded.stack import free_port
from tests.kube.k8s_certs import b64, dn, issue_cert, new_key, pem_key
from tests.kube.k8s_config import AUDIT_POLICY, KWOK_STAGES

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "infra/k8s/controlplane/build.sh"
NAMESPACE = "spotrain-jobs"  # the training pods' (infra/k8s/namespace.yaml)
SYSTEM_NAMESPACE = "spotrain"  # spotrain's own accounts
PR_SET_PDEATHSIG = 1
CRD_GROUP, CRD_VERSION = "spotrain.io", "v1alpha1"
CUSTOM_RESOURCES = ("trainingjobs", "scaleins", "scaleouts")
# One grant of each of infra/k8s/rbac.yaml's bindings, waited for before any test runs.
RBAC_IN_FORCE = (
    ("spotrain-worker", "create", "pods", NAMESPACE),
    ("spotrain-worker", "list", "nodes", ""),
    ("spotrain-webhook", "get", "nodes", ""),
)
# annotation: kwok manages this node and its pods (not kwok's own kwok.x-k8s.io/node, which
# Karpenter's kwok provider puts on every node it makes: tests/kube/karpenter.py keeps those)
FAKE = "spotrain.test/kwok"
TOOLS = ("etcd", "kube-apiserver", "kube-scheduler", "kwok")


@dataclass(frozen=True)
class Request:
    """One API request as the audit log records it."""

    user: str
    verb: str
    resource: str
    name: str
    code: int
    uri: str


class MissingBinaries(RuntimeError):
    """The control plane's binaries are not built (run infra/k8s/controlplane/build.sh)."""


COMPONENTS = {  # build.sh's argument -> the variable naming its directory, what it holds
    "controlplane": ("SPOTRAIN_K8S_BIN", TOOLS),
    "karpenter": ("SPOTRAIN_KARPENTER_BIN", ("karpenter-kwok", "crds")),
}


def binaries(build: bool = False, component: str = "controlplane") -> Path:
    """The directory holding a component's pinned binaries: its variable (SPOTRAIN_K8S_BIN,
    SPOTRAIN_KARPENTER_BIN), else build.sh's cache (building them first only if `build`)."""
    variable, tools = COMPONENTS[component]
    if variable in os.environ:
        found = Path(os.environ[variable])
    else:
        if not build and shutil.which("go") is None:
            raise MissingBinaries(f"no Go toolchain to locate or build the {component}")
        env = dict(os.environ, SPOTRAIN_K8S_CHECK_ONLY="" if build else "1")
        done = subprocess.run(
            ["bash", str(BUILD), component], env=env, capture_output=True, text=True
        )
        if done.returncode:
            raise MissingBinaries(done.stderr.strip().splitlines()[-1])
        found = Path(done.stdout.strip())
    missing = [t for t in tools if not (found / t).exists()]
    if missing:
        raise MissingBinaries(
            f"{missing} not in {found}: run {BUILD.relative_to(ROOT)} {component}"
        )
    return found


# --- the control plane ---------------------------------------------------------------------


class ControlPlane:
    """Start with `ControlPlane.running(...)`; everything started is stopped on exit."""

    def __init__(self, bin_dir: Path, work: Path) -> None:
        self.bin = bin_dir
        self.work = work
        self.etcd_url = ""
        self.url = ""
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._ca_key = new_key()
        self._ca = issue_cert(dn("spotrain-test-ca"), self._ca_key, None)
        self.ca_file = self._write("ca.crt", self._ca.public_bytes(serialization.Encoding.PEM))
        self.audit_log = work / "audit.log"

    @classmethod
    @contextmanager
    def running(cls, bin_dir: Path | None = None) -> Iterator[ControlPlane]:
        with ExitStack() as stack:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="spotrain-k8s-")))
            plane = cls(bin_dir or binaries(), work)
            stack.callback(plane.stop)
            plane.start()
            yield plane

    def _write(self, name: str, data: bytes | str) -> Path:
        path = self.work / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        path.chmod(0o600)
        return path

    def _issue(self, name: str, subject: x509.Name, sans: list[x509.GeneralName] | None = None):
        key = new_key()
        cert = issue_cert(subject, key, (self._ca, self._ca_key), sans=sans)
        return (
            self._write(f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            self._write(f"{name}.key", pem_key(key)),
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        with (self.work / f"{name}.log").open("wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [str(self.bin / args[0]), *args[1:]],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, killed whole in stop()
                preexec_fn=_killed_with_parent,  # if this process dies without stop()
            )
        self._procs.append((name, proc))

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.work / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _wait(self, what: str, probe: Any, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self._procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited {proc.returncode}:\n{self.log_tail(name)}")
            try:
                if probe():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not up in {timeout:g}s")
            time.sleep(0.2)

    def start(self) -> None:
        t0 = time.monotonic()
        client_port, peer_port, api_port = free_port(), free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        self._spawn(
            "etcd",
            [
                "etcd",
                f"--data-dir={self.work / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=default={peer}",
                "--unsafe-no-fsync",  # a test's data need not survive a power cut
                "--log-level=warn",
            ],
        )
        self._wait("etcd", lambda: urllib.request.urlopen(f"{self.etcd_url}/health").status == 200)

        sans: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            x509.DNSName("kubernetes.default.svc"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        ]
        serving = self._issue("apiserver", dn("kube-apiserver"), sans)
        sa_key = new_key()
        sa_pub = sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self._write("sa.key", pem_key(sa_key))
        self._write("sa.pub", sa_pub)
        self.url = f"https://127.0.0.1:{api_port}"
        self._spawn(
            "kube-apiserver",
            [
                "kube-apiserver",
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--tls-cert-file={serving[0]}",
                f"--tls-private-key-file={serving[1]}",
                f"--client-ca-file={self.ca_file}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={self.work / 'sa.pub'}",
                f"--service-account-signing-key-file={self.work / 'sa.key'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                # Watches read etcd directly, so compacting etcd makes an old resourceVersion
                # answer 410 Gone at once (the watch cache would serve it from memory).
                "--watch-cache=false",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                # Every request, with its identity and outcome: what the tests check RBAC by.
                f"--audit-policy-file={self._write('audit-policy.yaml', AUDIT_POLICY)}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-mode=blocking",
            ],
        )
        self.admin_kubeconfig = self._cert_kubeconfig("admin", dn("admin", "system:masters"))
        self.admin = self.api_client(self.admin_kubeconfig)
        self._wait("kube-apiserver", self._ready, timeout=180)

        scheduler = self._cert_kubeconfig("scheduler", dn("system:kube-scheduler"))
        self._spawn(
            "kube-scheduler",
            [
                "kube-scheduler",
                f"--kubeconfig={scheduler}",
                "--leader-elect=false",
                "--secure-port=0",  # no metrics/health endpoint: nothing scrapes it here
            ],
        )
        stages = self._write("kwok-stages.yaml", KWOK_STAGES)
        kwok = self._cert_kubeconfig("kwok", dn("kwok", "system:masters"))
        self._spawn(
            "kwok",
            [
                "kwok",
                f"--kubeconfig={kwok}",
                f"--config={stages}",
                f"--manage-nodes-with-annotation-selector={FAKE}=fake",
                "--cidr=10.244.0.0/16",
                "--node-ip=10.0.0.1",
            ],
        )
        # The deployment's own manifests, as `kubectl apply -f` would send them.
        for manifest in ("namespace.yaml", "rbac.yaml"):
            utils.create_from_yaml(self.admin, str(ROOT / "infra/k8s" / manifest))
        self.ensure_namespace(NAMESPACE)
        for account, verb, resource, namespace in RBAC_IN_FORCE:
            self.wait_until_allowed(account, verb, resource, namespace)
        self.startup_s = time.monotonic() - t0

    def _ready(self) -> bool:
        try:
            ctx = ssl.create_default_context(cafile=str(self.ca_file))
            ctx.load_cert_chain(self.work / "admin.crt", self.work / "admin.key")
            with urllib.request.urlopen(f"{self.url}/readyz", context=ctx, timeout=5) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False

    def stop(self) -> None:
        """Stop each process group, newest first (etcd outlives the apiserver, so it is not
        left retrying a dead store): SIGTERM, then SIGKILL after 5 s."""
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()

    # --- identities ------------------------------------------------------------------------

    def _kubeconfig(self, name: str, user: dict[str, str]) -> Path:
        doc = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "spotrain-test",
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": b64(self.ca_file.read_bytes()),
                    },
                }
            ],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": name, "context": {"cluster": "spotrain-test", "user": name}}],
            "current-context": name,
        }
        return self._write(f"{name}.kubeconfig", yaml.safe_dump(doc))

    def _cert_kubeconfig(self, name: str, subject: x509.Name) -> Path:
        crt, key = self._issue(name, subject)
        user = {
            "client-certificate-data": b64(crt.read_bytes()),
            "client-key-data": b64(key.read_bytes()),
        }
        return self._kubeconfig(name, user)

    def user_kubeconfig(self, name: str, group: str | None = None) -> Path:
        """A kubeconfig for a user by client certificate (CN the name, O the group)."""
        return self._cert_kubeconfig(name, dn(name, group))

    def service_account_kubeconfig(self, name: str, namespace: str = SYSTEM_NAMESPACE) -> Path:
        """A kubeconfig holding a token for the ServiceAccount (TokenRequest API, 1 h)."""
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=3600)
        )
        token = (
            client.CoreV1Api(self.admin)
            .create_namespaced_service_account_token(name, namespace, request)
            .status.token
        )
        return self._kubeconfig(f"{namespace}-{name}", {"token": token})

    @staticmethod
    def api_client(kubeconfig: Path) -> client.ApiClient:
        return config.new_client_from_config(config_file=str(kubeconfig))

    # --- cluster contents ------------------------------------------------------------------

    def ensure_namespace(self, name: str) -> None:
        """The namespace with its `default` ServiceAccount, which the ServiceAccount admission
        plugin requires of every pod (kube-controller-manager would create it; not run here)."""
        core = client.CoreV1Api(self.admin)
        for create, body in (
            (core.create_namespace, {"metadata": {"name": name}}),
            (
                lambda b: core.create_namespaced_service_account(name, b),
                {"metadata": {"name": "default"}},
            ),
        ):
            try:
                create(body)
            except client.ApiException as err:
                if err.status != 409:
                    raise

    def wait_until_allowed(
        self,
        service_account: str,
        verb: str,
        resource: str,
        namespace: str,
        timeout: float = 60,
        group: str = "",
    ) -> None:
        """Until the apiserver's authorizer lets `service_account` (of spotrain's namespace) do
        `verb` on `resource`: RBAC authorizes from an informer's cache, so a Role or RoleBinding
        just created is not in force yet (a 403 right after creating one, seen beside two busy
        loops)."""
        review = client.V1SubjectAccessReview(
            spec=client.V1SubjectAccessReviewSpec(
                user=f"system:serviceaccount:{SYSTEM_NAMESPACE}:{service_account}",
                groups=["system:serviceaccounts", f"system:serviceaccounts:{SYSTEM_NAMESPACE}"],
                resource_attributes=client.V1ResourceAttributes(
                    namespace=namespace, verb=verb, resource=resource, group=group
                ),
            )
        )
        authz = client.AuthorizationV1Api(self.admin)
        self._wait(
            f"{service_account} allowed to {verb} {resource} in {namespace}",
            lambda: authz.create_subject_access_review(review).status.allowed,
            timeout,
        )

    def add_node(
        self,
        name: str,
        instance_id: str,
        *,
        zone: str = "us-east-1a",
        taints: list[dict[str, str]] | None = None,
        gpus: int = 0,
        fake: bool = True,
    ) -> None:
        """A node as an EKS kubelet registers it: providerID `aws:///<zone>/<id>`, the
        instance-id and zone labels. With `fake`, kwok keeps it Ready and runs its pods."""
        labels = {
            "kubernetes.io/hostname": name,
            "kubernetes.io/os": "linux",
            "topology.kubernetes.io/zone": zone,
            "node.kubernetes.io/instance-id": instance_id,
        }
        body = {
            "metadata": {
                "name": name,
                "labels": labels,
                "annotations": {FAKE: "fake"} if fake else {},
            },
            "spec": {"providerID": f"aws:///{zone}/{instance_id}", "taints": taints or []},
        }
        core = client.CoreV1Api(self.admin)
        core.create_node(body)
        resources = {"cpu": "64", "memory": "256Gi", "pods": "110"}
        if gpus:
            resources["nvidia.com/gpu"] = str(gpus)
        status = {"capacity": resources, "allocatable": resources}
        if not fake:
            status["conditions"] = [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]
        core.patch_node_status(name, {"status": status})
        # The apiserver taints a new node not-ready; kube-controller-manager's node lifecycle
        # controller lifts the taint once the node is Ready. That controller is not run here
        # (the runtime relies on none), so this does its part.
        deadline = time.monotonic() + 30
        while not _ready(core.read_node(name)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {name} not Ready in 30 s:\n{self.log_tail('kwok')}")
            time.sleep(0.05)
        core.patch_node(name, [{"op": "replace", "path": "/spec/taints", "value": taints or []}])

    def audit_mark(self) -> int:
        return self.audit_log.stat().st_size if self.audit_log.exists() else 0

    def requests(self, user: str, since: int = 0) -> list[Request]:
        """Requests by `user` (e.g. system:serviceaccount:spotrain:spotrain-worker) logged
        after the audit log's offset `since`, oldest first. A request is logged just after its
        response: a marker request, once logged, shows the log has caught up."""
        marker = f"audit-marker-{uuid.uuid4().hex}"
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(self.admin).read_namespace(marker)
        deadline = time.monotonic() + 10
        while True:
            with self.audit_log.open("rb") as log:
                log.seek(since)
                lines = log.read().splitlines()
            if any(marker.encode() in line for line in reversed(lines)):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the audit log did not catch up in 10 s")
            time.sleep(0.05)
        found = []
        for line in lines:
            event = json.loads(line)
            if event["user"]["username"] != user:
                continue
            ref = event.get("objectRef") or {}
            resource = ref.get("resource", "")
            if ref.get("subresource"):
                resource += "/" + ref["subresource"]
            found.append(
                Request(
                    user=user,
                    verb=event["verb"],
                    resource=resource,
                    name=ref.get("name", ""),
                    code=event.get("responseStatus", {}).get("code", 0),
                    uri=event["requestURI"],
                )
            )
        return found

    def reset(self) -> None:
        """Remove what a test left: spotrain's objects in every namespace (pods at once, as a
        force delete does), every node, and every TrainingJob, ScaleIn and ScaleOut."""
        core = client.CoreV1Api(self.admin)
        selector = "spotrain.io/managed=true"
        for pod in core.list_pod_for_all_namespaces(label_selector=selector).items:
            _gone(
                core.delete_namespaced_pod,
                pod.metadata.name,
                pod.metadata.namespace,
                grace_period_seconds=0,
            )
        for svc in core.list_service_for_all_namespaces(label_selector=selector).items:
            _gone(core.delete_namespaced_service, svc.metadata.name, svc.metadata.namespace)
        for cm in core.list_config_map_for_all_namespaces(label_selector=selector).items:
            _gone(core.delete_namespaced_config_map, cm.metadata.name, cm.metadata.namespace)
        for secret in core.list_secret_for_all_namespaces(label_selector=selector).items:
            _gone(core.delete_namespaced_secret, secret.metadata.name, secret.metadata.namespace)
        custom = client.CustomObjectsApi(self.admin)
        for claim in _listed(custom, "karpenter.sh", "v1", "nodeclaims"):
            name = claim["metadata"]["name"]  # (Karpenter's finalizer: Karpenter has gone)
            args = ("karpenter.sh", "v1", "nodeclaims", name)
            _gone(custom.patch_cluster_custom_object, *args, {"metadata": {"finalizers": None}})
            _gone(custom.delete_cluster_custom_object, *args)
        for node in core.list_node().items:
            if node.metadata.finalizers:
                _gone(core.patch_node, node.metadata.name, {"metadata": {"finalizers": None}})
            _gone(core.delete_node, node.metadata.name)
        for plural in CUSTOM_RESOURCES:
            # (an operator's finalizer: its operator has gone)
            for obj in _listed(custom, CRD_GROUP, CRD_VERSION, plural):
                meta = obj["metadata"]
                args = (CRD_GROUP, CRD_VERSION, meta["namespace"], plural, meta["name"])
                _gone(
                    custom.patch_namespaced_custom_object, *args, {"metadata": {"finalizers": None}}
                )
                _gone(custom.delete_namespaced_custom_object, *args)

    def compact_etcd(self) -> None:
        """Compact etcd up to its current revision (the apiserver does this every 5 minutes):
        every older resourceVersion is then 410 Gone to a watch."""
        body = b'{"key": "AA==", "range_end": "AA==", "limit": 1}'  # any key: for the revision
        with urllib.request.urlopen(f"{self.etcd_url}/v3/kv/range", body) as resp:
            revision = yaml.safe_load(resp.read())["header"]["revision"]
        compact = f'{{"revision": "{revision}", "physical": true}}'.encode()
        urllib.request.urlopen(f"{self.etcd_url}/v3/kv/compaction", compact).close()


def _killed_with_parent() -> None:
    """Before exec: the kernel SIGKILLs the process when its owner dies. Not SIGTERM: with
    etcd gone too, kube-apiserver's graceful shutdown outlived its owner by over 30 s (seen
    in tests/kube/test_kube_apiserver.py)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _listed(custom: client.CustomObjectsApi, group: str, version: str, plural: str) -> list[Any]:
    """Every object of a kind; none when its CRD is not installed."""
    try:
        return list(custom.list_cluster_custom_object(group, version, plural)["items"])
    except client.ApiException as err:
        if err.status == 404:
            return []
        raise


def _ready(node: client.V1Node) -> bool:
    conditions = (node.status and node.status.conditions) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _gone(delete: Any, *args: Any, **kwargs: Any) -> None:
    try:
        delete(*args, **kwargs)
    except client.ApiException as err:
        if err.status != 404:
            raise


def control_plane_or_skip(component: str = "controlplane") -> Path:
    """The binaries' directory; without them skip, except in CI (CI=true), where it fails."""
    try:
        return binaries(component=component)
    except MissingBinaries as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must test against the real control plane: {err}")
        pytest.skip(f"no Kubernetes control plane: {err}")


def main() -> None:
    """Start a control plane and keep it until Ctrl-C, printing each identity's kubeconfig.
    Ctrl-C is heard from the start, before "control plane up" is printed: a background job
    starts with SIGINT ignored, and a SIGINT sent on that line before the handler was set was
    lost (the owner slept on; test_no_control_plane_process_outlives_its_owner timed out)."""
    for stop in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: a background job ignores it
        signal.signal(stop, signal.default_int_handler)
    with ControlPlane.running(binaries(build=True)) as plane:
        worker = plane.service_account_kubeconfig("spotrain-worker")
        webhook = plane.service_account_kubeconfig("spotrain-webhook")
        for i in range(3):
            plane.add_node(f"ip-10-0-0-{i + 1}.ec2.internal", f"i-0{i}aaaaaaaaaaaa")
        print(f"control plane up in {plane.startup_s:.1f}s at {plane.url}", flush=True)
        print(f"  admin:   KUBECONFIG={plane.admin_kubeconfig}")
        print(f"  worker:  KUBECONFIG={worker}")
        print(f"  webhook: KUBECONFIG={webhook}")
        print("Ctrl-C stops etcd, kube-apiserver, kube-scheduler and kwok.", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    sys.exit(main())
