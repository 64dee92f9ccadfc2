"""Who may reach Temporal: every spotrain process connects through the SDK's environment
configuration (workers/connect.py), so mutual TLS set there (TEMPORAL_TLS_* or a profile in
temporal.toml) holds for the CLI, the worker and the webhook alike. Against the real dev
server behind a TLS front that requires a client certificate (tests/cli/tls_proxy.py: the dev
server has no TLS of its own): with the certificate they work, without it or with one from
another CA they fail, saying where they could not connect, and no secret reaches the output."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography import x509
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.connect import connect
from spotrain.workflows.job.state import JobResult
from tests.cli.tls_proxy import TlsProxy
from tests.jobs import fast_runtime, fast_spec, simulated
from tests.kube.k8s_certs import dn, issue_cert, new_key, pem_key


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # issued by another CA
    rogue_key: Path


def write_pki(base: Path) -> Pki:
    files: dict[str, Path] = {}

    def save(name: str, cert: x509.Certificate, key: object) -> None:
        files[f"{name}_cert"] = base / f"{name}.pem"
        files[f"{name}_key"] = base / f"{name}-key.pem"
        files[f"{name}_cert"].write_bytes(cert.public_bytes(_PEM))
        files[f"{name}_key"].write_bytes(pem_key(key))  # type: ignore[arg-type]
        files[f"{name}_key"].chmod(0o600)

    ca_key, other_key = new_key(), new_key()
    ca = issue_cert(dn("spotrain test CA"), ca_key, None)
    other = issue_cert(dn("someone else's CA"), other_key, None)
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    for name, subject, issuer in (
        ("server", dn("localhost"), (ca, ca_key)),
        ("client", dn("spotrain-ci", "ml-platform"), (ca, ca_key)),
        ("rogue", dn("spotrain-ci", "ml-platform"), (other, other_key)),
    ):
        key = new_key()
        save(name, issue_cert(subject, key, issuer, sans=sans), key)
    (base / "ca.pem").write_bytes(ca.public_bytes(_PEM))
    return Pki(
        ca=base / "ca.pem",
        server_cert=files["server_cert"],
        server_key=files["server_key"],
        client_cert=files["client_cert"],
        client_key=files["client_key"],
        rogue_cert=files["rogue_cert"],
        rogue_key=files["rogue_key"],
    )


_PEM = __import__("cryptography.hazmat.primitives.serialization", fromlist=["x"]).Encoding.PEM


@dataclass
class Secured:
    pki: Pki
    proxy: TlsProxy
    address: str

    def env(self, cert: Path | None, key: Path | None) -> dict[str, str]:
        """The standard variables for this server, with this client certificate (or none)."""
        env = {
            "TEMPORAL_ADDRESS": self.address,
            "TEMPORAL_TLS_SERVER_CA_CERT_PATH": str(self.pki.ca),
            "TEMPORAL_TLS_SERVER_NAME": "localhost",
        }
        if cert and key:
            env |= {
                "TEMPORAL_TLS_CLIENT_CERT_PATH": str(cert),
                "TEMPORAL_TLS_CLIENT_KEY_PATH": str(key),
            }
        return env


@pytest_asyncio.fixture(loop_scope="session")
async def secured(dev_env: WorkflowEnvironment, tmp_path: Path) -> AsyncIterator[Secured]:
    pki = write_pki(tmp_path)
    host, port = dev_env.client.service_client.config.target_host.rsplit(":", 1)
    proxy = TlsProxy((host, int(port)), pki.server_cert, pki.server_key, pki.ca)
    await proxy.start()
    yield Secured(pki, proxy, f"127.0.0.1:{proxy.port}")
    await proxy.stop()


def plain_env() -> dict[str, str]:
    """This process's environment without any Temporal setting of the developer's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TEMPORAL_")}


