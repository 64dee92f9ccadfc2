"""What the webhook tests share: the service on a free port (and as a real process), a
recording workflow that stands in for TrainingJob, a fake SNS certificate host, AWS event
bodies, and the SQS queue's helpers. The fixtures are in conftest.py."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import boto3
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID
from temporalio import workflow
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from spotrain.workers import webhook
from spotrain.workers.webhook.auth import AuthConfig, sns_string_to_sign
from spotrain.workers.webhook.server import NodeNames, WebhookConfig, WebhookService
from spotrain.workflows.contract import NodeLost, ReclaimNotice
from spotrain.workflows.job import attributes

TOKEN = "test-token-not-a-secret"
HMAC_SECRET = "test-hmac-secret"
TOPIC = "arn:aws:sns:us-east-1:123456789012:spotrain-reclaims"
CERT_URL = "https://sns.us-east-1.amazonaws.com/SimpleNotificationService-0123abcd.pem"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
OPENAPI = Path(webhook.__file__).with_name("openapi.yaml")
# Each Temporal call's timeout in the tests' webhooks, unless a test sets its own: a dev server
# on a loaded machine may take over the product's 5 s, and the webhook then rightly answers
# 503, which a test of anything else must not take for a fault.
RPC_TIMEOUT_S = 60.0


@workflow.defn(name="RecordingJob")
class RecordingJob:
    """Stands in for TrainingJob: owns `node_ids` and records the signals it receives."""

    def __init__(self) -> None:
        self.signals: list[dict[str, Any]] = []

    @workflow.run
    async def run(self, node_ids: list[str]) -> None:
        workflow.upsert_search_attributes([attributes.NODE_IDS.value_set(node_ids)])
        await workflow.wait_condition(lambda: False)

    @workflow.signal(name="reclaim")
    def reclaim(self, notice: ReclaimNotice) -> None:
        self.signals.append({"signal": "reclaim", **notice.model_dump(mode="json")})

    @workflow.signal(name="node_lost")
    def node_lost(self, lost: NodeLost) -> None:
        self.signals.append({"signal": "node_lost", **lost.model_dump(mode="json")})

    @workflow.query
    def received(self) -> list[dict[str, Any]]:
        return self.signals


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


@dataclass
class Jobs:
    client: Client
    task_queue: str

    async def start(self, *node_ids: str) -> WorkflowHandle[Any, Any]:
        """A running RecordingJob, once the visibility query the webhook uses finds it."""
        handle = await self.client.start_workflow(
            "RecordingJob", list(node_ids), id=f"rec-{uuid.uuid4()}", task_queue=self.task_queue
        )
        query = f"SpotrainNodeIds = '{node_ids[0]}' AND ExecutionStatus = 'Running'"

        async def visible() -> bool:
            return any([w.id == handle.id async for w in self.client.list_workflows(query)])

        await eventually(visible)
        return handle


async def received(handle: WorkflowHandle[Any, Any]) -> list[dict[str, Any]]:
    return await handle.query("received")


@contextlib.asynccontextmanager
async def double_worker(client: Client, double: type) -> AsyncIterator[str]:
    """A worker of the workflow test double `double` on a task queue of its own (yielded)."""
    task_queue = f"{double.__name__}-{uuid.uuid4()}"
    async with Worker(
        client,
        task_queue=task_queue,
        workflows=[double],
        workflow_runner=UnsandboxedWorkflowRunner(),  # a test double, no sandbox needed
    ):
        yield task_queue


@contextlib.asynccontextmanager
async def recording_worker(client: Client) -> AsyncIterator[Jobs]:
    async with double_worker(client, RecordingJob) as task_queue:
        yield Jobs(client, task_queue)


def _cert(
    subject: str, key: rsa.RSAPrivateKey, issuer: tuple[x509.Certificate, rsa.RSAPrivateKey] | None
) -> x509.Certificate:
    """A test CA (issuer None) or a server certificate for `subject`, as a public CA makes
    them (cryptography's verifier checks the same extensions a browser does)."""
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.now(UTC)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer[0].subject if issuer else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(ski, critical=False)
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if issuer is None:
        usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
        builder = builder.add_extension(usage, critical=True)  # keyCertSign, cRLSign
        return builder.sign(key, hashes.SHA256())
    issuer_ski = issuer[0].extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), False)
        .add_extension(x509.ExtendedKeyUsage([x509.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(issuer_ski), False
        )
    )
    return builder.sign(issuer[1], hashes.SHA256())


def _new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@dataclass
class FakeSnsHost:
    """Serves a test certificate for sns.amazonaws.com, issued by a test CA that the webhook
    trusts in place of the public roots (no internet here); records every URL asked."""

    ca_file: str
    key: rsa.RSAPrivateKey = field(default_factory=_new_key)
    urls: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        ca_key = _new_key()
        ca = _cert("spotrain test CA", ca_key, None)
        self.cert = _cert("sns.amazonaws.com", self.key, (ca, ca_key))
        Path(self.ca_file).write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    async def get(self, url: str) -> bytes:
        self.urls.append(url)
        return self.cert_pem() if url.endswith(".pem") else b"<ConfirmSubscriptionResponse/>"

    def sign(self, message: dict[str, Any], key: rsa.RSAPrivateKey | None = None) -> bytes:
        message = {
            "MessageId": str(uuid.uuid4()),
            "TopicArn": TOPIC,
            "Timestamp": datetime.now(UTC).isoformat(),
            "SignatureVersion": "2",
            "SigningCertURL": CERT_URL,
            **message,
        }
        signature = (key or self.key).sign(
            sns_string_to_sign(message), padding.PKCS1v15(), hashes.SHA256()
        )
        message["Signature"] = base64.b64encode(signature).decode()
        return json.dumps(message).encode()


@dataclass
class Webhook:
    service: WebhookService
    url: str
    http: aiohttp.ClientSession
    sns: FakeSnsHost

    async def post(
        self, path: str, body: bytes | dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, Any]]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with self.http.post(
            self.url + path, data=data, headers=BEARER if headers is None else headers
        ) as resp:
            text = await resp.text()
            return resp.status, json.loads(text) if text.startswith("{") else {}


