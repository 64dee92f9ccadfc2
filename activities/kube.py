"""The Kubernetes rank runtime: each generation is one pod per node, started as a gang.

Per generation g of job J, pod `J-g<g>-<node index>` runs the job's image and command once,
pinned to the member's node (EC2 instance id -> Kubernetes node through `spec.providerID`
`aws:///<zone>/<id>` or the `node.kubernetes.io/instance-id` label), with the rank contract's
environment (workers/elastic/environment.py). A node with `procs > 1` still gets one pod and one
command: RANK is the node's first rank, LOCAL_RANK 0 and LOCAL_WORLD_SIZE its process count,
so the command itself launches the local processes (e.g. `torchrun --nproc-per-node
$LOCAL_WORLD_SIZE ...`). Rank discovery goes through a headless Service per job:
MASTER_ADDR is rank 0's pod DNS name. Horovod and MPI jobs also get a ConfigMap with the
hostfile and a `discover_hosts.sh` for the current generation, mounted at /etc/spotrain/hosts,
and the job's SSH key pair for the launcher's login to the workers: a Secret created once per
job (authorized_keys, known_hosts, ssh_config), mounted at /etc/spotrain/ssh, deleted with it.

Gang start: every container may run at once, but the training library's `wait_for_gang` holds
its ranks until all pods are Running and Ready and this runtime has marked the generation
started in the checkpoint store; a gang not ready in time is deleted, and never marked.

The elastic event is the control record in the checkpoint store, which the training library
polls every 0.25 s (workers/elastic/control.py); the pod annotation `spotrain.io/control`
(empty: run, `stop`: checkpoint and exit), projected into /etc/spotrain/control through a
downwardAPI volume
that the kubelet refreshes on its sync period (about a minute), is the fallback. A pod's
terminationGracePeriodSeconds is the job's graceful timeout: SIGTERM is an elastic event too.
Acks and progress come from the checkpoint store.

Every object carries the labels spotrain.io/managed=true, spotrain.io/job and (pods)
spotrain.io/generation and spotrain.io/rank; cleanup selects by them. Waits use a list and then a
watch from its resourceVersion, heartbeating at least every `watch_s` seconds.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from temporalio import activity
from temporalio.exceptions import ApplicationError

from spotrain.activities.kube_objects import (
    CONTROL,
    LOGIN_TYPES,
    MEMBERS,
    NODE_ID,
    PROCS,
    RANK,
    STOP,
    hosts_body,
    hosts_name,
    owner_selector,
    pod_body,
    service_body,
    ssh_secret_body,
)
from spotrain.activities.notice import raise_elastic_event, rank_notices, reset_control
from spotrain.elastic.job_store import JobStore, checked_store
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    CleanupRequest,
    GenerationPlan,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)

GANG_ERROR = "GangStartError"  # retryable: the workflow's retry policy re-runs the gang start
MERGE_PATCH = "application/merge-patch+json"

# Spot nodes are often tainted so that only spot-tolerant work lands on them.
SPOT_TOLERATIONS: tuple[dict[str, str], ...] = (
    {"key": "spotrain.io/lifecycle", "operator": "Exists"},
    {"key": "karpenter.sh/capacity-type", "operator": "Exists"},
    {"key": "eks.amazonaws.com/capacityType", "operator": "Exists"},
    {"key": "cloud.google.com/gke-spot", "operator": "Exists"},
)

T = TypeVar("T")
Pods = dict[str, client.V1Pod]


def _config_errors(fn: Callable[..., T]) -> Callable[..., T]:
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


def instance_id(node: client.V1Node) -> str | None:
    """EC2 instance id of a node: the instance-id label, else providerID's last segment."""
    labels = node.metadata.labels or {}
    if "node.kubernetes.io/instance-id" in labels:
        return labels["node.kubernetes.io/instance-id"]
    provider = node.spec.provider_id if node.spec else None
    return provider.rsplit("/", 1)[-1] if provider else None


def _ranks(pod: client.V1Pod) -> set[int]:
    first = int(pod.metadata.labels[RANK])
    return set(range(first, first + int(pod.metadata.annotations[PROCS])))


def _ready(pod: client.V1Pod) -> bool:
    conditions = (pod.status and pod.status.conditions) or []
    return pod.status.phase == "Running" and any(
        c.type == "Ready" and c.status == "True" for c in conditions
    )