async def spotrain(env: dict[str, str], *argv: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "spotrain.workers.cli.main",
        *argv,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def test_the_cli_connects_with_its_client_certificate_and_fails_clearly_without(
    secured: Secured, tmp_path: Path
) -> None:
    pki = secured.pki
    code, out = await spotrain(plain_env() | secured.env(pki.client_cert, pki.client_key), "list")
    assert code == 0, out
    assert secured.proxy.admitted == ["spotrain-ci"]  # it presented the certificate

    api_key = f"sentinel-{uuid.uuid4().hex}"  # a secret that must never be printed
    for cert, key, how in (
        (None, None, "TLS, no client certificate, an API key"),
        (pki.rogue_cert, pki.rogue_key, "TLS with a client certificate, an API key"),
    ):
        env = plain_env() | secured.env(cert, key) | {"TEMPORAL_API_KEY": api_key}
        code, out = await spotrain(env, "list")
        assert code == 3, out  # the CLI's "Temporal unreachable"
        assert f"cannot reach Temporal at {secured.address} (namespace default, {how})" in out
        assert "TEMPORAL_TLS_CLIENT_CERT_PATH" in out and "Traceback" not in out, out
        assert api_key not in out and "PRIVATE KEY" not in out
    assert secured.proxy.admitted == ["spotrain-ci"] and secured.proxy.refused >= 2


async def test_a_profile_in_temporal_toml_carries_the_tls_settings(
    secured: Secured, tmp_path: Path
) -> None:
    pki = secured.pki
    config = tmp_path / "temporal.toml"
    config.write_text(
        f'[profile.secure]\naddress = "{secured.address}"\nnamespace = "default"\n'
        f"[profile.secure.tls]\n"
        f'server_ca_cert_path = "{pki.ca}"\nserver_name = "localhost"\n'
        f'client_cert_path = "{pki.client_cert}"\nclient_key_path = "{pki.client_key}"\n'
    )
    env = plain_env() | {"TEMPORAL_CONFIG_FILE": str(config), "TEMPORAL_PROFILE": "secure"}
    code, out = await spotrain(env, "list")
    assert code == 0, out
    assert secured.proxy.admitted == ["spotrain-ci"]


async def test_a_worker_connected_with_mtls_runs_a_job(
    secured: Secured, dev_env: WorkflowEnvironment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's connection (connect(), as `spotrain worker` and the webhook make it)
    goes through the TLS front; the job, started by someone else, runs on it to the end."""
    pki = secured.pki
    for name, value in secured.env(pki.client_cert, pki.client_key).items():
        monkeypatch.setenv(name, value)
    client = await connect()
    async with simulated(client, runtime=fast_runtime()) as sim:
        spec = fast_spec(total_steps=100)
        handle = await dev_env.client.start_workflow(
            "TrainingJob", spec, id=spec["name"], task_queue=sim.task_queue, result_type=JobResult
        )
        result = await asyncio.wait_for(handle.result(), 120)
    assert result.phase == "Succeeded" and result.steps_done == 100
    assert set(secured.proxy.admitted) == {"spotrain-ci"}


async def test_spotrain_worker_connects_with_its_certificate_and_exits_clearly_without(
    secured: Secured,
) -> None:
    pki = secured.pki
    argv = ["-m", "spotrain.workers.worker", "--provider", "simulated", "--runtime", "simulated"]
    argv += ["--task-queue", f"tls-{uuid.uuid4().hex[:8]}"]
    env = plain_env() | secured.env(pki.client_cert, pki.client_key)
    worker = await asyncio.create_subprocess_exec(
        sys.executable, *argv, env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        for _ in range(300):  # until it holds a connection through the TLS front
            if secured.proxy.admitted or worker.returncode is not None:
                break
            await asyncio.sleep(0.1)
        assert worker.returncode is None and secured.proxy.admitted[:1] == ["spotrain-ci"]
    finally:
        worker.terminate()
        await asyncio.wait_for(worker.wait(), 30)

    refused = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        env=plain_env() | secured.env(None, None),
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(refused.communicate(), 60)
    assert refused.returncode == 1, err
    assert err.decode().startswith(f"spotrain worker: cannot reach Temporal at {secured.address}")
    assert b"Traceback" not in err
