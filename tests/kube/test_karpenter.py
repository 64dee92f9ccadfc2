"""The Karpenter node provider against a real Karpenter controller (tests/kube/karpenter.py)
on the real apiserver, as the worker's ServiceAccount with infra/k8s/karpenter/rbac.yaml: a
launch is a NodeClaim that Karpenter launches, registers and initializes; a retried launch
makes no second claim; spot that Karpenter cannot launch is a capacity error; consolidation
leaves a training node alone; release leaves nothing behind; a spec without zones is offered in
the NodePool's zones, else the Ready nodes'.

Stood in for: the kubelet and the node lifecycle controller (tests/kube/karpenter.py's
KarpenterNodes posts each new node Ready and lifts its not-ready taint)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment

from spotrain.activities.karpenter import (
    KarpenterProvider,
    claim_body,
    claim_name,
    node_class_ref,
)
from spotrain.workflows.contract import (
    CAPACITY_ERROR,
    DescribeRequest,
    LaunchRequest,
    ReleaseRequest,
)
from spotrain.workflows.spec import SpotPolicy
from tests.kube.k8s_cluster import ROOT, ControlPlane
from tests.kube.karpenter import (
    NODE_CLASS,
    NODEPOOL,
    ZONES,
    Karpenter,
    KarpenterNodes,
    provider,
)
from tests.kube.kube_support import spotrain, wait_until
from tests.kube.kubectl import Kubectl, kubectl_binary


def launch(job: str, slot: int = 0, **kw: object) -> LaunchRequest:
    fields: dict[str, object] = dict(
        job=job, slot=slot, attempt=0, generation=1, lifecycle="spot", instance_type="g5.xlarge"
    )
    return LaunchRequest.model_validate(fields | kw)


def test_a_launch_is_a_nodeclaim_that_karpenter_makes_ready_once(
    cluster: ControlPlane, karpenter: Karpenter, nodes: KarpenterNodes
) -> None:
    p, env = provider(cluster), ActivityEnvironment()
    req = launch("train-a", zone="us-east-1b", gpus=1)
    info = env.run(p.launch_node, req)
    assert (info.node_id, info.state) == (claim_name("train-a", 0, 0), "ready")
    assert (info.lifecycle, info.instance_type, info.zone, info.slot) == (
        "spot",
        "g5.xlarge",
        "us-east-1b",
        0,
    )
    claim = karpenter.claims()[info.node_id]
    labels = claim["metadata"]["labels"]
    assert labels["spotrain.io/job"] == "train-a" and labels["spotrain.io/slot"] == "0"
    assert labels["karpenter.sh/nodepool"] == NODEPOOL
    assert claim["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
    assert claim["spec"]["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert claim["spec"]["expireAfter"] == "Never"
    # Karpenter registered the node with the claim's labels: the runtime finds it by them
    node = client.CoreV1Api(cluster.admin).read_node(claim["status"]["nodeName"])
    assert node.metadata.labels["spotrain.io/node"] == info.node_id
    assert node.metadata.labels["karpenter.sh/capacity-type"] == "spot"
    assert node.metadata.labels["topology.kubernetes.io/zone"] == "us-east-1b"

    # What the EKS guide shows: `kubectl get nodeclaims -l spotrain.io/job=<job>`
    kubectl = Kubectl(kubectl_binary(cluster), cluster.admin_kubeconfig)
    listed = kubectl.json("get", "nodeclaims", "-l", "spotrain.io/job=train-a")["items"]
    assert [c["metadata"]["name"] for c in listed] == [info.node_id]

    # The worker killed between the create and the read: the retry finds the same claim.
    assert env.run(p.launch_node, req) == info
    assert list(karpenter.claims()) == [info.node_id]
    asked = DescribeRequest(job="train-a", node_ids=[info.node_id, "spotrain-train-a-s9-a0"])
    ready, unknown = env.run(p.describe_nodes, asked)
    assert ready.state == "ready" and (unknown.state, unknown.reason) == ("gone", "not-found")

    released = env.run(p.release_nodes, ReleaseRequest(job="train-a", node_ids=[info.node_id]))
    assert released == [info.node_id]
    wait_until(lambda: not karpenter.claims(), 30)  # Karpenter drained and terminated it
    assert env.run(p.describe_nodes, asked)[0].state == "gone"
    assert env.run(p.release_nodes, ReleaseRequest(job="train-a", node_ids=[info.node_id])) == []


def test_another_jobs_claims_are_neither_described_nor_released(
    cluster: ControlPlane, karpenter: Karpenter, nodes: KarpenterNodes
) -> None:
    p, env = provider(cluster), ActivityEnvironment()
    mine = env.run(p.launch_node, launch("train-b", lifecycle="on-demand"))
    assert mine.lifecycle == "on-demand"
    assert env.run(p.release_nodes, ReleaseRequest(job="train-c", node_ids=[mine.node_id])) == []
    assert env.run(p.describe_nodes, DescribeRequest(job="train-c", node_ids=[])) == []
    assert [
        n.node_id for n in env.run(p.describe_nodes, DescribeRequest(job="train-b", node_ids=[]))
    ] == [mine.node_id]
    assert mine.node_id in karpenter.claims()


def test_spot_karpenter_cannot_launch_is_a_capacity_error(
    cluster: ControlPlane, karpenter: Karpenter, nodes: KarpenterNodes
) -> None:
    """No spot offering left: the claim never launches, so after the launch timeout it is
    deleted and the pool reported out of capacity; on-demand still launches."""
    p, env = provider(cluster, launch_timeout_s=3), ActivityEnvironment()
    karpenter.offer_spot(False)
    try:
        with pytest.raises(ApplicationError) as caught:
            env.run(p.launch_node, launch("train-d"))
        assert caught.value.type == CAPACITY_ERROR and caught.value.non_retryable
        assert "not ready after 3s" in str(caught.value)
        wait_until(lambda: not karpenter.claims(), 30)
        fallback = env.run(p.launch_node, launch("train-d", attempt=1, lifecycle="on-demand"))
        assert fallback.lifecycle == "on-demand" and fallback.state == "ready"
    finally:
        karpenter.offer_spot(True)
    spot = env.run(p.launch_node, launch("train-d", slot=1))
    assert spot.lifecycle == "spot" and spot.state == "ready"


def test_consolidation_leaves_a_training_node_alone(
    cluster: ControlPlane, karpenter: Karpenter, nodes: KarpenterNodes
) -> None:
    """An empty node in an eagerly consolidating NodePool: Karpenter takes the one that is
    not spotrain's at once, and leaves spotrain's (do-not-disrupt) alone."""
    p, env = provider(cluster), ActivityEnvironment()
    ours = env.run(p.launch_node, launch("train-e", lifecycle="on-demand"))
    other = launch("someone-else", lifecycle="on-demand")
    body = claim_body_without_protection(other)
    karpenter.custom.create_cluster_custom_object("karpenter.sh", "v1", "nodeclaims", body)
    name = body["metadata"]["name"]
    wait_until(lambda: name not in karpenter.claims(""), 90)  # consolidated: Karpenter works
    claim = karpenter.claims()[ours.node_id]
    assert not claim["metadata"].get("deletionTimestamp")
    conditions = {c["type"]: c["status"] for c in claim["status"]["conditions"]}
    assert conditions.get("DisruptionReason") != "True"
    assert (
        env.run(p.describe_nodes, DescribeRequest(job="train-e", node_ids=[ours.node_id]))[0].state
        == "ready"
    )


def test_a_spec_without_zones_is_offered_in_the_nodepools_zones_else_the_nodes(
    cluster: ControlPlane, karpenter: Karpenter, nodes: KarpenterNodes
) -> None:
    """As the worker's ServiceAccount: the NodePool's zone requirement (the test pool allows
    two zones); no NodePool (or one that does not exist): the zones of Ready nodes; no node
    either: one zone-less offer per type. A spec that names zones reads nothing."""
    env = ActivityEnvironment()
    types = [{"name": "g5.xlarge", "gpus": 1, "on_demand_price": 1.01, "spot_price": 0.40}]
    anywhere = SpotPolicy.model_validate({"instance_types": types})
    named = SpotPolicy.model_validate({"instance_types": types, "zones": ["us-east-1c"]})
    worker = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
    pooled = provider(cluster)
    assert [o.zone for o in env.run(pooled.find_offers, anywhere)] == list(ZONES)
    assert [o.zone for o in env.run(pooled.find_offers, named)] == ["us-east-1c"]
    for pool in (None, "no-such-pool"):
        bare = KarpenterProvider(worker, node_class=NODE_CLASS, nodepool=pool)
        assert [o.zone for o in env.run(bare.find_offers, anywhere)] == [""]  # no node yet
    env.run(pooled.launch_node, launch("train-z", zone="us-east-1b", lifecycle="on-demand"))
    for pool in (None, "no-such-pool"):
        bare = KarpenterProvider(worker, node_class=NODE_CLASS, nodepool=pool)
        assert [o.zone for o in env.run(bare.find_offers, anywhere)] == ["us-east-1b"]


def claim_body_without_protection(req: LaunchRequest) -> dict[str, Any]:
    """A claim as anyone else's in the pool: no do-not-disrupt, not spotrain's."""
    body = claim_body(req, node_class_ref(NODE_CLASS), NODEPOOL)
    body["metadata"]["annotations"] = {}
    body["metadata"]["labels"] = {"karpenter.sh/nodepool": NODEPOOL}
    return body


def test_the_example_nodepools_are_valid_nodepools(
    cluster: ControlPlane, karpenter: Karpenter
) -> None:
    """infra/k8s/karpenter/nodepools.yaml's NodePools pass the real NodePool CRD's schema and
    rules (a server-side dry run; its EC2NodeClass needs AWS's CRD, not served here)."""
    docs = list(yaml.safe_load_all((ROOT / "infra/k8s/karpenter/nodepools.yaml").read_text()))
    pools = [d for d in docs if d["kind"] == "NodePool"]
    assert len(pools) == 2 and {d["kind"] for d in docs} == {"NodePool", "EC2NodeClass"}
    kubectl = Kubectl(kubectl_binary(cluster), cluster.admin_kubeconfig)
    done = kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(pools))
    assert done.stdout.count("(server dry run)") == 2, done.stdout
    broken = [dict(pools[0], spec=dict(pools[0]["spec"], disruption={"consolidateAfter": "soon"}))]
    refused = kubectl(
        "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump_all(broken), check=False
    )
    assert refused.returncode != 0 and "consolidateAfter" in refused.stderr