@contextlib.asynccontextmanager
async def running_webhook(
    client: Client,
    node_names: NodeNames | None = None,
    *,
    topics: tuple[str, ...] = (),
    http_get: Callable[[str], Awaitable[bytes]] | None = None,
    clock: Callable[[], float] = time.time,
    public_roots: bool = False,
    hmac_legacy: bool = False,
    **config: Any,
) -> AsyncIterator[Webhook]:
    """The service on a free port; SNS certificates are trusted from the test CA, or with
    `public_roots` from the public roots (certifi), as in production."""
    with tempfile.TemporaryDirectory(prefix="spotrain-ca-") as ca_dir:
        ca_file = os.path.join(ca_dir, "ca.pem")
        sns = FakeSnsHost(ca_file)
        auth = AuthConfig(
            bearer_token=TOKEN,
            hmac_secret=HMAC_SECRET,
            sns_topic_arns=frozenset([TOPIC, *topics]),
            hmac_legacy=hmac_legacy,
            **({} if public_roots else {"sns_ca_file": ca_file}),
        )
        service = WebhookService(
            client,
            WebhookConfig(
                auth=auth, host="127.0.0.1", port=0, **{"rpc_timeout_s": RPC_TIMEOUT_S, **config}
            ),
            http_get=http_get or sns.get,
            node_names=node_names,
            clock=clock,
        )
        port = await service.start()
        # A service that closes idle connections within a short header timeout can close one
        # just as the client reuses it (a reset, seen beside two busy loops at 1 s): then the
        # test client opens a connection per request, as a notice sender does.
        short = service.config.header_timeout_s < 5
        try:
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=short)
            ) as http:
                yield Webhook(service, f"http://127.0.0.1:{port}", http, sns)
        finally:
            await service.stop()


def aws_event(kind: str, instance_id: str, **detail: str) -> dict[str, Any]:
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": kind,
        "source": "aws.ec2",
        "account": "123456789012",
        "time": "2026-01-02T03:04:05Z",
        "region": "us-east-1",
        "resources": [f"arn:aws:ec2:us-east-1:123456789012:instance/{instance_id}"],
        "detail": {"instance-id": instance_id, **detail},
    }


INTERRUPTION = "EC2 Spot Instance Interruption Warning"
REBALANCE = "EC2 Instance Rebalance Recommendation"
STATE_CHANGE = "EC2 Instance State-change Notification"


EVENTBRIDGE = Path(__file__).parents[2] / "infra" / "aws" / "eventbridge"


def put_ec2_event(moto_endpoint: str, kind: str, detail: dict[str, str]) -> None:
    events = boto3.client("events", endpoint_url=moto_endpoint, region_name="us-east-1")
    entry = {"Source": "aws.ec2", "DetailType": kind, "Detail": json.dumps(detail)}
    assert events.put_events(Entries=[entry])["FailedEntryCount"] == 0


def queued(sqs: Any, url: str) -> int:
    attrs = sqs.get_queue_attributes(
        QueueUrl=url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    return sum(int(v) for v in attrs.values())


@contextlib.asynccontextmanager
async def webhook_process(
    dev_env: WorkflowEnvironment, settings: dict[str, str]
) -> AsyncIterator[tuple[str, list[str]]]:
    """`python -m spotrain.workers.webhook.server` as a real process on a free port, ready (Temporal
    answers); yields its URL and, once it has stopped, its output (in the list)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = os.environ | {
        "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host,
        "SPOTRAIN_WEBHOOK_HOST": "127.0.0.1",
        "SPOTRAIN_WEBHOOK_PORT": str(port),
        "SPOTRAIN_WEBHOOK_RPC_TIMEOUT_S": str(RPC_TIMEOUT_S),
        **settings,
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "spotrain.workers.webhook.server", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    output: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(url + "/readyz") as resp:
                        return resp.status == 200
                return False

            await eventually(ready, timeout=30)
        yield url, output
    finally:
        proc.terminate()
        output.append((await proc.communicate())[0].decode())


class TcpProxy:
    """A loopback TCP proxy to the dev server that the test can cut and restore: a real
    outage as the webhook's gRPC client sees it, without restarting Temporal."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.flowing = asyncio.Event()  # cleared: Temporal's answers are held back
        self.flowing.set()

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        assert self._server
        self._server.close()
        for writer in self._writers:
            writer.close()
        await self._server.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError, OSError):
                while data := await src.read(65536):
                    await self.flowing.wait()
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))
