"""The reclaim webhook: cloud interruption notices in, `reclaim` / `node_lost` signals out.

Each notice is authenticated (webhook_auth), normalised (webhook_events), mapped from instance
id to the running job workflow(s) by a visibility query on the `SpotrainNodeIds` search
attribute, and signalled with its event id. The HTTP answer comes only after Temporal accepted
the signal: 503 while Temporal is unreachable so the sender retries, and the SQS poller
deletes a message only once its event was handled. Duplicates have one effect: the signal's
request id derives from the event id (Temporal drops a repeat within a run) and the workflow
dedupes by event id as well.

Endpoints (see webhook_openapi.yaml): POST /v1/reclaims, /v1/events/aws,
/v1/events/kubernetes; GET /healthz, /readyz, /metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aiohttp
import boto3
from aiohttp import web
from kubernetes import client as kube_client
from kubernetes import config as kube_config
from kubernetes.client.exceptions import ApiException
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import (
    GetSystemInfoRequest,
    ListWorkflowExecutionsRequest,
    SignalWorkflowExecutionRequest,
)
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from spotrain.activities import kube_api
from spotrain.workers.connect import Unreachable, connect, give_up
from spotrain.workers.webhook_auth import (
    AuthConfig,
    SnsRejected,
    SnsUnavailable,
    SnsVerifier,
    check_headers,
    is_sns_url,
    sns_host,
)
from spotrain.workers.webhook_events import (
    Ignored,
    MalformedJSON,
    Outcome,
    SchemaError,
    decode_json,
    is_sns_envelope,
    outcome_kind,
    parse_aws,
    parse_kubernetes,
    parse_reclaim,
)
from spotrain.workers.webhook_metrics import Metrics
from spotrain.workflows import attributes
from spotrain.workflows.contract import NodeLost, ReclaimNotice

log = logging.getLogger("spotrain.webhook")

# Pauses before retrying a call Temporal refused as RESOURCE_EXHAUSTED (a rate limit, a busy
# workflow): that passes in moments, so the sender is not made to retry (or, for a reclaim,
# to lose part of its two minutes). Any other error is answered at once.
BUSY_RETRY_PAUSES_S = (0.05, 0.2, 0.5)


def _log(level: int, event: str, **fields: Any) -> None:
    """One JSON object per line: ids and outcomes only, never bodies, headers or secrets."""
    log.log(level, json.dumps({"event": event, **fields}, default=str))


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

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> WebhookConfig:
        return cls(
            auth=AuthConfig.from_env(env),
            host=env.get("SPOTRAIN_WEBHOOK_HOST", "0.0.0.0"),
            port=int(env.get("SPOTRAIN_WEBHOOK_PORT", "8080")),
            max_body_bytes=int(env.get("SPOTRAIN_WEBHOOK_MAX_BODY_BYTES", str(64 * 1024))),
            queue_url=env.get("SPOTRAIN_WEBHOOK_QUEUE_URL") or None,
            queue_dedicated=_flag(env, "SPOTRAIN_WEBHOOK_QUEUE_DEDICATED"),
            sqs_endpoint_url=env.get("SPOTRAIN_WEBHOOK_SQS_ENDPOINT_URL") or None,
            region=env.get("AWS_REGION", env.get("AWS_DEFAULT_REGION", "us-east-1")),
            kube_nodes=_flag(env, "SPOTRAIN_WEBHOOK_KUBE_NODES"),
        )


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "") not in ("", "0", "false")


class TemporalUnavailable(Exception):
    """Temporal did not accept the lookup or the signal: the sender must retry."""


# --- instance id -> job workflow -> signal ---------------------------------------------------


class NodeNames:
    """Kubernetes node name -> EC2 instance id (the node's providerID or instance-id label),
    for notices that name a node the way the cluster does (EKS: `ip-10-0-1-2.ec2.internal`).
    Names are cached: a node keeps its instance for life."""

    def __init__(self, api_client: kube_client.ApiClient | None = None) -> None:
        if api_client is None:
            try:
                kube_config.load_incluster_config()
            except kube_config.ConfigException:
                kube_config.load_kube_config()
        self._core = kube_client.CoreV1Api(api_client)
        self._known: dict[str, str] = {}

    async def instance_id(self, name: str) -> str | None:
        if name not in self._known:
            try:
                node = await asyncio.to_thread(self._core.read_node, name)
            except ApiException as err:
                if err.status == 404:
                    return None
                raise
            found = kube_api.instance_id(node)
            if found is None:
                return None
            self._known[name] = found
        return self._known[name]


class Dispatcher:
    """Finds the running job workflow(s) that own a node and signals them."""

    def __init__(
        self,
        client: Client,
        metrics: Metrics,
        rpc_timeout_s: float = 5.0,
        node_names: NodeNames | None = None,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._timeout = timedelta(seconds=rpc_timeout_s)
        self._node_names = node_names

    async def deliver(self, outcome: Outcome, source: str, started: float) -> list[str]:
        """Signal every running workflow owning the node; returns their ids ([] if none).
        `started` is the perf_counter time the event arrived, for the latency histogram."""
        kind = outcome_kind(outcome)
        self._metrics.inc("spotrain_webhook_events_total", source=source, kind=kind)
        if isinstance(outcome, Ignored):
            _log(logging.INFO, "ignored", source=source, reason=outcome.reason)
            return []
        signal = "node_lost" if isinstance(outcome, NodeLost) else "reclaim"
        fields = {
            "source": source,
            "kind": kind,
            "node_id": outcome.node_id,
            "event_id": outcome.event_id,
        }
        try:
            workflow_ids = await self._owners(outcome.node_id)
            if not workflow_ids and self._node_names is not None:
                instance = await self._node_names.instance_id(outcome.node_id)
                if instance and instance != outcome.node_id:
                    outcome = outcome.model_copy(update={"node_id": instance})
                    fields["node_id"] = f"{instance} (node {fields['node_id']})"
                    workflow_ids = await self._owners(instance)
            if not workflow_ids:
                _log(logging.INFO, "unknown_instance", **fields)
            signalled = [w for w in workflow_ids if await self._signal(w, signal, outcome)]
        except RPCError as e:
            self._metrics.inc("spotrain_webhook_temporal_errors_total")
            _log(logging.WARNING, "temporal_unavailable", status=e.status.name, **fields)
            raise TemporalUnavailable(e.status.name) from None
        for workflow_id in signalled:
            self._metrics.inc("spotrain_webhook_signals_total", signal=signal)
            self._metrics.observe(time.perf_counter() - started)
            _log(logging.INFO, "signalled", signal=signal, workflow_id=workflow_id, **fields)
        return signalled

    async def _owners(self, node_id: str) -> list[str]:
        """Node ids are validated to a quote-free charset, so they embed safely."""
        query = f"{attributes.NODE_IDS.name} = '{node_id}' AND ExecutionStatus = 'Running'"
        req = ListWorkflowExecutionsRequest(
            namespace=self._client.namespace, query=query, page_size=100
        )
        resp = await self._rpc(self._client.workflow_service.list_workflow_executions, req)
        return sorted({e.execution.workflow_id for e in resp.executions})

    async def _signal(
        self, workflow_id: str, signal: str, payload: ReclaimNotice | NodeLost
    ) -> bool:
        """The raw call lets the request id derive from the event id, so Temporal itself drops
        a duplicate sent to the same run. False if the run ended meanwhile."""
        dedupe = f"spotrain:{signal}:{workflow_id}:{payload.event_id}"
        req = SignalWorkflowExecutionRequest(
            namespace=self._client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=workflow_id),
            signal_name=signal,
            identity=self._client.identity,
            request_id=str(uuid.uuid5(uuid.NAMESPACE_URL, dedupe)),
        )
        req.input.payloads.extend(await self._client.data_converter.encode([payload]))
        try:
            await self._rpc(self._client.workflow_service.signal_workflow_execution, req)
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        return True

    async def _rpc(self, call: Callable[..., Awaitable[Any]], req: Any) -> Any:
        """One Temporal call, retried only after RESOURCE_EXHAUSTED (see BUSY_RETRY_PAUSES_S).
        A repeated signal is harmless: its request id drops the duplicate."""
        for pause in BUSY_RETRY_PAUSES_S:
            try:
                return await call(req, retry=False, timeout=self._timeout)
            except RPCError as e:
                if e.status != RPCStatusCode.RESOURCE_EXHAUSTED:
                    raise
            await asyncio.sleep(pause)
        return await call(req, retry=False, timeout=self._timeout)


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
                _log(logging.WARNING, "sqs_error", error=type(e).__name__)
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
            _log(logging.ERROR, "sqs_message_failed", message_id=message_id, error=repr(e)[:200])
            return False
        return True

    async def _handle(self, body: str, message_id: str) -> bool:
        """True when the message is done with: delivered, ignored, or unparseable (it never
        will parse; it is logged and dropped: the queue is spotrain's own)."""
        started = time.perf_counter()
        try:
            outcomes = parse_aws(decode_json(body))
        except (MalformedJSON, SchemaError) as e:
            _log(logging.WARNING, "sqs_dropped", message_id=message_id, error=str(e)[:200])
            return True
        try:
            for outcome in outcomes:
                await self._dispatcher.deliver(outcome, "sqs", started)
        except TemporalUnavailable:
            return False
        return True


# --- HTTP ------------------------------------------------------------------------------------

Parser = Callable[[Any], list[Outcome]]


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


def _unavailable(message: str, reason: str) -> web.Response:
    """503: the sender retries (after Retry-After); the log says why."""
    _log(logging.WARNING, "unavailable", error=message, reason=reason[:300])
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
        self.dispatcher = Dispatcher(client, self.metrics, config.rpc_timeout_s, node_names)
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
        self._runner = web.AppRunner(self.app, access_log=None)
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
        if not (self.config.auth.bearer_token or self.config.auth.hmac_secret):
            _log(logging.WARNING, "no_http_auth", detail="only SNS/SQS input will be accepted")
        _log(logging.INFO, "listening", host=self.config.host, port=port)
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
        """Requests by route and status; anything unexpected is a logged 500, never a crash."""
        try:
            response = await handler(request)
        except web.HTTPException as e:  # 404, 405, 413 ...
            self._count_request(request, e.status)
            raise
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
        body = await request.read()  # over client_max_size: 413
        trusted = check_headers(self.config.auth, request.headers, body)
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
                _log(logging.WARNING, "sns_rejected", reason=str(e))
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
        except TemporalUnavailable as e:
            return _unavailable("temporal unavailable", str(e))
        if all(isinstance(o, Ignored) for o in outcomes):
            reason = "; ".join(o.reason for o in outcomes if isinstance(o, Ignored))
            return web.json_response({"status": "ignored", "reason": reason}, status=202)
        if not workflow_ids:
            return web.json_response({"status": "unknown_instance"}, status=202)
        return web.json_response({"status": "signalled", "workflow_ids": sorted(workflow_ids)})

    async def _confirm(self, message: Mapping[str, Any]) -> web.Response:
        url = message.get("SubscribeURL")
        if not is_sns_url(url, sns_host(message.get("TopicArn"))):
            return _error(422, "SubscribeURL is not on the topic's SNS host", field="SubscribeURL")
        try:
            await self._http_get(url)
        except (aiohttp.ClientError, TimeoutError) as e:
            return _unavailable("SNS unreachable", f"{type(e).__name__} {e}")
        _log(logging.INFO, "sns_subscribed", topic=message.get("TopicArn"))
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


def main(argv: list[str] | None = None) -> None:
    """`python -m spotrain.workers.webhook`; the `spotrain webhook` command calls the same."""
    argparse.ArgumentParser(
        prog="spotrain webhook",
        description="Serve the reclaim webhook: cloud interruption events to workflow signals.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  SPOTRAIN_WEBHOOK_TOKEN_FILE=/run/secrets/token spotrain webhook\n"
        "  SPOTRAIN_WEBHOOK_QUEUE_URL=https://sqs.../spotrain-reclaims spotrain webhook\n\n"
        "Configured by environment: SPOTRAIN_WEBHOOK_PORT (8080), SPOTRAIN_WEBHOOK_HOST, "
        "SPOTRAIN_WEBHOOK_TOKEN[_FILE], SPOTRAIN_WEBHOOK_HMAC_SECRET[_FILE], "
        "SPOTRAIN_WEBHOOK_SNS_TOPIC_ARNS, SPOTRAIN_WEBHOOK_QUEUE_URL (SQS mode), "
        "SPOTRAIN_WEBHOOK_KUBE_NODES=1 (resolve node names through the Kubernetes API); Temporal: "
        "TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS_*, TEMPORAL_PROFILE "
        "(docs/security.md). See docs/webhook.md.",
    ).parse_args(argv)
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