def _exit_code(pod: client.V1Pod) -> int | None:
    for status in pod.status.container_statuses or []:
        if status.state and status.state.terminated:
            return status.state.terminated.exit_code
    return -1 if pod.status.phase == "Failed" else None


def why_stuck(pod: client.V1Pod) -> str:
    """The most specific reason a pod is not Running and Ready, as kubectl would show it."""
    status = pod.status
    for c in status.conditions or []:
        if c.type == "PodScheduled" and c.status == "False":
            return f"{status.phase}, {c.reason}: {c.message}"
    for cs in status.container_statuses or []:
        if cs.state and cs.state.waiting:
            return f"{status.phase}, {cs.state.waiting.reason}: {cs.state.waiting.message or ''}"
    return f"{status.phase}, {status.reason or 'not Ready'}: {status.message or ''}"


class GangFailed(Exception):
    """A pod of the gang ended before the gang started."""


class KubeRuntime:
    """Rank runtime activities over the Kubernetes API.

    `namespace` may contain `{job}` for a namespace per job (created beforehand, with the Role
    bound in it); by default all jobs share one. `api_client` None loads the in-cluster service
    account, else the kubeconfig.
    """

    def __init__(
        self,
        namespace: str = "spotrain",
        api_client: client.ApiClient | None = None,
        *,
        master_port: int = 29500,
        gang_timeout_s: float = 600.0,
        watch_s: int = 4,
        ack_poll_s: float = 0.5,
        tolerations: tuple[dict[str, str], ...] = SPOT_TOLERATIONS,
    ) -> None:
        if api_client is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace
        self.master_port = master_port
        self.gang_timeout_s = gang_timeout_s
        self.watch_s = watch_s
        self.ack_poll_s = ack_poll_s
        self.tolerations = tolerations

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.start_generation,
            self.prepare_generation,
            self.stop_generation,
            self.watch_generation,
            self.cleanup_job,
        ]

    def _ns(self, job: str) -> str:
        return self.namespace.format(job=job)

    # --- activities ------------------------------------------------------------------------

    @activity.defn(name=contract.START_GENERATION)
    @_config_errors
    def start_generation(self, plan: GenerationPlan) -> None:
        """Create the generation's pods (create-or-get) and wait until all are Running+Ready,
        then mark the generation started (the training library's `wait_for_gang` lets ranks
        go); past `gang_timeout_s`, delete them and raise naming the stuck pods and why."""
        if not plan.image:
            raise ApplicationError(
                "the Kubernetes runtime needs the job's `image`",
                type=contract.CONFIG_ERROR,
                non_retryable=True,
            )
        store = checked_store(plan.checkpoint, time.time(), plan.generation)
        ns = self._ns(plan.job)
        deadline = time.monotonic() + self.gang_timeout_s
        hosts = self._node_hostnames([m.node_id for m in plan.members], deadline)
        self._create(
            self.core.create_namespaced_service, ns, service_body(plan.job, self.master_port)
        )
        if plan.job_type in LOGIN_TYPES:
            self._put_hosts(ns, plan)
            self._put_ssh_keys(ns, plan.job)
        names = set()
        reset_control(plan.checkpoint, plan.generation)  # no stale 'stop' obeyed
        for index, member in enumerate(plan.members):
            body = pod_body(
                plan, index, hosts[member.node_id], ns, self.master_port, self.tolerations
            )
            self._create(self.core.create_namespaced_pod, ns, body)
            names.add(body["metadata"]["name"])

        def all_ready(pods: Pods) -> bool | None:
            ended = [p.metadata.name for p in pods.values() if p.status.phase in _ENDED]
            gone = names - pods.keys()
            if ended or gone:
                raise GangFailed(f"pods ended or vanished before the start: {ended or gone}")
            return all(_ready(p) for p in pods.values()) or None

        selector = owner_selector(plan.job, plan.generation)
        try:
            ready, pods = self._wait_pods(ns, selector, all_ready, deadline)
            if not ready:
                stuck = [f"{n} ({why_stuck(p)})" for n, p in sorted(pods.items()) if not _ready(p)]
                raise GangFailed(
                    f"not Running and Ready after {self.gang_timeout_s:g}s: {'; '.join(stuck)}"
                )
        except GangFailed as err:
            self._delete_pods(ns, names, grace_s=0)
            raise ApplicationError(
                f"gang start of {plan.job} generation {plan.generation} rolled back: {err}",
                type=GANG_ERROR,
            ) from None
        store.mark_started(plan.generation, time.time())  # the gang goes

    @activity.defn(name=contract.PREPARE_GENERATION)
    def prepare_generation(self, plan: GenerationPlan) -> None:
        """No head start: pods do not resize live yet (they get no SPOTRAIN_RESIZE), so the
        next generation's pods are all created by `start_generation`."""

    @activity.defn(name=contract.STOP_GENERATION)
    @_config_errors
    def stop_generation(self, req: StopRequest) -> StopResult:
        """Pods on lost nodes (named in the request, or whose Node object is gone) go at once;
        if graceful, raise the elastic event on the others, wait up to `grace_s` for their
        acks, then delete them with that grace period, all but Failed ones (kept for
        debugging until cleanup). Returns once the pods are gone."""
        ns = self._ns(req.job)
        selector = owner_selector(req.job, req.generation)
        store = JobStore(req.checkpoint)
        pods = self.core.list_namespaced_pod(ns, label_selector=selector).items
        gone = set(self._gone_nodes({p.metadata.name: p for p in pods}))
        lost = {
            p.metadata.name
            for p in pods
            if p.metadata.annotations[NODE_ID] in req.lost_node_ids or p.spec.node_name in gone
        }
        self._delete_pods(ns, lost, grace_s=0)
        rest = [p for p in pods if p.metadata.name not in lost]
        expected = {r for p in rest if p.status.phase not in _ENDED for r in _ranks(p)}
        if req.graceful and expected:
            raise_elastic_event(req)  # the control record the ranks poll (< 1 s)
            for pod in rest:  # the downwardAPI fallback
                self.core.patch_namespaced_pod(
                    pod.metadata.name,
                    ns,
                    {"metadata": {"annotations": {CONTROL: STOP}}},
                    _content_type=MERGE_PATCH,
                )
            ack_deadline = time.monotonic() + req.grace_s
            while not expected <= set(store.acked_ranks(req.generation)):
                if time.monotonic() >= ack_deadline:
                    break
                activity.heartbeat()
                time.sleep(self.ack_poll_s)
        acked, checkpoint_step, step = store.ended(req.generation)
        grace = math.ceil(req.grace_s) if req.graceful else 0
        # A Failed pod holds no resources and is what someone debugging the fault needs:
        # it stays until cleanup_job (which keeps it too when the job's cleanup policy says so).
        running = {p.metadata.name for p in rest if p.status.phase != "Failed"}
        self._delete_pods(ns, running, grace_s=grace)
        self._wait_pods(
            ns,
            selector,
            lambda pods: all(p.status.phase == "Failed" for p in pods.values()) or None,
            time.monotonic() + grace + 30,
        )
        return StopResult(
            acked_ranks=acked,
            checkpoint_step=checkpoint_step,
            forced=bool(expected - set(acked)),
            step=step,
        )

    @activity.defn(name=contract.WATCH_GENERATION)
    @_config_errors
    def watch_generation(self, req: WatchRequest) -> WatchResult:
        """Return `failed` as soon as a pod fails, vanishes or loses its node, `completed` when
        every pod Succeeded after the done marker, else `progress` after `report_after_s`."""
        ns = self._ns(req.job)
        store = JobStore(req.checkpoint)

        def verdict(pods: Pods) -> WatchResult | None:
            codes = {int(p.metadata.labels[RANK]): _exit_code(p) for p in pods.values()}
            exited = {rank: code for rank, code in codes.items() if code is not None}
            if any((p.metadata.annotations or {}).get(CONTROL) for p in pods.values()):
                return None  # being stopped: stop_generation owns the outcome
            # notices ranks found (EC2 metadata) go to the workflow at once
            notices = rank_notices(store, req.generation)
            if any(n.event_id not in req.known_events for n in notices):
                return WatchResult(outcome="progress", notices=notices, **_steps(store, req))
            if not pods:
                return WatchResult(outcome="failed", detail="no pods left in the generation")
            if any(exited.values()):
                bad = {r: c for r, c in exited.items() if c}
                return WatchResult(outcome="failed", exit_codes=exited, detail=f"exit {bad}")
            # Deleted by someone else (`kubectl delete pod`, a node drain): Terminating for
            # its grace period before it vanishes, and lost from the moment it was deleted.
            deleting = sorted(n for n, p in pods.items() if p.metadata.deletion_timestamp)
            if deleting:
                detail = f"pod(s) being deleted: {deleting}"
                return WatchResult(outcome="failed", exit_codes=exited, detail=detail)
            expected = int(next(iter(pods.values())).metadata.annotations[MEMBERS])
            if len(pods) < expected:
                detail = f"{expected - len(pods)} pod(s) vanished"
                return WatchResult(outcome="failed", exit_codes=exited, detail=detail)
            gone = self._gone_nodes(pods)
            if gone:
                return WatchResult(
                    outcome="failed", exit_codes=exited, detail=f"node(s) gone: {gone}"
                )
            if len(exited) == len(pods):
                if store.done():
                    return WatchResult(outcome="completed", exit_codes=exited, **_steps(store, req))
                return WatchResult(
                    outcome="failed", exit_codes=exited, detail="exited 0 without done marker"
                )
            return None

        deadline = time.monotonic() + req.report_after_s
        result, _ = self._wait_pods(
            ns, owner_selector(req.job, req.generation), verdict, deadline, periodic=True
        )
        return result or WatchResult(outcome="progress", **_steps(store, req))

    @activity.defn(name=contract.CLEANUP_JOB)
    @_config_errors
    def cleanup_job(self, req: CleanupRequest) -> None:
        """Delete the job's pods, Service and ConfigMaps; with `keep`, Failed pods stay."""
        ns = self._ns(req.job)
        selector = owner_selector(req.job)
        pods = self.core.list_namespaced_pod(ns, label_selector=selector).items
        doomed = {p.metadata.name for p in pods if not (req.keep and p.status.phase == "Failed")}
        self._delete_pods(ns, doomed, grace_s=None)
        for svc in self.core.list_namespaced_service(ns, label_selector=selector).items:
            _absent(self.core.delete_namespaced_service, svc.metadata.name, ns)
        for cm in self.core.list_namespaced_config_map(ns, label_selector=selector).items:
            _absent(self.core.delete_namespaced_config_map, cm.metadata.name, ns)
        # The SSH keys: deleted by label, never read back (no get or list on Secrets).
        self.core.delete_collection_namespaced_secret(ns, label_selector=selector)

    # --- objects ---------------------------------------------------------------------------

    def _put_hosts(self, ns: str, plan: GenerationPlan) -> None:
        """Create or update the hostfile ConfigMap: running pods see the new members."""
        body = hosts_body(plan, ns)
        try:
            self.core.create_namespaced_config_map(ns, body)
        except ApiException as err:
            if err.status != 409:
                raise
            self.core.patch_namespaced_config_map(
                hosts_name(plan.job), ns, body, _content_type=MERGE_PATCH
            )

    def _put_ssh_keys(self, ns: str, job: str) -> None:
        """Create the job's SSH key pair once: a retry or a later generation finds it there
        (AlreadyExists) and keeps it, so running pods go on logging in with the same key.
        The key exists here and in the Secret only: not in activity results, not in logs."""
        key = ed25519.Ed25519PrivateKey.generate()
        private = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.OpenSSH,
            serialization.NoEncryption(),
        ).decode()
        public = key.public_key().public_bytes(
            serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
        )
        body = ssh_secret_body(job, ns, private, f"{public.decode()} spotrain-{job}\n")
        self._create(self.core.create_namespaced_secret, ns, body)

    # --- API helpers -----------------------------------------------------------------------

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
            _absent(self.core.delete_namespaced_pod, name, ns, grace_period_seconds=grace_s)

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


_ENDED = ("Succeeded", "Failed")


def _absent(delete: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Delete-if-present: NotFound means it is already gone."""
    try:
        delete(*args, **kwargs)
    except ApiException as err:
        if err.status != 404:
            raise


def _steps(store: JobStore, req: WatchRequest) -> dict[str, Any]:
    progress = store.progress(req.generation)
    latest = store.latest_checkpoint()
    return {
        "step": progress["step"] if progress else None,
        "checkpoint_step": latest["step"] if latest else None,
        "checkpoints": store.checkpoint_stats(),
        "ranks": store.rank_steps(req.generation, time.time()),
    }
