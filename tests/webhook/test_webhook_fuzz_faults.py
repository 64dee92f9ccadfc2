"""Encodings and failing dependencies, fuzzed against the running webhook: whatever the body's
Content-Encoding or Content-Type and whether or not the sender authenticated, a request the
sender got wrong is a 4xx; and with Temporal cut off and the Kubernetes API down or refusing,
every notice is a 503 with Retry-After (the sender retries, the notice is not lost), never
another 5xx. Real HTTP on loopback and the real Temporal dev server behind a TCP proxy that
the test cuts, as in test_webhook.py."""

from __future__ import annotations

import gzip
import json
import threading
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import pytest_asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kubernetes import client as kube_client
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.webhook.server import NodeNames
from tests.webhook.fuzz_bodies import UNKNOWN, bodies
from tests.webhook.webhook_support import (
    BEARER,
    INTERRUPTION,
    TcpProxy,
    Webhook,
    aws_event,
    running_webhook,
)

pytestmark = pytest.mark.slow

FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ENCODINGS = ["gzip", "x-gzip", "deflate", "br", "zstd", "compress", "identity", "gzip, deflate"]
CONTENT_TYPES = [
    "application/json",
    "application/json; charset=utf-16",
    "text/plain; charset=latin-1",
    "application/octet-stream",
    "multipart/form-data; boundary=x",
    "",
]
NOBODYS = "i-0f00dbad5eed"  # an instance id that no job owns
NOTICES = [  # one of each kind a sender posts, for a node nobody owns
    ("/v1/reclaims", {"instance_id": NOBODYS, "event_id": "f-1"}),
    ("/v1/events/aws", aws_event(INTERRUPTION, NOBODYS)),
    ("/v1/events/kubernetes", {"event_id": "f-2", "kind": "SPOT_ITN", "instance_id": NOBODYS}),
    (
        "/v1/events/kubernetes",
        {"event_id": "f-3", "kind": "SPOT_ITN", "node_name": "ip-10-0-9-9.ec2.internal"},
    ),
]
SENDERS_FAULT = {400, 401, 408, 413, 415, 422}


def encoded(encoding: str, body: bytes, how: str = "whole") -> bytes:
    """`body` in `encoding` where this side can write it ("whole"), cut short ("cut"), or left
    as it is whatever the header says ("plain")."""
    if how == "plain":
        return body
    if encoding in ("gzip", "x-gzip"):
        body = gzip.compress(body)
    elif encoding == "deflate":
        body = zlib.compress(body)
    return body[: len(body) // 2] if how == "cut" else body


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes, dict[str, str]]:
    """A path, a body in some encoding (well formed or not) and headers, signed or not."""
    path, notice = draw(st.sampled_from(NOTICES))
    plain = draw(st.one_of(st.just(json.dumps(notice).encode()), bodies(UNKNOWN)))
    encoding = draw(st.sampled_from(ENCODINGS))
    body = encoded(encoding, plain, draw(st.sampled_from(["whole", "cut", "plain"])))
    headers = {"Content-Encoding": encoding, "Content-Type": draw(st.sampled_from(CONTENT_TYPES))}
    if draw(st.booleans()):
        headers |= BEARER
    return path, body, headers


