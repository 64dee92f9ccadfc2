"""The reclaim webhook: cloud interruption notices in, `reclaim` / `node_lost` signals out.

Each notice is authenticated (auth.py), normalised (events.py), mapped from instance
id to the running job workflow(s) through an index of the `SpotrainNodeIds` search attribute
that each owner's own state confirms before it is signalled (dispatch.py), and signalled
with its event id. The HTTP answer comes only after Temporal accepted the signal: 503 while
Temporal is unreachable so the sender retries, and the SQS poller deletes a message only once
its event was handled. Duplicates have one effect: the signal's request id derives from the
event id (Temporal drops a repeat within a run) and the workflow dedupes by event id as well.

Endpoints (see openapi.yaml): POST /v1/reclaims, /v1/events/aws,
/v1/events/kubernetes; GET /healthz, /readyz, /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aiohttp
import boto3
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client
from temporalio.service import RPCError

from spotrain.workers.connect import Unreachable, connect, give_up
from spotrain.workers.webhook.auth import (
    AuthConfig,
    SnsRejected,
    SnsUnavailable,
    SnsVerifier,
    check_headers,
    is_sns_url,
    sns_host,
)
from spotrain.workers.webhook.dispatch import (
    Dispatcher,
    NodeNames,
    Unavailable,
    log_event,
)
from spotrain.workers.webhook.events import (
    Ignored,
    MalformedJSON,
    Outcome,
    SchemaError,
    decode_json,
    is_sns_envelope,
    parse_aws,
    parse_kubernetes,
    parse_reclaim,
)
from spotrain.workers.webhook.metrics import Metrics

log = logging.getLogger("spotrain.webhook")

# The HTTP server's own log (aiohttp's): its messages quote the bytes it could not parse, a
# header line with a bearer token among them, so each record is reduced to the error's type.
http_log = logging.getLogger("spotrain.webhook.http")
CLIENT_CLOSED = 499  # nginx's code for "the client closed the connection before the answer"


class ConfigError(ValueError):
    """A setting the service refuses to start with; the message says what to change."""


SHARED_QUEUE = (
    "queue mode deletes every message it reads, so it needs a queue of its own (a second "
    "EventBridge target, as infra/aws/eventbridge creates); pointed at a queue that "
    "aws-node-termination-handler or Karpenter also reads, it would take their messages. "
    "Set SPOTRAIN_WEBHOOK_QUEUE_DEDICATED=1 to confirm the queue is spotrain's alone."
)


@dataclass(frozen=True)
class WebhookConfig:
    auth: AuthConfig = field(default_factory=AuthConfig)
    host: str = "0.0.0.0"
    port: int = 8080
    max_body_bytes: int = 64 * 1024
    rpc_timeout_s: float = 5.0
    header_timeout_s: float = 10.0  # request head complete within this of connect/last answer
    body_timeout_s: float = 10.0  # body complete within this of its head, else 408
    owner_cache_ttl_s: float = 10.0  # 0: a visibility query per notice (dispatch.py)
    busy_retry_s: float = 4.0  # retrying a passing refusal; under EventBridge's 5 s timeout
    queue_url: str | None = None  # SQS queue mode when set
    queue_dedicated: bool = False  # the operator says no one else reads that queue
    sqs_endpoint_url: str | None = None
    region: str = "us-east-1"
    poll_wait_s: int = 10
    visibility_timeout_s: int = 30
    kube_nodes: bool = False  # resolve Kubernetes node names through the API (providerID)

    def __post_init__(self) -> None:
        if self.queue_url and not self.queue_dedicated:
            raise ConfigError(SHARED_QUEUE)
        for name in ("header_timeout_s", "body_timeout_s", "rpc_timeout_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise ConfigError(f"{name} must be more than 0 and at most 3600 seconds")
        if not 0 <= self.owner_cache_ttl_s <= 3600 or not 0 <= self.busy_retry_s <= 60:
            raise ConfigError("owner_cache_ttl_s must be 0-3600 s and busy_retry_s 0-60 s")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WebhookConfig:
        return cls(
            auth=AuthConfig.from_env(env),
            host=env.get("SPOTRAIN_WEBHOOK_HOST", "0.0.0.0"),
            port=int(env.get("SPOTRAIN_WEBHOOK_PORT", "8080")),
            max_body_bytes=int(env.get("SPOTRAIN_WEBHOOK_MAX_BODY_BYTES", str(64 * 1024))),
            header_timeout_s=_seconds(env, "SPOTRAIN_WEBHOOK_HEADER_TIMEOUT_S", 10.0),
            body_timeout_s=_seconds(env, "SPOTRAIN_WEBHOOK_BODY_TIMEOUT_S", 10.0),
            rpc_timeout_s=_seconds(env, "SPOTRAIN_WEBHOOK_RPC_TIMEOUT_S", 5.0),
            owner_cache_ttl_s=_seconds(env, "SPOTRAIN_WEBHOOK_OWNER_CACHE_TTL_S", 10.0),
            busy_retry_s=_seconds(env, "SPOTRAIN_WEBHOOK_BUSY_RETRY_S", 4.0),
            queue_url=env.get("SPOTRAIN_WEBHOOK_QUEUE_URL") or None,
            queue_dedicated=_flag(env, "SPOTRAIN_WEBHOOK_QUEUE_DEDICATED"),
            sqs_endpoint_url=env.get("SPOTRAIN_WEBHOOK_SQS_ENDPOINT_URL") or None,
            region=env.get("AWS_REGION", env.get("AWS_DEFAULT_REGION", "us-east-1")),
            kube_nodes=_flag(env, "SPOTRAIN_WEBHOOK_KUBE_NODES"),
        )


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "") not in ("", "0", "false")


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(env.get(name) or default)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds") from None


class _OnlyErrorTypes(logging.Filter):
    """Rewrites each record of the HTTP server's log to the error's type (and status), so no
    bytes a client sent, header values included, reach a log or a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        fields: dict[str, Any] = {"event": "http_error" if exc else "http_debug"}
        if exc is not None:
            fields["error"] = type(exc).__name__
            code = getattr(exc, "code", None)
            if isinstance(code, int):
                fields["status"] = code
        record.msg, record.args = json.dumps(fields), ()
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


