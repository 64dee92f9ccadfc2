"""The Kubernetes API as the runtime uses it (activities/kube.py): create-or-get,
delete-if-present, wait on pods by listing then watching from the list's resourceVersion
(heartbeating at least every `watch_s` seconds), the nodes behind instance ids, and refusals
that no retry heals turned into the job's ConfigError."""

from __future__ import annotations

import contextlib
import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from temporalio import activity
from temporalio.exceptions import ApplicationError

from spotrain.activities.kube_objects import NODE_LABEL
from spotrain.workflows import contract

GANG_ERROR = "GangStartError"  # retryable: the workflow's retry policy re-runs the gang start
ENDED = ("Succeeded", "Failed")
# Connections kept to the API server: one per activity a worker may run at once (each
# running job's watch holds one), so that none is opened and thrown away per call.
CONNECTIONS = 512

T = TypeVar("T")
Pods = dict[str, client.V1Pod]


def config_errors(fn: Callable[..., T]) -> Callable[..., T]:
    """401/403 (RBAC) and 422 (invalid object) will not heal on retry: fail the job, quoting
    the server's reason (which names the refused verb or the invalid field)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except ApiException as err:
            if err.status in (401, 403, 422):
                raise ApplicationError(
                    f"kubernetes API refused ({err.status} {err.reason}): {_message(err)}",
                    type=contract.CONFIG_ERROR,
                    non_retryable=True,
                ) from err
            raise

    return wrapper


def _message(err: ApiException) -> str:
    """The `Status` message the server sent (which names the offending field), else the body."""
    try:
        return str(json.loads(err.body)["message"])
    except (TypeError, ValueError, KeyError):
        return str(err.body or "")


def default_api_client() -> client.ApiClient:
    """The cluster's API as the process finds it: its pod's service account, else the
    kubeconfig (KUBECONFIG or ~/.kube/config)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    settings = client.Configuration.get_default_copy()
    settings.connection_pool_maxsize = CONNECTIONS
    return client.ApiClient(settings)


def instance_id(node: client.V1Node) -> str | None:
    """The node provider's id of a node: the spotrain.io/node label (a NodeClaim's name, which
    Karpenter copies onto its node), else the EC2 instance id (the instance-id label, else
    providerID's last segment)."""
    labels = node.metadata.labels or {}
    if NODE_LABEL in labels:
        return labels[NODE_LABEL]
    if "node.kubernetes.io/instance-id" in labels:
        return labels["node.kubernetes.io/instance-id"]
    provider = node.spec.provider_id if node.spec else None
    return provider.rsplit("/", 1)[-1] if provider else None


def ready(pod: client.V1Pod) -> bool:
    conditions = (pod.status and pod.status.conditions) or []
    return pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in conditions
    )


def absent(delete: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Delete-if-present: NotFound means it is already gone."""
    try:
        delete(*args, **kwargs)
    except ApiException as err:
        if err.status != 404:
            raise


class PodApi:
    """The calls, for a runtime over `core` (see the module's docstring)."""

    def __init__(self, core: client.CoreV1Api, watch_s: int, gang_timeout_s: float) -> None:
        self.core = core
        self.watch_s = watch_s
        self.gang_timeout_s = gang_timeout_s

    @staticmethod
    def _create(create: Callable[..., Any], ns: str, body: dict[str, Any]) -> None:
        """Create-or-get: AlreadyExists means an earlier attempt already did it."""
        try:
            create(ns, body)
        except ApiException as err:
            if err.status != 409:
                raise

    def _delete_pods(self, ns: str, names: set[str], grace_s: int | None) -> None:
        for name in sorted(names):
            absent(self.core.delete_namespaced_pod, name, ns, grace_period_seconds=grace_s)

    def _end_pods(self, ns: str, pods: Pods, grace_s: int | None) -> None:
        """Delete `pods` with the grace period, those whose node is gone at once: no kubelet
        is left to end them (a cluster's pod garbage collector would, in its own time)."""
        gone = set(self._gone_nodes(pods))
        orphans = {n for n, p in pods.items() if p.spec.node_name in gone}
        self._delete_pods(ns, orphans, grace_s=0)
        self._delete_pods(ns, set(pods) - orphans, grace_s=grace_s)

    def _node_hostnames(self, node_ids: list[str], deadline: float) -> dict[str, str]:
        """Instance id -> node hostname label, waiting (until `deadline`) for nodes to join."""
        while True:
            hosts = {}
            for node in self.core.list_node().items:
                labels = node.metadata.labels or {}
                hosts[instance_id(node)] = labels.get("kubernetes.io/hostname", node.metadata.name)
            missing = [n for n in node_ids if n not in hosts]
            if not missing:
                return {n: hosts[n] for n in node_ids}
            if time.monotonic() >= deadline:
                raise ApplicationError(
                    f"node(s) {missing} did not join the cluster in {self.gang_timeout_s:g}s",
                    type=GANG_ERROR,
                )
            activity.heartbeat()
            time.sleep(self.watch_s)

    def _gone_nodes(self, pods: Pods) -> list[str]:
        gone = []
        for node in sorted({p.spec.node_name for p in pods.values() if p.spec.node_name}):
            try:
                self.core.read_node(node)
            except ApiException as err:
                if err.status != 404:
                    raise
                gone.append(node)
        return gone

    def _wait_pods(
        self,
        ns: str,
        selector: str,
        decide: Callable[[Pods], T | None],
        deadline: float,
        *,
        periodic: bool = False,
    ) -> tuple[T | None, Pods]:
        """List the pods, then watch them from the list's resourceVersion until `decide`
        returns non-None or `deadline` passes. `decide` runs on every change (and, with
        `periodic`, every `watch_s` too, for what pods' events do not show: nodes going)."""
        pods, version = self._list_pods(ns, selector)
        result = decide(pods)
        while result is None:
            activity.heartbeat()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            timeout = max(1, min(self.watch_s, math.ceil(left)))
            events = watch.Watch().stream(
                self.core.list_namespaced_pod,
                ns,
                label_selector=selector,
                resource_version=version,
                timeout_seconds=timeout,
                _request_timeout=timeout + 10,
            )
            try:
                # (closed on leaving: the connection goes back now, not at garbage collection)
                with contextlib.closing(events):
                    for event in events:
                        pod = event["object"]
                        version = pod.metadata.resource_version
                        if event["type"] == "DELETED":
                            pods.pop(pod.metadata.name, None)
                        else:
                            pods[pod.metadata.name] = pod
                        activity.heartbeat()
                        result = decide(pods)
                        if result is not None:
                            break
                    else:
                        if periodic:
                            result = decide(pods)
            except ApiException as err:
                if err.status != 410:
                    raise
                # 410 Gone: etcd compacted past `version` (a quiet watch outlived the
                # apiserver's compaction interval): start again from a fresh list.
                pods, version = self._list_pods(ns, selector)
                result = decide(pods)
        return result, pods

    def _list_pods(self, ns: str, selector: str) -> tuple[Pods, str]:
        listing = self.core.list_namespaced_pod(ns, label_selector=selector)
        return {p.metadata.name: p for p in listing.items}, listing.metadata.resource_version
