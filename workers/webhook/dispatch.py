"""Instance id -> the running job workflow(s) that own it -> their `reclaim` / `node_lost` signal.

Owners are found in an index of every running job's `SpotrainNodeIds` built from one paged
visibility listing, not with a visibility query per notice: Temporal rate-limits visibility
calls per namespace (the dev server and small clusters allow about 10 a second), and a burst
of notices must not spend them one by one. The index is only ever a list of candidates:

- a node the index does not know waits for a listing that began after its notice arrived, so
  an "unknown instance" answer is as fresh as a query of its own would be;
- a candidate is signalled only after its own workflow state (DescribeWorkflowExecution reads
  the search attributes the job last upserted, not the eventually consistent visibility store)
  says it is running and still lists the node; one that does not (the job ended or released
  the node, whose id may now name another job's node) makes the webhook list again.

So an index entry can be at most out of date, never the reason a wrong job is signalled. A
node id names one node of one job at a time (EC2 never reuses an instance id); should two
running jobs ever list the same id, one that took it after the last listing is found at the
next one (within the TTL).

A call that Temporal refuses as RESOURCE_EXHAUSTED (a rate limit, a busy workflow), or that a
closing connection cut off unsent, is retried with jittered exponential backoff within a
bounded budget before the sender is told to retry.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from kubernetes import client as kube_client
from kubernetes.client.exceptions import ApiException
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import WorkflowExecutionStatus
from temporalio.api.workflowservice.v1 import (
    DescribeWorkflowExecutionRequest,
    ListWorkflowExecutionsRequest,
    SignalWorkflowExecutionRequest,
)
from temporalio.client import Client
from temporalio.converter import decode_typed_search_attributes
from temporalio.service import RPCError, RPCStatusCode
from urllib3.exceptions import HTTPError

from spotrain.activities import kube_api
from spotrain.workers.webhook.events import INSTANCE_ID, Ignored, Outcome, outcome_kind
from spotrain.workers.webhook.metrics import Metrics
from spotrain.workflows.contract import NodeLost, ReclaimNotice
from spotrain.workflows.job import attributes

log = logging.getLogger("spotrain.webhook")

RUNNING = f"{attributes.NODE_IDS.name} IS NOT NULL AND ExecutionStatus = 'Running'"
LISTING_PAGE = 1000
# Between two listings forced by unknown nodes: a stream of notices for nodes no job owns
# (aws-node-termination-handler reports every node of a cluster) must not spend the whole
# visibility rate limit that `spotrain list` and the Web UI share.
MIN_LISTING_GAP_S = 0.25
FIRST_RETRY_PAUSE_S = 0.05
MAX_RETRY_PAUSE_S = 1.0


def log_event(level: int, event: str, **fields: Any) -> None:
    """One JSON object per line: ids and outcomes only, never bodies, headers or secrets."""
    log.log(level, json.dumps({"event": event, **fields}, default=str))


class Unavailable(Exception):
    """Something the delivery needs did not answer: the sender must retry (503)."""

    what = "unavailable"


class TemporalUnavailable(Unavailable):
    """Temporal did not accept the lookup or the signal."""

    what = "temporal unavailable"


class KubernetesUnavailable(Unavailable):
    """The Kubernetes API did not answer a node-name lookup (unreachable, refusing)."""

    what = "kubernetes unavailable"


class NodeNames:
    """Kubernetes node name -> EC2 instance id (the node's providerID or instance-id label),
    for notices that name a node the way the cluster does (EKS: `ip-10-0-1-2.ec2.internal`).
    Names are cached: a node keeps its instance for life."""

    def __init__(self, api_client: kube_client.ApiClient | None = None) -> None:
        self._core = kube_client.CoreV1Api(api_client or kube_api.default_api_client())
        self._known: dict[str, str] = {}

    async def instance_id(self, name: str) -> str | None:
        """None for a node it does not know, or one with no instance id."""
        if name not in self._known:
            try:
                node = await asyncio.to_thread(self._core.read_node, name)
            except ApiException as err:
                if err.status == 404:
                    return None
                log_event(logging.WARNING, "kubernetes_unavailable", status=err.status, node=name)
                raise KubernetesUnavailable(f"{err.status} {err.reason}") from None
            except (OSError, HTTPError) as err:  # unreachable, refused, timed out
                log_event(logging.WARNING, "kubernetes_unavailable", error=type(err).__name__)
                raise KubernetesUnavailable(type(err).__name__) from None
            found = kube_api.instance_id(node)
            if found is None:
                return None
            self._known[name] = found
        return self._known[name]


Listing = Callable[[], Awaitable[dict[str, frozenset[str]]]]


class OwnerIndex:
    """node id -> workflow ids, from the latest listing of all running jobs. One listing runs
    at a time and is shared: every lookup that needs one newer than its notice joins the one
    in flight if it began late enough, else the next, so a burst of notices for nodes the
    index does not know costs one call, not one each."""

    def __init__(self, listing: Listing, ttl_s: float) -> None:
        self._listing = listing
        self._ttl_s = ttl_s
        self._owners: dict[str, frozenset[str]] = {}
        self._listed_at = -float("inf")  # monotonic time the listing behind `_owners` began
        self._last_start = -float("inf")
        self._next: asyncio.Task[None] | None = None

    async def candidates(self, node_id: str, since: float) -> tuple[frozenset[str], bool]:
        """Who owned the node at the last listing, and whether that listing began at or
        after `since` (the notice's arrival). A node the index does not know, or an index
        older than its TTL, waits for such a listing first: only what the index knows is
        taken from it, never that a node is nobody's."""
        if time.monotonic() - self._listed_at < self._ttl_s and node_id in self._owners:
            return self._owners[node_id], self._listed_at >= since
        await self.refresh(since)
        return self._owners.get(node_id, frozenset()), True

    async def refresh(self, since: float) -> None:
        """Returns once the index holds a listing that began at or after `since`; a failed
        listing fails every lookup waiting for it (the sender retries)."""
        while self._listed_at < since:
            if self._next is None or self._next.done():
                self._next = asyncio.create_task(self._list())
            await asyncio.shield(self._next)

    async def _list(self) -> None:
        await asyncio.sleep(max(0.0, self._last_start + MIN_LISTING_GAP_S - time.monotonic()))
        started = self._last_start = time.monotonic()
        self._owners = await self._listing()
        self._listed_at = started


class Dispatcher:
    """Finds the running job workflow(s) that own a node and signals them.

    `owner_cache_ttl_s` 0 turns the index off: each notice then costs a visibility query of
    its own (the behaviour before the index; kept as a switch for one release and for the
    benchmark). `busy_retry_s` bounds how long a passing refusal is retried (`_rpc`).
    """

    def __init__(
        self,
        client: Client,
        metrics: Metrics,
        rpc_timeout_s: float = 5.0,
        node_names: NodeNames | None = None,
        *,
        owner_cache_ttl_s: float = 10.0,
        busy_retry_s: float = 4.0,
    ) -> None:
        self._client = client
        self._metrics = metrics
        self._timeout = timedelta(seconds=rpc_timeout_s)
        self._node_names = node_names
        self._busy_retry_s = busy_retry_s
        self._index: OwnerIndex | None = None
        if owner_cache_ttl_s > 0:
            self._index = OwnerIndex(self._list_owners, owner_cache_ttl_s)

    async def deliver(self, outcome: Outcome, source: str, started: float) -> list[str]:
        """Signal every running workflow owning the node; returns their ids ([] if none).
        `started` is the perf_counter time the event arrived, for the latency histogram."""
        kind = outcome_kind(outcome)
        self._metrics.inc("spotrain_webhook_events_total", source=source, kind=kind)
        if isinstance(outcome, Ignored):
            log_event(logging.INFO, "ignored", source=source, reason=outcome.reason)
            return []
        arrived = time.monotonic()
        signal = "node_lost" if isinstance(outcome, NodeLost) else "reclaim"
        fields = {
            "source": source,
            "kind": kind,
            "node_id": outcome.node_id,
            "event_id": outcome.event_id,
        }
        try:
            workflow_ids = await self._owners(outcome.node_id, arrived)
            # an instance id is no node name to look up: a notice for an instance nobody owns
            # needs no Kubernetes API (nor waits for one that is down)
            named = not INSTANCE_ID.fullmatch(outcome.node_id)
            if not workflow_ids and self._node_names is not None and named:
                instance = await self._node_names.instance_id(outcome.node_id)
                if instance and instance != outcome.node_id:
                    outcome = outcome.model_copy(update={"node_id": instance})
                    fields["node_id"] = f"{instance} (node {fields['node_id']})"
                    workflow_ids = await self._owners(instance, arrived)
            if not workflow_ids:
                log_event(logging.INFO, "unknown_instance", **fields)
            signalled = [w for w in workflow_ids if await self._signal(w, signal, outcome)]
        except RPCError as e:
            self._metrics.inc("spotrain_webhook_temporal_errors_total")
            # the message tells a client timeout (CANCELLED "Timeout expired") from the rest
            log_event(
                logging.WARNING,
                "temporal_unavailable",
                status=e.status.name,
                message=e.message,
                **fields,
            )
            raise TemporalUnavailable(e.status.name) from None
        for workflow_id in signalled:
            self._metrics.inc("spotrain_webhook_signals_total", signal=signal)
            self._metrics.observe(time.perf_counter() - started)
            log_event(logging.INFO, "signalled", signal=signal, workflow_id=workflow_id, **fields)
        return signalled

    async def _owners(self, node_id: str, arrived: float) -> list[str]:
        """The running workflows whose own state lists the node now."""
        if self._index is None:
            self._metrics.inc("spotrain_webhook_owner_lookups_total", result="query")
            return await self._verified(await self._query_owners(node_id), node_id)
        candidates, listed = await self._index.candidates(node_id, arrived)
        owners = await self._verified(candidates, node_id)
        if listed or len(owners) == len(candidates):
            result = "listed" if listed else "hit"
            self._metrics.inc("spotrain_webhook_owner_lookups_total", result=result)
            return owners
        # A candidate has ended or let the node go since the listing, and the node may be
        # another job's now: list again (a listing begun after this moment) and check anew.
        self._metrics.inc("spotrain_webhook_owner_lookups_total", result="stale")
        recheck = time.monotonic()
        await self._index.refresh(recheck)
        candidates, _ = await self._index.candidates(node_id, recheck)
        return await self._verified(candidates, node_id)

    async def _verified(self, candidates: frozenset[str], node_id: str) -> list[str]:
        return [w for w in sorted(candidates) if await self._holds(w, node_id)]

    async def _query_owners(self, node_id: str) -> frozenset[str]:
        """Node ids are validated to a quote-free charset, so they embed safely."""
        query = f"{attributes.NODE_IDS.name} = '{node_id}' AND ExecutionStatus = 'Running'"
        req = ListWorkflowExecutionsRequest(
            namespace=self._client.namespace, query=query, page_size=100
        )
        self._metrics.inc("spotrain_webhook_visibility_calls_total")
        resp = await self._rpc(self._client.workflow_service.list_workflow_executions, req)
        return frozenset(e.execution.workflow_id for e in resp.executions)

    async def _list_owners(self) -> dict[str, frozenset[str]]:
        """Every running job's node ids, page by page."""
        owners: dict[str, set[str]] = {}
        token = b""
        while True:
            req = ListWorkflowExecutionsRequest(
                namespace=self._client.namespace,
                query=RUNNING,
                page_size=LISTING_PAGE,
                next_page_token=token,
            )
            self._metrics.inc("spotrain_webhook_visibility_calls_total")
            resp = await self._rpc(self._client.workflow_service.list_workflow_executions, req)
            for e in resp.executions:
                nodes = decode_typed_search_attributes(e.search_attributes).get(attributes.NODE_IDS)
                for node in nodes or ():
                    owners.setdefault(node, set()).add(e.execution.workflow_id)
            token = resp.next_page_token
            if not token:
                return {node: frozenset(ids) for node, ids in owners.items()}

    async def _holds(self, workflow_id: str, node_id: str) -> bool:
        """The workflow's own state, not the visibility store: running, and its last upserted
        `SpotrainNodeIds` names the node."""
        req = DescribeWorkflowExecutionRequest(
            namespace=self._client.namespace,
            execution=WorkflowExecution(workflow_id=workflow_id),
        )
        try:
            resp = await self._rpc(self._client.workflow_service.describe_workflow_execution, req)
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                return False
            raise
        info = resp.workflow_execution_info
        if info.status != WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING:
            return False
        nodes = decode_typed_search_attributes(info.search_attributes).get(attributes.NODE_IDS)
        return node_id in (nodes or ())

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
        """One Temporal call, retried for up to `busy_retry_s` when it passes in moments, so
        the sender is not made to retry (or, for a reclaim, to lose part of its two minutes):
        RESOURCE_EXHAUSTED, and a call cut off by its connection closing (`_cut_off`). Pauses
        double from 50 ms to 1 s, each drawn at random below its bound so that a burst's
        retries spread out instead of meeting the limit together. A repeated signal is
        harmless: its request id drops the duplicate."""
        give_up = time.monotonic() + self._busy_retry_s
        bound = FIRST_RETRY_PAUSE_S
        while True:
            sent = time.monotonic()
            try:
                return await call(req, retry=False, timeout=self._timeout)
            except RPCError as e:
                now = time.monotonic()
                left = give_up - now
                busy = e.status == RPCStatusCode.RESOURCE_EXHAUSTED
                if not (busy or self._cut_off(e, now - sent)) or left <= 0:
                    raise
            self._metrics.inc("spotrain_webhook_temporal_retries_total")
            await asyncio.sleep(min(left, random.uniform(0, bound)))
            bound = min(2 * bound, MAX_RETRY_PAUSE_S)

    def _cut_off(self, e: RPCError, took_s: float) -> bool:
        """CANCELLED before this call's own timeout ran out: the connection closed under it
        (the client's gRPC stack says "operation was canceled"). A server closes a connection
        idle for a while (Temporal's frontend after 2 minutes, `keepAliveMaxConnectionIdle`)
        with a GOAWAY, and a call made as it arrives is cancelled unsent; the next call dials
        a new connection. A webhook that waits minutes between notices meets this."""
        return e.status == RPCStatusCode.CANCELLED and took_s < self._timeout.total_seconds()
