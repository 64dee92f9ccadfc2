"""SSH keys for the launcher-to-worker login of MPI and Horovod jobs on Kubernetes, on the
real control plane (tests/kube/k8s_cluster.py) as the `spotrain-worker` ServiceAccount: one key
pair per job in a Secret with the job's ownership labels, mounted into its pods, kept across
generations and retries, deleted with the job, and never read back, returned or logged.

No kubelet runs here, so the test materializes the Secret's files as its secret volume would
(mode 0400) and has the real OpenSSH tools read them: `ssh -G` resolves the login to a
generation's host, `ssh-keygen -y` derives authorized_keys' key from the private key (which it
refuses if others may read it) and `ssh-keygen -F` finds every host in known_hosts."""

from __future__ import annotations

import base64
import logging
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from kubernetes import client

from spotrain.activities.kube import KubeRuntime
from spotrain.workflows.contract import CleanupRequest
from tests.kube.k8s_cluster import ControlPlane, Request
from tests.kube.kube_support import (  # noqa: F401 (fixtures)
    JOB,
    NS,
    audit_fixture,
    ckpt_fixture,
    core_fixture,
    env_of,
    kube_fixture,
    plan_for,
    run,
    runtime_fixture,
    stop_request,
    worker_client_fixture,
)

SECRET = f"spotrain-{JOB}-ssh"
SSH = "/etc/spotrain/ssh"


def secret_files(core: client.CoreV1Api, into: Path) -> dict[str, str]:
    """The Secret's files, as the kubelet's secret volume would lay them out (0400)."""
    secret = core.read_namespaced_secret(SECRET, NS)
    files = {k: base64.b64decode(v).decode() for k, v in secret.data.items()}
    into.mkdir(mode=0o700)
    for name, text in files.items():
        (into / name).write_text(text)
        (into / name).chmod(0o400)
    return files


def openssh(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("job_type", ["mpi", "horovod"])
def test_a_login_key_pair_per_job_mounted_kept_and_deleted_with_it(
    kube: ControlPlane,
    core: client.CoreV1Api,
    runtime: KubeRuntime,
    audit: Callable[[], list[Request]],
    ckpt: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    job_type: str,
) -> None:
    if shutil.which("ssh-keygen") is None or shutil.which("ssh") is None:
        pytest.skip("the OpenSSH client tools are not installed")
    caplog.set_level(logging.DEBUG)
    assert run(runtime.start_generation, plan_for(ckpt, job_type=job_type)) is None
    secret = core.read_namespaced_secret(SECRET, NS)
    assert secret.metadata.labels == {"spotrain.io/managed": "true", "spotrain.io/job": JOB}
    files = secret_files(core, tmp_path / "ssh")
    private = files["id_ed25519"]
    assert private.startswith("-----BEGIN OPENSSH PRIVATE KEY-----")

    # Mounted into every pod of the generation, beside the hostfile of the generation.
    pod = core.read_namespaced_pod(f"{JOB}-g1-2", NS)
    mounts = {m.name: (m.mount_path, m.read_only) for m in pod.spec.containers[0].volume_mounts}
    assert mounts["ssh"] == (SSH, True) and mounts["hosts"] == ("/etc/spotrain/hosts", True)
    [volume] = [v.secret for v in pod.spec.volumes if v.secret]
    assert (volume.secret_name, volume.default_mode) == (SECRET, 0o400)
    assert env_of(pod)["SPOTRAIN_SSH_DIR"] == SSH
    assert private not in str(pod.to_dict())  # a reference, not the key

    # Real OpenSSH reads the files: the login to a generation's host uses the job's key and
    # known_hosts, the private key belongs to authorized_keys, and every host is known.
    hostfile = core.read_namespaced_config_map(f"spotrain-{JOB}-hosts", NS).data["hostfile"]
    hosts = [line.split()[0] for line in hostfile.splitlines()]
    config = openssh("ssh", "-G", "-F", str(tmp_path / "ssh/ssh_config"), hosts[1])
    assert f"identityfile {SSH}/id_ed25519" in config
    assert f"userknownhostsfile {SSH}/known_hosts" in config
    assert re.search(r"^stricthostkeychecking (true|yes)$", config, re.M), config
    derived = openssh("ssh-keygen", "-y", "-f", str(tmp_path / "ssh/id_ed25519")).split()
    assert derived[:2] == files["authorized_keys"].split()[:2]
    assert files["id_ed25519.pub"] == files["authorized_keys"]
    for host in hosts:
        found = openssh("ssh-keygen", "-F", host, "-f", str(tmp_path / "ssh/known_hosts"))
        assert derived[1] in found, host

    # A retried start and the next generation keep the pair (running pods log in with it).
    run(runtime.start_generation, plan_for(ckpt, job_type=job_type))
    run(runtime.stop_generation, stop_request(ckpt, graceful=False))
    run(runtime.start_generation, plan_for(ckpt, generation=2, nodes=2, job_type=job_type))
    assert secret_files(core, tmp_path / "again")["id_ed25519"] == private

    run(runtime.cleanup_job, CleanupRequest(job=JOB))
    assert core.list_namespaced_secret(NS, label_selector="spotrain.io/job").items == []
    run(runtime.cleanup_job, CleanupRequest(job=JOB))  # idempotent

    # Written once, deleted by name (the retried clean-up finds it gone), never read back; and
    # not in any log line.
    used = sorted({(r.verb, r.code) for r in audit() if r.resource == "secrets"})
    assert used == [("create", 201), ("create", 409), ("delete", 200), ("delete", 404)], used
    body = private.split("\n")[1]
    assert body not in caplog.text


def test_other_job_types_get_no_keys(
    kube: ControlPlane, core: client.CoreV1Api, runtime: KubeRuntime, ckpt: str
) -> None:
    run(runtime.start_generation, plan_for(ckpt, job_type="pytorch"))
    assert core.list_namespaced_secret(NS, label_selector="spotrain.io/job").items == []
    pod = core.read_namespaced_pod(f"{JOB}-g1-0", NS)
    assert not [v for v in pod.spec.volumes if v.secret]