http_log.addFilter(_OnlyErrorTypes())


class ClientGone(Exception):
    """The client closed the connection before its body arrived: its own doing, not ours."""


# --- queue mode ------------------------------------------------------------------------------


class SqsPoller:
    """Like aws-node-termination-handler's queue mode: EventBridge puts events on an SQS
    queue, and a message is deleted only after its event was handled, so a Temporal outage
    leaves it to come back after its visibility timeout."""

    def __init__(
        self, sqs: Any, queue_url: str, dispatcher: Dispatcher, wait_s: int, visibility_s: int
    ) -> None:
        self._sqs = sqs
        self._queue_url = queue_url
        self._dispatcher = dispatcher
        self._wait_s = wait_s
        self._visibility_s = visibility_s

    async def run(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # SQS unreachable: keep polling, never die
                log_event(logging.WARNING, "sqs_error", error=type(e).__name__)
                await asyncio.sleep(1)

    async def poll_once(self) -> int:
        """Receive one batch and handle its messages in order, each on its own: a message that
        fails in any way never blocks or loses another. Returns how many were deleted."""
        resp = await asyncio.to_thread(
            self._sqs.receive_message,
            QueueUrl=self._queue_url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=self._wait_s,
            VisibilityTimeout=self._visibility_s,
        )
        return sum([await self._settle(m) for m in resp.get("Messages", [])])

    async def _settle(self, message: Mapping[str, Any]) -> bool:
        """Handle one message and delete it once done with; True if deleted. A message whose
        handling failed unexpectedly stays, to come back (and reach the dead-letter queue)."""
        message_id = str(message.get("MessageId"))
        try:
            if not await self._handle(str(message.get("Body")), message_id):
                return False
            await asyncio.to_thread(
                self._sqs.delete_message,
                QueueUrl=self._queue_url,
                ReceiptHandle=message["ReceiptHandle"],
            )
        except Exception as e:
            error = repr(e)[:200]
            log_event(logging.ERROR, "sqs_message_failed", message_id=message_id, error=error)
            return False
        return True

    async def _handle(self, body: str, message_id: str) -> bool:
        """True when the message is done with: delivered, ignored, or unparseable (it never
        will parse; it is logged and dropped: the queue is spotrain's own)."""
        started = time.perf_counter()
        try:
            outcomes = parse_aws(decode_json(body))
        except (MalformedJSON, SchemaError) as e:
            log_event(logging.WARNING, "sqs_dropped", message_id=message_id, error=str(e)[:200])
            return True
        try:
            for outcome in outcomes:
                await self._dispatcher.deliver(outcome, "sqs", started)
        except Unavailable:
            return False
        return True


# --- HTTP ------------------------------------------------------------------------------------

Parser = Callable[[Any], list[Outcome]]


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def _unread(status: int, message: str) -> web.Response:
    """A refusal with the body's rest unread: the connection can carry no next request (kept
    alive, aiohttp closed it under the sender's next one after failing to drain it: a lost
    notice to a sender that does not retry a disconnect), so it says Connection: close."""
    response = _error(status, message)
    response.force_close()
    return response


def _unavailable(message: str, reason: str) -> web.Response:
    """503: the sender retries (after Retry-After); the log says why."""
    log_event(logging.WARNING, "unavailable", error=message, reason=reason[:300])
    return web.json_response({"error": message}, status=503, headers={"Retry-After": "1"})


class WebhookService:
    """The HTTP app plus, when a queue URL is configured, the SQS poller.

    `http_get` fetches SNS certificates and subscription-confirmation URLs (only URLs on the
    SNS host pattern reach it); it defaults to aiohttp.
    """

    def __init__(
        self,
        client: Client,
        config: WebhookConfig,
        http_get: Callable[[str], Awaitable[bytes]] | None = None,
        node_names: NodeNames | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.config = config
        self.metrics = Metrics()
        if node_names is None and config.kube_nodes:
            node_names = NodeNames()
        self.dispatcher = Dispatcher(
            client,
            self.metrics,
            config.rpc_timeout_s,
            node_names,
            owner_cache_ttl_s=config.owner_cache_ttl_s,
            busy_retry_s=config.busy_retry_s,
        )
        self._http_get = http_get or self._aiohttp_get
        self._sns = SnsVerifier(
            config.auth.sns_topic_arns,
            self._http_get,
            max_age_s=config.auth.sns_max_age_s,
            ca_file=config.auth.sns_ca_file,
            clock=clock,
        )
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._poller: asyncio.Task[None] | None = None
        self.app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self._count])
        self.app.add_routes(
            [
                web.post("/v1/reclaims", self._route(parse_reclaim, "spotrain")),
                web.post("/v1/events/aws", self._route(parse_aws, "aws", allow_sns=True)),
                web.post("/v1/events/kubernetes", self._route(parse_kubernetes, "kubernetes")),
                web.get("/healthz", self._healthz),
                web.get("/readyz", self._readyz),
                web.get("/metrics", self._metrics),
            ]
        )

    async def start(self) -> int:
        """Listen (port 0 picks a free one) and start the poller; returns the port."""
        # keepalive_timeout runs from the connection's start and from each answer, and closes
        # the connection when no complete request head has arrived by then (aiohttp's own
        # idle check): the header read timeout. Lingering (reading what a client still sends
        # after an early answer) is kept to the body timeout.
        self._runner = web.AppRunner(
            self.app,
            access_log=None,
            logger=http_log,
            keepalive_timeout=self.config.header_timeout_s,
            lingering_time=min(self.config.body_timeout_s, 10.0),
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port: int = self._runner.addresses[0][1]
        if self.config.queue_url:
            sqs = boto3.client(
                "sqs", region_name=self.config.region, endpoint_url=self.config.sqs_endpoint_url
            )
            poller = SqsPoller(
                sqs,
                self.config.queue_url,
                self.dispatcher,
                self.config.poll_wait_s,
                self.config.visibility_timeout_s,
            )
            self._poller = asyncio.create_task(poller.run())
        if self.config.auth.hmac_legacy:
            detail = "body-only HMAC signatures are accepted; the setting goes in the next release"
            log_event(
                logging.WARNING, "deprecated", setting="SPOTRAIN_WEBHOOK_HMAC_LEGACY", detail=detail
            )
        if not (self.config.auth.bearer_token or self.config.auth.hmac_secret):
            detail = "only SNS/SQS input will be accepted"
            log_event(logging.WARNING, "no_http_auth", detail=detail)
        log_event(logging.INFO, "listening", host=self.config.host, port=port)
        return port

    async def stop(self) -> None:
        if self._poller:
            self._poller.cancel()
        if self._runner:
            await self._runner.cleanup()
        if self._session:
            await self._session.close()

    @web.middleware
    async def _count(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Requests by route and status; anything unexpected is a logged 500, never a crash. A
        client that hangs up is counted as 499 and logged without a traceback: not our fault."""
        try:
            response = await handler(request)
        except web.HTTPException as e:  # 404, 405, 413 ...
            self._count_request(request, e.status)
            raise
        except ClientGone as e:
            log_event(logging.INFO, "client_closed", path=request.path, error=str(e))
            self._count_request(request, CLIENT_CLOSED)
            raise ConnectionResetError from None  # aiohttp drops the connection quietly
        except Exception:
            log.exception(json.dumps({"event": "internal_error", "path": request.path}))
            response = _error(500, "internal error")
        self._count_request(request, response.status)
        return response

    def _count_request(self, request: web.Request, status: int) -> None:
        route = request.match_info.route.resource
        path = route.canonical if route else "unmatched"
        self.metrics.inc("spotrain_webhook_requests_total", path=path, code=str(status))

    def _route(
        self, parse: Parser, source: str, allow_sns: bool = False
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return await self._event(request, parse, source, allow_sns)

        return handler

    async def _event(
        self, request: web.Request, parse: Parser, source: str, allow_sns: bool
    ) -> web.Response:
        started = time.perf_counter()
        try:
            body = await self._read(request)
        except TimeoutError:
            log_event(logging.INFO, "body_timeout", path=request.path)
            response = _error(408, "request body not received in time")
            response.force_close()
            return response
        except RequestPayloadError:  # (a Content-Encoding the body is not in): the sender's fault
            log_event(logging.INFO, "body_undecodable", path=request.path)
            return _unread(400, "request body could not be decoded (check Content-Encoding)")
        except web.HTTPRequestEntityTooLarge:
            return _unread(413, f"request body over {self.config.max_body_bytes} bytes")
        auth = self.config.auth
        trusted = check_headers(auth, request.method, request.raw_path, request.headers, body)
        if trusted == "hmac-legacy":
            self.metrics.inc("spotrain_webhook_legacy_signatures_total")
        if not (trusted or allow_sns):
            return _error(401, "unauthenticated")
        try:
            obj = decode_json(body)
        except MalformedJSON:
            return _error(400, "malformed JSON") if trusted else _error(401, "unauthenticated")
        if not trusted:  # only the SNS envelope is read before its signature is checked
            if not is_sns_envelope(obj):
                return _error(401, "unauthenticated")
            try:
                await self._sns.verify(obj)
            except SnsRejected as e:
                log_event(logging.WARNING, "sns_rejected", reason=str(e))
                return _error(401, "unauthenticated")
            except SnsUnavailable as e:
                return _unavailable("SNS certificate unavailable", str(e))
            source = "sns"
            if obj["Type"] == "SubscriptionConfirmation":
                return await self._confirm(obj)
        try:
            outcomes = parse(obj)
        except SchemaError as e:
            return _error(422, e.message, field=e.field)
        workflow_ids: set[str] = set()
        try:
            for outcome in outcomes:
                workflow_ids.update(await self.dispatcher.deliver(outcome, source, started))
        except Unavailable as e:
            return _unavailable(e.what, str(e))
        if all(isinstance(o, Ignored) for o in outcomes):
            reason = "; ".join(o.reason for o in outcomes if isinstance(o, Ignored))
            return web.json_response({"status": "ignored", "reason": reason}, status=202)
        if not workflow_ids:
            return web.json_response({"status": "unknown_instance"}, status=202)
        return web.json_response({"status": "signalled", "workflow_ids": sorted(workflow_ids)})

    async def _read(self, request: web.Request) -> bytes:
        """The body within the body timeout (TimeoutError); over client_max_size: 413."""
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                return await request.read()
        except ConnectionError as e:
            raise ClientGone(type(e).__name__) from None

    async def _confirm(self, message: Mapping[str, Any]) -> web.Response:
        url = message.get("SubscribeURL")
        if not is_sns_url(url, sns_host(message.get("TopicArn"))):
            return _error(422, "SubscribeURL is not on the topic's SNS host", field="SubscribeURL")
        try:
            await self._http_get(url)
        except (aiohttp.ClientError, TimeoutError) as e:
            return _unavailable("SNS unreachable", f"{type(e).__name__} {e}")
        log_event(logging.INFO, "sns_subscribed", topic=message.get("TopicArn"))
        return web.json_response({"status": "subscribed"})

    async def _aiohttp_get(self, url: str) -> bytes:
        if self._session is None:
            # trust_env: HTTPS_PROXY / HTTP_PROXY / NO_PROXY apply to certificate fetches.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=5), trust_env=True
            )
        async with self._session.get(url, allow_redirects=False) as resp:
            resp.raise_for_status()
            return await resp.content.read(64 * 1024)

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        """Ready when Temporal answers: a pod that cannot signal should not get traffic."""
        try:
            await self.client.workflow_service.get_system_info(
                GetSystemInfoRequest(), retry=False, timeout=timedelta(seconds=2)
            )
        except RPCError as e:
            return _error(503, "temporal unavailable", rpc_status=e.status.name)
        return web.json_response({"status": "ready"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain")


async def serve(client: Client, config: WebhookConfig) -> None:
    """Run until cancelled."""
    service = WebhookService(client, config)
    await service.start()
    try:
        await asyncio.Event().wait()
    finally:
        await service.stop()


def parser() -> argparse.ArgumentParser:
    """`spotrain webhook --help`: it takes no options, only its environment."""
    return argparse.ArgumentParser(
        prog="spotrain webhook",
        description="Serve the reclaim webhook: cloud interruption events to workflow signals.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  SPOTRAIN_WEBHOOK_TOKEN_FILE=/run/secrets/token spotrain webhook\n"
        "  SPOTRAIN_WEBHOOK_QUEUE_URL=https://sqs.../spotrain-reclaims spotrain webhook\n\n"
        "Configured by environment: SPOTRAIN_WEBHOOK_PORT (8080), SPOTRAIN_WEBHOOK_HOST, "
        "SPOTRAIN_WEBHOOK_TOKEN[_FILE], SPOTRAIN_WEBHOOK_HMAC_SECRET[_FILE], "
        "SPOTRAIN_WEBHOOK_SNS_TOPIC_ARNS, SPOTRAIN_WEBHOOK_QUEUE_URL (SQS mode), "
        "SPOTRAIN_WEBHOOK_KUBE_NODES=1 (resolve node names through the Kubernetes API), "
        "SPOTRAIN_WEBHOOK_HEADER_TIMEOUT_S and _BODY_TIMEOUT_S (10), "
        "SPOTRAIN_WEBHOOK_RPC_TIMEOUT_S (5: each Temporal call), "
        "SPOTRAIN_WEBHOOK_OWNER_CACHE_TTL_S (10), SPOTRAIN_WEBHOOK_BUSY_RETRY_S (4), "
        "SPOTRAIN_WEBHOOK_HMAC_LEGACY=1 (deprecated); Temporal: "
        "TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS_*, TEMPORAL_PROFILE "
        "(docs/security.md). See docs/webhook.md.",
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m spotrain.workers.webhook.server`; `spotrain webhook` calls the same."""
    parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    try:
        config = WebhookConfig.from_env()
    except ConfigError as e:
        raise SystemExit(f"spotrain webhook: {e}") from None

    async def run() -> None:
        await serve(await connect(), config)

    try:
        asyncio.run(run())
    except Unreachable as e:
        give_up(f"spotrain webhook: {e}")


if __name__ == "__main__":
    main()
