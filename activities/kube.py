"""The Kubernetes rank runtime: each generation is one pod per node, started as a gang.

Per generation g of job J, pod `J-g<g>-<node index>` runs the job's image and command once,
pinned to the member's node (EC2 instance id -> Kubernetes node through `spec.providerID`
`aws:///<zone>/<id>` or the `node.kubernetes.io/instance-id` label), with the rank contract's
environment (workers/elastic/environment.py). A node with `procs > 1` still gets one pod and one
command: RANK is the node's first rank, LOCAL_RANK 0 and LOCAL_WORLD_SIZE its process count,
so the command itself launches the local processes (e.g. `torchrun --nproc-per-node
$LOCAL_WORLD_SIZE ...`). Rank discovery goes through a headless Service per job:
MASTER_ADDR is rank 0's pod DNS name, and the gang start records its pod IP, which the
training library's `wait_for_gang` puts in its place (no wait for a new pod's DNS record).
Horovod and MPI jobs also get a ConfigMap with the hostfile and a `discover_hosts.sh` for the
current generation, mounted at /etc/spotrain/hosts, and the job's SSH key pair for the
launcher's login to the workers: a Secret created once per job (authorized_keys,
known_hosts, ssh_config), mounted at /etc/spotrain/ssh, deleted with it.

Gang start: every container may run at once, but the training library's `wait_for_gang` holds
its ranks until all pods are Running and Ready and this runtime has marked the generation
started in the checkpoint store; a gang not ready in time is deleted, and never marked.

The elastic event is the control record in the checkpoint store, which the training library
polls every 0.05 s on file://, 0.25 s on s3:// (workers/elastic/control.py); the pod
annotation `spotrain.io/control` (empty: run, `stop`: checkpoint and exit), projected into
/etc/spotrain/control through a downwardAPI volume that the kubelet refreshes on its sync
period (about a minute), is the fallback. A pod's terminationGracePeriodSeconds is the job's
graceful timeout: SIGTERM is an elastic event too. Acks and progress come from the checkpoint store.

Every object carries the labels spotrain.io/managed=true, spotrain.io/job and (pods)
spotrain.io/generation and spotrain.io/rank; cleanup selects by them. The API calls
themselves (create-or-get, delete-if-present, list-then-watch) are in kube_api.py; live
resize (`elastic.resize: live`: parked pods stay and are adopted) is explained in
kube_live.py.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from temporalio import activity
from temporalio.exceptions import ApplicationError

from spotrain.activities import kube_live
from spotrain.activities.checkpoint_check import check_checkpoint
from spotrain.activities.kube_api import (
    ENDED,
    GANG_ERROR,
    PodApi,
    Pods,
    absent,
    config_errors,
    default_api_client,
    ready,
)
from spotrain.activities.kube_objects import (
    CONTROL,
    GENERATION,
    JOB,
    LOGIN_TYPES,
    MANAGED,
    MEMBERS,
    NODE_ID,
    RANK,
    SPEC,
    STOP,
    hosts_body,
    hosts_name,
    owner_selector,
    pod_body,
    pod_ranks,
    service_body,
    ssh_name,
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

LIVE_ACK_POLL_S = 0.02
MERGE_PATCH = "application/merge-patch+json"

# Spot nodes are often tainted so that only spot-tolerant work lands on them.
SPOT_TOLERATIONS: tuple[dict[str, str], ...] = (
    {"key": "spotrain.io/lifecycle", "operator": "Exists"},
    {"key": "karpenter.sh/capacity-type", "operator": "Exists"},
    {"key": "eks.amazonaws.com/capacityType", "operator": "Exists"},
    {"key": "cloud.google.com/gke-spot", "operator": "Exists"},
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


class KubeRuntime(PodApi):
    """Rank runtime activities over the Kubernetes API.

    `namespace` may contain `{job}` for a namespace per job (created beforehand, with the Role
    bound in it); by default all jobs share one. `api_client` None loads the in-cluster service
    account, else the kubeconfig.
    """

    def __init__(
        self,
        namespace: str = "spotrain-jobs",
        api_client: client.ApiClient | None = None,
        *,
        master_port: int = 29500,
        gang_timeout_s: float = 600.0,
        watch_s: int = 4,
        ack_poll_s: float = 0.5,
        head_start_s: float = 240.0,
        tolerations: tuple[dict[str, str], ...] = SPOT_TOLERATIONS,
    ) -> None:
        api_client = api_client or default_api_client()
        super().__init__(client.CoreV1Api(api_client), watch_s, gang_timeout_s)
        self.namespace = namespace
        self.master_port = master_port
        self.ack_poll_s = ack_poll_s
        self.head_start_s = head_start_s
        self.tolerations = tolerations

    @classmethod
    def from_env(cls) -> KubeRuntime:
        """As the worker and `spotrain release` configure it: SPOTRAIN_K8S_NAMESPACE."""
        return cls(namespace=os.environ.get("SPOTRAIN_K8S_NAMESPACE", "spotrain-jobs"))

    def activities(self) -> list[Callable[..., Any]]:
        return [
            check_checkpoint,
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
    @config_errors
    def start_generation(self, plan: GenerationPlan) -> None:
        """Create the generation's pods (create-or-get; live: adopt the parked ones, see
        kube_live.py) and wait until all are Running+Ready, then mark the generation started
        with rank 0's pod IP (the training library's `wait_for_gang` lets ranks go); past
        `gang_timeout_s`, delete the pods it made and raise naming the stuck pods and why."""
        if not plan.image:
            raise ApplicationError(
                "the Kubernetes runtime needs the job's `image`",
                type=contract.CONFIG_ERROR,
                non_retryable=True,
            )
        store = checked_store(plan.checkpoint, time.time(), plan.generation)
        ns = self._ns(plan.job)
        deadline = time.monotonic() + self.gang_timeout_s
        self._create(
            self.core.create_namespaced_service, ns, service_body(plan.job, self.master_port)
        )
        if plan.job_type in LOGIN_TYPES:
            self._put_hosts(ns, plan)
            self._put_ssh_keys(ns, plan.job)
        reset_control(plan.checkpoint, plan.generation)  # no stale 'stop' obeyed
        adopted = self._adopt(ns, plan, store) if plan.resize == "live" else {}
        made = self._make_pods(ns, plan, adopted, deadline)
        names = set(made) | set(adopted.values())

        def all_ready(pods: Pods) -> bool | None:
            ended = [p.metadata.name for p in pods.values() if p.status.phase in ENDED]
            gone = names - pods.keys()
            if ended or gone:
                raise GangFailed(f"pods ended or vanished before the start: {ended or gone}")
            return all(ready(p) for p in pods.values()) or None

        selector = owner_selector(plan.job, plan.generation)
        try:
            started, pods = self._wait_pods(ns, selector, all_ready, deadline)
            if not started:
                stuck = [f"{n} ({why_stuck(p)})" for n, p in sorted(pods.items()) if not ready(p)]
                raise GangFailed(
                    f"not Running and Ready after {self.gang_timeout_s:g}s: {'; '.join(stuck)}"
                )
        except GangFailed as err:
            # (adopted survivors stay parked in this generation: a retry keeps them)
            self._delete_pods(ns, set(made), grace_s=0)
            raise ApplicationError(
                f"gang start of {plan.job} generation {plan.generation} rolled back: {err}",
                type=GANG_ERROR,
            ) from None
        if adopted and made:
            # Survivors meet their new peers at the gang start, within the collective timeout:
            # not before those are up (a pod's process imports torch and builds its model).
            self._wait_pods(ns, selector, self._up(plan, made, store), deadline, periodic=True)
        master = pods[kube_live.master_pod(plan, adopted)].status.pod_ip
        store.mark_started(
            plan.generation, time.time(), {"MASTER_ADDR": master} if master else None
        )

    @activity.defn(name=contract.PREPARE_GENERATION)
    @config_errors
    def prepare_generation(self, plan: GenerationPlan) -> None:
        """Live resize's head start: make the next generation's new pods now, as its start
        would if every running pod parks, and wait (up to `head_start_s`) for their ranks to
        be up (torch imported, waiting for the gang start) while this generation trains on."""
        if plan.resize != "live":
            return
        ns = self._ns(plan.job)
        running, _ = self._list_pods(ns, owner_selector(plan.job, plan.generation - 1))
        staying = {n: kube_live.ParkedPod.of(p) for n, p in running.items() if ready(p)}
        port = kube_live.rendezvous_port(self.master_port, plan)
        adopted = kube_live.place(plan, staying, ns, port).adopted
        if not adopted:
            return  # nobody would hand the state over: the start makes every pod
        reset_control(plan.checkpoint, plan.generation)
        deadline = time.monotonic() + self.head_start_s
        made = self._make_pods(ns, plan, adopted, deadline)
        up = self._up(plan, made, JobStore(plan.checkpoint))
        self._wait_pods(ns, owner_selector(plan.job, plan.generation), up, deadline, periodic=True)

    @staticmethod
    def _up(plan: GenerationPlan, made: set[str], store: JobStore) -> Callable[[Pods], bool | None]:
        """A `_wait_pods` decision: True once every pod in `made` runs and its ranks wait for
        the gang start (or one of them ended: the start will say why)."""

        def decide(pods: Pods) -> bool | None:
            mine = [pods.get(name) for name in made]
            if any(p is not None and p.status.phase in ENDED for p in mine):
                return True
            if not all(p is not None and ready(p) for p in mine):
                return None
            ranks = set().union(*(pod_ranks(p) for p in mine))
            return ranks <= store.waiting_ranks(plan.generation) or None

        return decide

    @activity.defn(name=contract.STOP_GENERATION)
    @config_errors
    def stop_generation(self, req: StopRequest) -> StopResult:
        """Pods on lost nodes (named in the request, or whose Node object is gone) go at once;
        if graceful (or live), raise the elastic event on the others and wait up to `grace_s`
        for their acks. Live: a pod whose ranks all acked is parked and stays (kube_live.py).
        The rest are deleted with that grace period, all but Failed ones (kept for debugging
        until cleanup); a job found done also loses the next generation's head start. Returns
        once they are gone."""
        ns = self._ns(req.job)
        selector = owner_selector(req.job, req.generation)
        store = JobStore(req.checkpoint)
        pods, _ = self._list_pods(ns, selector)
        gone = set(self._gone_nodes(pods))
        lost = {
            n
            for n, p in pods.items()
            if p.metadata.annotations[NODE_ID] in req.lost_node_ids or p.spec.node_name in gone
        }
        rest = {n: p for n, p in pods.items() if n not in lost}
        expected = {r for p in rest.values() if p.status.phase not in ENDED for r in pod_ranks(p)}
        stopping = (req.graceful or req.live) and expected
        if stopping:
            # the control record the ranks poll (< 1 s); before the lost pods go, so that
            # their peers stop waiting on them even if a lost node closes nothing
            lost_nodes = [pods[n].metadata.annotations[NODE_ID] for n in lost]
            raise_elastic_event(req, lost=lost_nodes)
        self._delete_pods(ns, lost, grace_s=0)
        if stopping:
            if not req.live:  # the downwardAPI fallback (live: see kube_live.py)
                for name in rest:
                    stop = {"metadata": {"annotations": {CONTROL: STOP}}}
                    self.core.patch_namespaced_pod(name, ns, stop, _content_type=MERGE_PATCH)
            self._wait_acks(ns, selector, store, req, expected)
        acked, checkpoint_step, step, done = store.ended(req.generation)
        if done:  # the next generation will never run: its head start (live) holds nothing
            head_start, _ = self._list_pods(ns, owner_selector(req.job, req.generation + 1))
            self._delete_pods(ns, set(head_start), grace_s=0)
        parked: dict[str, kube_live.ParkedPod] = {}
        if req.live:
            now, _ = self._list_pods(ns, selector)
            parked = kube_live.parked_pods([now[n] for n in rest if n in now], set(acked))
        grace = math.ceil(req.grace_s) if req.graceful else 0
        # A Failed pod holds no resources and is what someone debugging the fault needs:
        # it stays until cleanup_job (which keeps it too when the job's cleanup policy says so).
        running = {n for n, p in rest.items() if p.status.phase != "Failed"} - parked.keys()
        self._delete_pods(ns, running, grace_s=grace)
        self._wait_pods(
            ns,
            selector,
            lambda pods: (
                all(p.status.phase == "Failed" or n in parked for n, p in pods.items()) or None
            ),
            time.monotonic() + grace + 30,
        )
        steps = store.ack_steps(req.generation)
        held = [steps[r] for p in parked.values() for r in p.ranks]
        return StopResult(
            acked_ranks=acked,
            checkpoint_step=checkpoint_step,
            forced=bool(expected - set(acked)),
            step=step,
            held_step=max(held) if held else None,
            done=done,
        )

    def _wait_acks(
        self, ns: str, selector: str, store: JobStore, req: StopRequest, expected: set[int]
    ) -> None:
        """Until every expected rank acked, its pod ended, or `grace_s` passed. A live stop's
        wait is part of the training pause: its acks are polled faster."""
        poll_s = min(self.ack_poll_s, LIVE_ACK_POLL_S) if req.live else self.ack_poll_s
        deadline = time.monotonic() + req.grace_s
        pods_checked = time.monotonic()
        while not expected <= set(store.acked_ranks(req.generation)):
            if time.monotonic() >= deadline:
                return
            if time.monotonic() - pods_checked >= self.ack_poll_s:  # a pod that died acks never
                pods_checked = time.monotonic()
                pods, _ = self._list_pods(ns, selector)
                expected = {
                    r for p in pods.values() if p.status.phase not in ENDED for r in pod_ranks(p)
                } & expected
            activity.heartbeat()
            time.sleep(poll_s)

    @activity.defn(name=contract.WATCH_GENERATION)
    @config_errors
    def watch_generation(self, req: WatchRequest) -> WatchResult:
        """Return `failed` as soon as a pod fails, vanishes or loses its node, `completed` when
        every pod Succeeded after the done marker, else `progress` after `report_after_s`."""
        ns = self._ns(req.job)
        store = JobStore(req.checkpoint)

        def verdict(pods: Pods) -> WatchResult | None:
            codes = {int(p.metadata.labels[RANK]): _exit_code(p) for p in pods.values()}
            exited = {rank: code for rank, code in codes.items() if code is not None}
            if any((p.metadata.annotations or {}).get(CONTROL) for p in pods.values()):
                return None  # being stopped: stop_generation owns the outcome (live: below)
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
            parked = store.ack_steps(req.generation)
            if parked and not store.stopping(req.generation):
                # Live resize: a rank whose peer was lost parks holding its step; nobody
                # asked it to, so the generation has failed (its survivors keep their state).
                rank, step = min(parked.items())
                detail = f"rank {rank} lost a peer and parked holding step {step}"
                return WatchResult(outcome="failed", exit_codes=exited, detail=detail)
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
    @config_errors
    def cleanup_job(self, req: CleanupRequest) -> None:
        """Delete the job's pods (at once where their node is gone), Service and ConfigMaps;
        with `keep`, Failed pods stay."""
        ns = self._ns(req.job)
        selector = owner_selector(req.job)
        pods, _ = self._list_pods(ns, selector)
        doomed = {n: p for n, p in pods.items() if not (req.keep and p.status.phase == "Failed")}
        self._end_pods(ns, doomed, grace_s=None)
        for svc in self.core.list_namespaced_service(ns, label_selector=selector).items:
            absent(self.core.delete_namespaced_service, svc.metadata.name, ns)
        for cm in self.core.list_namespaced_config_map(ns, label_selector=selector).items:
            absent(self.core.delete_namespaced_config_map, cm.metadata.name, ns)
        # The SSH keys: deleted by name, never read back (no get, list or deletecollection:
        # a collection delete returns what it deletes).
        absent(self.core.delete_namespaced_secret, ssh_name(req.job), ns)

    @config_errors
    def release_job(self, job: str) -> list[str]:
        """`spotrain release`, for a job whose workflow cannot run its own cleanup: everything
        the job owns here goes, Failed pods too. The names of the pods it found."""
        pods, _ = self._list_pods(self._ns(job), owner_selector(job))
        self.cleanup_job(CleanupRequest(job=job, keep=False))
        return sorted(pods)

    def reap(
        self, is_job_running: Callable[[str], bool], apply: bool = False
    ) -> dict[str, list[str]]:
        """`spotrain gc`: jobs with pods or a Service in the (shared) namespace whose workflow
        no longer runs (a terminated workflow runs no cleanup): job -> pod names. Only with
        `apply` is each released; the default is a dry run. A namespace per job (`{job}`)
        cannot be listed by one Role: nothing is found there."""
        if "{job}" in self.namespace:
            return {}
        selector = f"{MANAGED}=true"
        services = self.core.list_namespaced_service(self.namespace, label_selector=selector)
        found: dict[str, list[str]] = {s.metadata.labels[JOB]: [] for s in services.items}
        for pod in self.core.list_namespaced_pod(self.namespace, label_selector=selector).items:
            found.setdefault(pod.metadata.labels[JOB], []).append(pod.metadata.name)
        orphans = {
            job: sorted(pods) for job, pods in sorted(found.items()) if not is_job_running(job)
        }
        if apply:
            for job in orphans:
                self.release_job(job)
        return orphans

    # --- objects ---------------------------------------------------------------------------

    def _adopt(self, ns: str, plan: GenerationPlan, store: JobStore) -> dict[int, str]:
        """Live resize: place the previous generation's parked pods (kube_live.py), relabel
        the adopted into this generation and delete the leaving (told to leave first, so
        their ranks exit 0). Member index -> adopted pod."""
        previous = plan.generation - 1
        adoption = kube_live.Adoption.recorded(store.next_generation(previous), plan.generation)
        pods, _ = self._list_pods(ns, owner_selector(plan.job))
        if adoption is None:  # (else a retry: the first attempt's placement stands)
            parked = kube_live.parked_pods(
                [p for p in pods.values() if p.metadata.labels[GENERATION] == str(previous)],
                set(store.acked_ranks(previous)),
            )
            port = kube_live.rendezvous_port(self.master_port, plan)
            adoption = kube_live.place(plan, parked, ns, port)
            store.write_next(previous, adoption.record(plan.generation))
        for index, name in adoption.adopted.items():
            if name not in pods:
                raise ApplicationError(f"parked pod {name} vanished", type=GANG_ERROR)
            first = sum(m.procs for m in plan.members[:index])
            labels = {GENERATION: str(plan.generation), RANK: str(first)}
            patch = {
                "metadata": {"labels": labels, "annotations": {MEMBERS: str(len(plan.members))}}
            }
            self.core.patch_namespaced_pod(name, ns, patch, _content_type=MERGE_PATCH)
        leaving = {n: pods[n] for n in adoption.leaving if n in pods}
        self._end_pods(ns, leaving, grace_s=math.ceil(plan.graceful_shutdown_s or 30))
        return adoption.adopted

    def _make_pods(
        self, ns: str, plan: GenerationPlan, adopted: dict[int, str], deadline: float
    ) -> set[str]:
        """Create the pods of the members no adopted pod serves; one found under the same
        name stays only if it was made the same (a head start), else it is replaced."""
        hosts = self._node_hostnames(
            [m.node_id for i, m in enumerate(plan.members) if i not in adopted], deadline
        )
        port = kube_live.rendezvous_port(self.master_port, plan)
        live = plan.resize == "live"
        bodies = {}
        for index, member in enumerate(plan.members):
            if index in adopted:
                continue
            body = pod_body(
                plan,
                index,
                hosts[member.node_id],
                ns,
                port,
                self.tolerations,
                master_pod=kube_live.master_pod(plan, adopted),
                state_from=("peers" if adopted else "checkpoint") if live else None,
            )
            bodies[body["metadata"]["name"]] = body
        selector = owner_selector(plan.job, plan.generation)
        found, _ = self._list_pods(ns, selector)
        stale = {
            n
            for n, p in found.items()
            if n not in adopted.values()
            and (n not in bodies or p.metadata.annotations.get(SPEC) != _spec(bodies[n]))
        }
        if stale:
            activity.logger.info("replacing pods made differently: %s", sorted(stale))
            self._delete_pods(ns, stale, grace_s=0)
            self._wait_pods(ns, selector, lambda pods: not (stale & pods.keys()) or None, deadline)
        for body in bodies.values():
            self._create(self.core.create_namespaced_pod, ns, body)
        return set(bodies)

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


def _spec(body: dict[str, Any]) -> str:
    return str(body["metadata"]["annotations"][SPEC])


def _steps(store: JobStore, req: WatchRequest) -> dict[str, Any]:
    progress = store.progress(req.generation)
    latest = store.latest_checkpoint()
    return {
        "step": progress["step"] if progress else None,
        "checkpoint_step": latest["step"] if latest else None,
        "checkpoints": store.checkpoint_stats(),
        "ranks": store.rank_steps(req.generation, time.time()),
    }
