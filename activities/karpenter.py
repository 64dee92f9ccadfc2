"""The Karpenter node provider: a job's node is a NodeClaim that spotrain creates, and Karpenter
launches, registers, interrupts and cleans up.

A NodeClaim maps one to one onto what a node provider does: launch one node with given
requirements (the claim's capacity type, instance type, zone and GPUs), read its state,
release it (delete the claim; Karpenter drains and terminates the node). The worker needs RBAC
on NodeClaims (infra/k8s/karpenter/rbac.yaml) instead of EC2 rights and a launch template.

Idempotency: (job, slot, attempt) names one claim (`claim_name`), so a launch retried after a
crash at any line finds the claim it made instead of making a second.

Ownership: every claim carries spotrain.io/managed, spotrain.io/job, spotrain.io/slot,
spotrain.io/attempt, spotrain.io/generation and spotrain.io/node (its own name), which
Karpenter copies onto the Node it registers: the Kubernetes runtime finds a member's node by
that label, and `spotrain gc` finds leftovers by the job label.

Disruption: the claim says `karpenter.sh/do-not-disrupt` and never expires, so Karpenter's
voluntary disruption (consolidation, drift, expiry) leaves it alone; one that comes anyway,
or an interruption, is a reclaim notice (workers/karpenter_notices.py).

Errors: a claim that Karpenter deletes before its node is ready (insufficient capacity), one
whose launch fails, or one not ready within the launch timeout (then deleted) is a
non-retryable CAPACITY_ERROR: the workflow tries the next pool, then on-demand. Forbidden and
invalid requests are CONFIG_ERROR; other API errors are retried.

Prices: Karpenter exposes none to its clients, so offers carry the spec's prices (an instance
type's spot_price, else the job's cap).

Zones: a spec with no `spot.zones` is offered in the zones the NodePool allows (its
requirement on topology.kubernetes.io/zone), else in those of the cluster's Ready nodes, so the
job's home-zone rule pins every claim, its first ones too, into one zone. Only with neither
does an offer name no zone and Karpenter choose (issue 49).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from temporalio import activity
from temporalio.exceptions import ApplicationError

from spotrain.activities.kube_api import absent, default_api_client
from spotrain.activities.kube_objects import DO_NOT_DISRUPT, JOB, MANAGED, NODE_LABEL
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    DescribeRequest,
    LaunchRequest,
    Lifecycle,
    NodeInfo,
    Offer,
    ReleaseRequest,
)
from spotrain.workflows.spec import SpotPolicy

GROUP, VERSION, PLURAL = "karpenter.sh", "v1", "nodeclaims"
SLOT = "spotrain.io/slot"
ATTEMPT = "spotrain.io/attempt"
GENERATION = "spotrain.io/generation"
CAPACITY_TYPE = "karpenter.sh/capacity-type"
NODEPOOL = "karpenter.sh/nodepool"
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
ZONE = "topology.kubernetes.io/zone"
GPU = "nvidia.com/gpu"
DEFAULT_NODE_CLASS = "karpenter.k8s.aws/EC2NodeClass/default"
TRAINING_TAINT = {"key": "spotrain.io/lifecycle", "value": "training", "effect": "NoSchedule"}
POLL_S = 0.1
NodeState = Literal["requested", "ready", "gone"]
NAME_MAX = 63  # the claim's name is also its node's spotrain.io/node label value
NODEPOOLS = "nodepools"
log = logging.getLogger(__name__)


def claim_name(job: str, slot: int, attempt: int) -> str:
    """`spotrain-<job>-s<slot>-a<attempt>`, lower-cased and fitted to 63 characters (a hash of
    the whole keeps two long job names apart)."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"spotrain-{job}-s{slot}-a{attempt}".lower()).strip("-")
    if len(name) <= NAME_MAX:
        return name
    digest = hashlib.sha256(f"{job}/{slot}/{attempt}".encode()).hexdigest()[:10]
    tail = f"-{digest}-s{slot}-a{attempt}"
    return name[: NAME_MAX - len(tail)].rstrip("-") + tail


def node_class_ref(setting: str) -> dict[str, str]:
    """ "group/kind/name" -> a NodeClaim's nodeClassRef."""
    parts = setting.split("/")
    if len(parts) != 3 or not all(parts):
        raise ValueError(
            f"SPOTRAIN_KARPENTER_NODECLASS={setting!r}: expected group/kind/name, "
            f"e.g. {DEFAULT_NODE_CLASS}"
        )
    return dict(zip(("group", "kind", "name"), parts, strict=True))