async def test_gc_and_release_find_a_jobs_nodeclaims_by_label(
    cluster: ControlPlane,
    karpenter: Karpenter,
    nodes: KarpenterNodes,
    dev_env: WorkflowEnvironment,
    moto_endpoint: str,
    tmp_path: Path,
) -> None:
    """`spotrain gc --runtime kubernetes` (a real CLI process, as the worker's ServiceAccount):
    the claims of a job Temporal does not know are orphans, a running job's are not;
    `release` deletes the named job's claims and no other's."""
    p, env = provider(cluster), ActivityEnvironment()
    for job in ("gone-job", "live-job", "stuck-job"):
        await asyncio.to_thread(env.run, p.launch_node, launch(job, lifecycle="on-demand"))
    live = await dev_env.client.start_workflow("TrainingJob", id="live-job", task_queue="nobody")
    cli = os.environ | {
        "TEMPORAL_ADDRESS": dev_env.client.service_client.config.target_host,
        "SPOTRAIN_EC2_ENDPOINT": moto_endpoint,
        "KUBECONFIG": str(cluster.service_account_kubeconfig("spotrain-worker")),
    }
    try:
        argv = ["gc", "--runtime", "kubernetes", "--state-dir", str(tmp_path), "--json"]
        dry = await asyncio.to_thread(spotrain, *argv, env=cli)
        assert dry.returncode == 0, dry
        orphans = json.loads(dry.stdout)["nodeclaims"]
        assert orphans == {j: [claim_name(j, 0, 0)] for j in ("gone-job", "stuck-job")}
        assert len(karpenter.claims()) == 3  # a dry run
        released = await asyncio.to_thread(spotrain, "release", "stuck-job", *argv[1:], env=cli)
        assert released.returncode == 0, released
        assert json.loads(released.stdout)["nodeclaims"] == [claim_name("stuck-job", 0, 0)]
        applied = await asyncio.to_thread(spotrain, *argv, "--apply", env=cli)
        assert applied.returncode == 0, applied
        wait_until(lambda: list(karpenter.claims()) == [claim_name("live-job", 0, 0)], 30)
    finally:
        await live.terminate()
