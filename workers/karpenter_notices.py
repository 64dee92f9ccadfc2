"""Karpenter's disruptions of spotrain's NodeClaims, as the owning job's `reclaim` and
`node_lost` signals: the notice path of the Karpenter provider (activities/karpenter.py).

One watch on the NodeClaims labelled spotrain.io/managed=true:
- a claim Karpenter marks for disruption (status condition DisruptionReason: consolidation,
  drift, expiry, emptiness; it taints the node karpenter.sh/disrupted at the same time) or
  starts to delete (its interruption queue's spot notice, a NodePool deleted, `kubectl delete
  nodeclaim`) is a reclaim notice. Its deadline is Karpenter's termination timestamp (the
  claim's terminationGracePeriod) when it has one; else none, and the job takes its graceful
  timeout: its pods' karpenter.sh/do-not-disrupt holds the drain until the job lets them go;
- a claim that vanishes without either (its finalizer removed, the instance gone) is a loss.

Both marks of one disruption carry the event id `karpenter/<claim>/disrupted`, so the workflow
takes them as one event, as it does a notice that EventBridge and the node termination handler
both send. Watching keeps no state that matters: after a restart the listing re-signals what
is pending, and the workflow ignores what it already has. A job that has ended is skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from spotrain.activities.karpenter import GROUP, PLURAL, VERSION, condition
from spotrain.activities.kube_objects import JOB, MANAGED
from spotrain.workflows.contract import Message, NodeLost, ReclaimNotice

log = logging.getLogger("spotrain.karpenter")

TERMINATION_AT = "karpenter.sh/nodeclaim-termination-timestamp"
WATCH_S = 60
RETRY_S = 1.0


def _time(stamp: str | None) -> datetime | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def notice_for(kind: str, claim: Mapping[str, Any]) -> tuple[str, str, Message] | None:
    """(job, signal, payload) for one watch event of a claim, or None when it says nothing new
    about the claim's node. `kind`: the watch's ADDED, MODIFIED or DELETED."""
    meta = claim["metadata"]
    job, name = (meta.get("labels") or {}).get(JOB), meta["name"]
    if not job:
        return None
    disrupted = condition(claim, "DisruptionReason").get("status") == "True"
    if meta.get("deletionTimestamp") or disrupted:
        deadline = _time((meta.get("annotations") or {}).get(TERMINATION_AT))
        notice = ReclaimNotice(
            node_id=name, deadline=deadline, event_id=f"karpenter/{name}/disrupted"
        )
        return job, "reclaim", notice
    if kind == "DELETED":
        return job, "node_lost", NodeLost(node_id=name, event_id=f"karpenter/{name}/lost")
    return None


class KarpenterNotices:
    """Watches the claims (a thread: the Kubernetes client blocks) and signals their jobs
    from the event loop. Each event id is signalled once per process."""

    def __init__(self, temporal: Client, api_client: client.ApiClient) -> None:
        self.temporal = temporal
        self.api = client.CustomObjectsApi(api_client)
        self.sent: set[str] = set()
        self._stop = threading.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: every notice of the claims' watch, signalled to its job."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, str, Message]] = asyncio.Queue()

        def put(item: tuple[str, str, Message]) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        thread = threading.Thread(target=self._watch, args=(put,), daemon=True)
        thread.start()
        waiter = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, waiter}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                await self._signal(*getter.result())
        finally:
            self._stop.set()
            waiter.cancel()

    async def _signal(self, job: str, signal: str, payload: Message) -> None:
        event_id = getattr(payload, "event_id", None) or ""
        if event_id in self.sent:
            return
        try:
            await self.temporal.get_workflow_handle(job).signal(signal, payload)
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                log.warning("karpenter notice %s for %s not delivered: %s", event_id, job, err)
                return  # the next event of the claim, or the next listing, tries again
            log.info("karpenter notice %s: job %s has ended", event_id, job)
        else:
            log.info("karpenter notice %s: %s signalled to %s", event_id, signal, job)
        self.sent.add(event_id)

    def _watch(self, put: Any) -> None:
        selector = f"{MANAGED}=true"
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    listing = self.api.list_cluster_custom_object(
                        GROUP, VERSION, PLURAL, label_selector=selector
                    )
                    version = listing["metadata"]["resourceVersion"]
                    for claim in listing.get("items", []):
                        if found := notice_for("ADDED", claim):
                            put(found)
                stream = watch.Watch().stream(
                    self.api.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    PLURAL,
                    label_selector=selector,
                    resource_version=version,
                    timeout_seconds=WATCH_S,
                    _request_timeout=WATCH_S + 10,
                )
                with contextlib.closing(stream):
                    for event in stream:
                        claim = event["object"]
                        version = claim["metadata"]["resourceVersion"]
                        if found := notice_for(event["type"], claim):
                            put(found)
                        if self._stop.is_set():
                            return
            except ApiException as err:
                if err.status != 410:
                    log.warning("karpenter notices: watching NodeClaims failed: %s", err)
                    self._stop.wait(RETRY_S)
                version = None  # 410: compacted past it; either way, list again
            except Exception as err:  # a dropped connection: list again, never stop watching
                log.warning("karpenter notices: watch interrupted: %s", err)
                self._stop.wait(RETRY_S)
                version = None