def spec_offers(policy: SpotPolicy, zones: Iterable[str] = ()) -> list[Offer]:
    """Every (type, zone) spot pool the spec allows, cheapest per GPU first, each type in every
    zone before the next type (so k offers span k zones). No zones in the spec: `zones` (what
    the cluster allows, `offer_zones`), else one pool per type in any zone, Karpenter's pick.
    Whether one can serve now is learnt by launching: Karpenter answers no such query.
    Prices: the spec's spot price, else the cap."""
    if not policy.enabled:
        return []
    where = list(policy.zones or zones) or [""]
    offers = []
    for t in sorted(
        policy.instance_types, key=lambda t: (t.spot_price or t.on_demand_price) / max(t.gpus, 1)
    ):
        cap = policy.max_price or t.on_demand_price
        price = t.spot_price or cap
        if price <= cap:
            offers += [Offer(instance_type=t.name, zone=z, price=price) for z in where]
    return offers


def offer_zones(nodepool: Mapping[str, Any] | None, nodes: Iterable[client.V1Node]) -> list[str]:
    """The zones a spec without `spot.zones` is offered in, sorted: those the NodePool's
    template requires (`topology.kubernetes.io/zone` In), else those of the Ready nodes that
    carry the label, less any the NodePool excludes (NotIn); [] when neither names one.
    Karpenter may launch only where its pool allows, and a cluster's nodes show where its
    subnets are: an offer per zone lets the job's home-zone rule pick one for every claim."""
    template = (nodepool or {}).get("spec", {}).get("template", {}).get("spec", {})
    rules = [r for r in template.get("requirements") or [] if r.get("key") == ZONE]
    allowed = {v for r in rules if r.get("operator") == "In" for v in r.get("values") or []}
    if allowed:
        return sorted(allowed)
    excluded = {v for r in rules if r.get("operator") == "NotIn" for v in r.get("values") or []}
    seen = set()
    for node in nodes:
        zone = (node.metadata.labels or {}).get(ZONE)
        conditions = (node.status and node.status.conditions) or []
        if zone and any(c.type == "Ready" and c.status == "True" for c in conditions):
            seen.add(zone)
    return sorted(seen - excluded)


def claim_body(
    req: LaunchRequest, node_class: Mapping[str, str], nodepool: str | None
) -> dict[str, Any]:
    """The NodeClaim for one slot: what the spec asks for as Karpenter requirements."""
    name = claim_name(req.job, req.slot, req.attempt)
    labels = {
        MANAGED: "true",
        JOB: req.job,
        SLOT: str(req.slot),
        ATTEMPT: str(req.attempt),
        GENERATION: str(req.generation),
        NODE_LABEL: name,
    }
    if nodepool:  # Karpenter counts it against the pool's limits and applies its disruption
        labels[NODEPOOL] = nodepool
    requirements = [
        {"key": CAPACITY_TYPE, "operator": "In", "values": [req.lifecycle]},
        {"key": INSTANCE_TYPE, "operator": "In", "values": [req.instance_type]},
    ]
    if req.zone:
        requirements.append({"key": ZONE, "operator": "In", "values": [req.zone]})
    spec: dict[str, Any] = {
        "nodeClassRef": dict(node_class),
        "requirements": requirements,
        "taints": [TRAINING_TAINT],  # other workloads stay off (the ranks tolerate it)
        "expireAfter": "Never",  # (the default is 720h: Karpenter would retire it mid-job)
    }
    if req.gpus:
        spec["resources"] = {"requests": {GPU: str(req.gpus)}}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "NodeClaim",
        "metadata": {"name": name, "labels": labels, "annotations": {DO_NOT_DISRUPT: "true"}},
        "spec": spec,
    }