async def post(hook: Webhook, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    """The status and the Retry-After header ("" if none)."""
    async with hook.http.post(hook.url + path, data=body, headers=headers) as resp:
        await resp.read()
        return resp.status, resp.headers.get("Retry-After", "")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def healthy(dev_env: WorkflowEnvironment) -> AsyncIterator[Webhook]:
    """The webhook with Temporal answering and a Kubernetes API that knows no node."""
    with refusing_kube_api(404) as kube:
        async with running_webhook(dev_env.client, NodeNames(kube)) as hook:
            yield hook


@FUZZ
@given(request=requests())
async def test_any_encoding_is_answered_as_the_senders_fault_or_accepted(
    healthy: Webhook, request: tuple[str, bytes, dict[str, str]]
) -> None:
    path, body, headers = request
    status, _ = await post(healthy, path, body, headers)
    assert status in {202} | SENDERS_FAULT, (path, headers, body[:80])
    if "Authorization" not in headers:
        assert status != 202


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_well_encoded_notice_is_read(healthy: Webhook, encoding: str) -> None:
    """The control for the fuzz above: a compressed notice is decoded, not refused."""
    for path, notice in NOTICES[:3]:
        body = encoded(encoding, json.dumps(notice).encode())
        headers = BEARER | {"Content-Encoding": encoding, "Content-Type": "application/json"}
        assert await post(healthy, path, body, headers) == (202, ""), path


@pytest.mark.parametrize(
    ("encoding", "body", "status"),
    [
        ("gzip", b"\x1f\x8b" * 64, 400),  # not gzip
        ("gzip", encoded("gzip", b"{}" + b" " * (128 * 1024)), 413),  # over, once inflated
        ("identity", b" " * (128 * 1024), 413),
    ],
    ids=["undecodable", "inflates-over-the-limit", "over-the-limit"],
)
async def test_a_body_left_unread_closes_its_connection(
    healthy: Webhook, encoding: str, body: bytes, status: int
) -> None:
    """Its rest is unread (and may not decode): the refusal says `Connection: close`, so the
    sender's next notice goes on a new connection (a kept-alive one was closed under it:
    ServerDisconnectedError, seen in the fuzz above)."""
    path, notice = NOTICES[0]
    headers = BEARER | {"Content-Encoding": encoding, "Content-Type": "application/json"}
    for _ in range(5):
        async with healthy.http.post(healthy.url + path, data=body, headers=headers) as r:
            assert (r.status, r.headers.get("Connection")) == (status, "close")
        assert (await post(healthy, path, json.dumps(notice).encode(), BEARER))[0] == 202


# --- dependencies down -----------------------------------------------------------------------


class _Refusing(BaseHTTPRequestHandler):
    status = 403

    def do_GET(self) -> None:
        body = json.dumps({"kind": "Status", "code": self.status, "message": "refused"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def refusing_kube_api(status: int) -> Iterator[kube_client.ApiClient]:
    """A Kubernetes API on loopback that answers every request with `status`."""
    handler = type("Handler", (_Refusing,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host = f"http://127.0.0.1:{server.server_address[1]}"
        yield kube_client.ApiClient(kube_client.Configuration(host=host))
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


FAULTS = ["temporal cut off", "kubernetes 403", "kubernetes 500", "kubernetes gone"]


@pytest_asyncio.fixture(scope="module", loop_scope="session", params=FAULTS)
async def faulty(
    dev_env: WorkflowEnvironment, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[str, Webhook]]:
    """The webhook with one dependency failing: Temporal cut off (a TCP proxy the test
    closes), or the Kubernetes API refusing or gone (a closed port)."""
    fault: str = request.param
    temporal, proxy = dev_env.client, None
    if fault == "temporal cut off":
        proxy = TcpProxy(int(temporal.service_client.config.target_host.rsplit(":", 1)[1]))
        await proxy.up()
        temporal = await Client.connect(
            f"127.0.0.1:{proxy.port}", data_converter=pydantic_data_converter
        )
        await proxy.down()
    status = int(fault.rsplit(" ", 1)[1]) if fault[-1].isdigit() else 404
    with refusing_kube_api(status) as refusing:
        kube = refusing
        if fault == "kubernetes gone":
            kube = kube_client.ApiClient(kube_client.Configuration(host="http://127.0.0.1:9"))
        timeout = {"rpc_timeout_s": 0.3} if proxy else {}
        async with running_webhook(temporal, NodeNames(kube), **timeout) as hook:
            yield fault, hook


async def test_every_notice_the_failing_dependency_answers_is_a_503(
    faulty: tuple[str, Webhook],
) -> None:
    """Every notice needs Temporal (whose job is the node?); a node name needs Kubernetes
    too (which instance is it?), asked only once Temporal knew no job by the name."""
    fault, hook = faulty
    for path, notice in NOTICES:
        needs = "temporal" in fault or "node_name" in notice
        expected = (503, "1") if needs else (202, "")
        assert await post(hook, path, json.dumps(notice).encode(), BEARER) == expected, path


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(request=requests())
async def test_no_5xx_but_503_with_a_dependency_failing(
    faulty: tuple[str, Webhook], request: tuple[str, bytes, dict[str, str]]
) -> None:
    _, hook = faulty
    path, body, headers = request
    status, retry_after = await post(hook, path, body, headers)
    assert status in {202, 503} | SENDERS_FAULT, (path, headers, body[:80])
    assert (status == 503) == (retry_after == "1"), (status, retry_after)