def condition(claim: Mapping[str, Any], kind: str) -> dict[str, Any]:
    """A status condition of the claim ({} when Karpenter has not set it yet)."""
    for c in claim.get("status", {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def node_info(claim: Mapping[str, Any], state: NodeState, reason: str | None = None) -> NodeInfo:
    """The node as the workflow books it: what Karpenter launched, else what was asked."""
    meta = claim["metadata"]
    labels = meta.get("labels") or {}
    want = {r["key"]: r.get("values", []) for r in claim.get("spec", {}).get("requirements", [])}

    def resolved(key: str) -> str:  # Karpenter labels the claim with what it launched
        return labels.get(key) or next(iter(want.get(key) or []), "unknown")

    lifecycle: Lifecycle = "spot" if resolved(CAPACITY_TYPE) == "spot" else "on-demand"
    return NodeInfo(
        node_id=meta["name"],
        slot=int(labels.get(SLOT, -1)),
        lifecycle=lifecycle,
        instance_type=resolved(INSTANCE_TYPE),
        zone=resolved(ZONE),
        state=state,
        reason=reason,
        address=claim.get("status", {}).get("nodeName") or meta["name"],
    )


def claim_state(claim: Mapping[str, Any]) -> tuple[NodeState, str | None]:
    """ready, requested or gone (with why) as a node provider reports it. A claim being deleted
    still trains until its node goes: its notice (workers/karpenter_notices.py) drives the
    checkpoint, not this."""
    launched = condition(claim, "Launched")
    if launched.get("status") == "False":
        return "gone", f"launch failed: {launched.get('message') or launched.get('reason')}"
    if condition(claim, "Ready").get("status") == "True" and claim.get("status", {}).get(
        "nodeName"
    ):
        return "ready", None
    if claim["metadata"].get("deletionTimestamp"):
        return "gone", "deleted before it was ready"
    return "requested", None


@contextmanager
def _typed_errors() -> Iterator[None]:
    """Requests a retry cannot fix are CONFIG_ERROR: forbidden (RBAC), invalid, or no NodeClaim
    API at all (a 404 from a create or a list: Karpenter is not installed); the rest retry."""
    try:
        yield
    except ApiException as err:
        if err.status in (401, 403, 404, 422):
            hint = " (no NodeClaim API: is Karpenter installed?)" if err.status == 404 else ""
            raise ApplicationError(
                f"Kubernetes refused the NodeClaim request ({err.status} {err.reason}){hint}: "
                f"{(err.body or '')[:500]}",
                type=contract.CONFIG_ERROR,
                non_retryable=True,
            ) from err
        raise


class KarpenterProvider:
    """The node provider activities over Karpenter's NodeClaims.

    `node_class`: the nodeClassRef of every claim ("group/kind/name"). `nodepool`: the
    NodePool the claims belong to (label karpenter.sh/nodepool), None for none.
    `launch_timeout_s`: a claim not ready by then is deleted and its pool reported out of
    capacity. `api_client` None: in-cluster service account, else the kubeconfig.
    """

    def __init__(
        self,
        api_client: client.ApiClient | None = None,
        *,
        node_class: str = DEFAULT_NODE_CLASS,
        nodepool: str | None = None,
        launch_timeout_s: float = 600.0,
    ) -> None:
        api_client = api_client or default_api_client()
        self.api_client = api_client
        self.api = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.node_class = node_class_ref(node_class)
        self.nodepool = nodepool
        self.launch_timeout_s = launch_timeout_s
        self._said_zoneless = False  # the zone-less fallback is logged once per worker

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> KarpenterProvider:
        """The worker's settings: SPOTRAIN_KARPENTER_NODECLASS (group/kind/name),
        SPOTRAIN_KARPENTER_NODEPOOL, SPOTRAIN_KARPENTER_LAUNCH_TIMEOUT_S."""
        return cls(
            node_class=env.get("SPOTRAIN_KARPENTER_NODECLASS") or DEFAULT_NODE_CLASS,
            nodepool=env.get("SPOTRAIN_KARPENTER_NODEPOOL") or None,
            launch_timeout_s=float(env.get("SPOTRAIN_KARPENTER_LAUNCH_TIMEOUT_S") or 600),
        )

    def activities(self) -> list[Callable[..., Any]]:
        return [self.find_offers, self.launch_node, self.describe_nodes, self.release_nodes]

    # --- offers ------------------------------------------------------------------------------

    @activity.defn(name=contract.FIND_OFFERS)
    def find_offers(self, policy: SpotPolicy) -> list[Offer]:
        """The spec's pools; with no `spot.zones`, one per zone the cluster allows
        (`offer_zones`), read-only: the NodePool (get) and, only when it restricts no zone,
        the nodes (list)."""
        if not policy.enabled or policy.zones:
            return spec_offers(policy)
        with _typed_errors():
            pool = self._nodepool()
            zones = offer_zones(pool, [])
            if not zones:
                zones = offer_zones(pool, self.core.list_node().items)
        if not zones and not self._said_zoneless:
            self._said_zoneless = True
            log.warning(
                "no zone to offer in (NodePool %s restricts none, no Ready node has %s): "
                "offers name no zone and Karpenter picks, so a job's first NodeClaims may "
                "span zones; list spot.zones to pin them",
                self.nodepool or "(none)",
                ZONE,
            )
        return spec_offers(policy, zones)

    def _nodepool(self) -> dict[str, Any] | None:
        """The provider's NodePool, None when none is configured or it does not exist."""
        if not self.nodepool:
            return None
        try:
            return dict(
                self.api.get_cluster_custom_object(GROUP, VERSION, NODEPOOLS, self.nodepool)
            )
        except ApiException as err:
            if err.status == 404:
                log.warning("NodePool %s not found: offering the nodes' zones", self.nodepool)
                return None
            raise

    # --- launch ------------------------------------------------------------------------------

    @activity.defn(name=contract.LAUNCH_NODE)
    def launch_node(self, req: LaunchRequest) -> NodeInfo:
        """The slot's node once Karpenter has registered and initialized it (the claim made at
        most once); CAPACITY_ERROR when Karpenter cannot launch it."""
        body = claim_body(req, self.node_class, self.nodepool)
        name = body["metadata"]["name"]
        with _typed_errors():
            try:
                self.api.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)
            except ApiException as err:
                if err.status != 409:  # AlreadyExists: an earlier attempt made it
                    raise
            return self._wait_ready(name)

    def _wait_ready(self, name: str) -> NodeInfo:
        deadline = time.monotonic() + self.launch_timeout_s
        while True:
            activity.heartbeat(name)
            claim = self._read(name)
            if claim is None:
                raise ApplicationError(
                    f"Karpenter deleted NodeClaim {name} before its node was ready "
                    "(insufficient capacity: see `kubectl get events`)",
                    type=contract.CAPACITY_ERROR,
                    non_retryable=True,
                )
            state, reason = claim_state(claim)
            if state == "ready":
                return node_info(claim, "ready")
            if state == "gone":
                absent(self.api.delete_cluster_custom_object, GROUP, VERSION, PLURAL, name)
                raise ApplicationError(
                    f"NodeClaim {name}: {reason}",
                    type=contract.CAPACITY_ERROR,
                    non_retryable=True,
                )
            if time.monotonic() > deadline:
                absent(self.api.delete_cluster_custom_object, GROUP, VERSION, PLURAL, name)
                launched = condition(claim, "Launched")
                raise ApplicationError(
                    f"NodeClaim {name} not ready after {self.launch_timeout_s:g}s (Launched: "
                    f"{launched.get('reason') or 'not yet'}): deleted",
                    type=contract.CAPACITY_ERROR,
                    non_retryable=True,
                )
            time.sleep(POLL_S)

    def _read(self, name: str) -> dict[str, Any] | None:
        try:
            return dict(self.api.get_cluster_custom_object(GROUP, VERSION, PLURAL, name))
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    # --- track and release -------------------------------------------------------------------

    def job_claims(self, job: str) -> list[dict[str, Any]]:
        """Every NodeClaim labelled with the job (the CLI's `gc` and `release` use it too)."""
        listing = self.api.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, label_selector=f"{MANAGED}=true,{JOB}={job}"
        )
        return list(listing.get("items", []))

    def reap(
        self, is_job_running: Callable[[str], bool], apply: bool = False
    ) -> dict[str, list[str]]:
        """`spotrain gc`: the NodeClaims of jobs whose workflow no longer runs, job -> claims;
        deleted only with `apply`. No NodeClaim CRD (no Karpenter): none."""
        try:
            listing = self.api.list_cluster_custom_object(
                GROUP, VERSION, PLURAL, label_selector=f"{MANAGED}=true"
            )
        except ApiException as err:
            if err.status == 404:
                return {}
            raise
        found: dict[str, list[str]] = {}
        for claim in listing.get("items", []):
            labels = claim["metadata"].get("labels") or {}
            found.setdefault(labels.get(JOB, ""), []).append(claim["metadata"]["name"])
        orphans = {job: sorted(c) for job, c in sorted(found.items()) if not is_job_running(job)}
        if apply:
            for names in orphans.values():
                for name in names:
                    absent(self.api.delete_cluster_custom_object, GROUP, VERSION, PLURAL, name)
        return orphans

    @activity.defn(name=contract.DESCRIBE_NODES)
    def describe_nodes(self, req: DescribeRequest) -> list[NodeInfo]:
        """One NodeInfo per asked id, in order: gone when the claim is gone or its node left
        the cluster. Empty `node_ids`: every claim of the job (what a failed launch left)."""
        with _typed_errors():
            found: dict[str, NodeInfo] = {}
            nodes = {n.metadata.name for n in self.core.list_node().items}
            for claim in self.job_claims(req.job):
                state, reason = claim_state(claim)
                node = claim.get("status", {}).get("nodeName")
                if state == "ready" and node not in nodes:
                    state, reason = "gone", f"node {node} left the cluster"
                found[claim["metadata"]["name"]] = node_info(claim, state, reason)
        return req.answer(found)

    @activity.defn(name=contract.RELEASE_NODES)
    def release_nodes(self, req: ReleaseRequest) -> list[str]:
        """Delete the job's claims among `node_ids` (Karpenter drains and terminates their
        nodes); only claims labelled with the job are touched. Returns the asked ids that
        belong to the job, idempotently."""
        with _typed_errors():
            owned = [c["metadata"]["name"] for c in self.job_claims(req.job)]
            asked = [name for name in owned if req.asks_for(name)]
            for name in asked:
                absent(self.api.delete_cluster_custom_object, GROUP, VERSION, PLURAL, name)
        return sorted(asked)
