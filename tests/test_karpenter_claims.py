"""The Karpenter provider's pure parts: a slot's NodeClaim (its name, requirements and
ownership), how a claim's status reads as a node's state, which watch events of a claim are
notices, the offers from a spec and the zones they are offered in when the spec names none. The
calls themselves run against a real Karpenter in
tests/kube/test_karpenter.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
from kubernetes import client

from spotrain.activities.karpenter import (
    claim_body,
    claim_name,
    claim_state,
    node_class_ref,
    offer_zones,
    spec_offers,
)
from spotrain.workers.karpenter_notices import TERMINATION_AT, notice_for
from spotrain.workers.worker import main as worker_main
from spotrain.workflows.contract import LaunchRequest, NodeLost, ReclaimNotice
from spotrain.workflows.spec import SpotPolicy

REF = node_class_ref("karpenter.k8s.aws/EC2NodeClass/gpu")


def request(**kw: Any) -> LaunchRequest:
    fields: dict[str, Any] = dict(
        job="Train_1", slot=3, attempt=1, generation=7, lifecycle="spot", instance_type="g5.xlarge"
    )
    return LaunchRequest.model_validate(fields | kw)


def claim(**meta: Any) -> dict[str, Any]:
    status = meta.pop("status", {})
    base = {"name": "spotrain-j-s0-a0", "labels": {"spotrain.io/job": "j"}}
    return {"metadata": base | meta, "status": status}


def test_a_slot_names_one_dns_safe_claim() -> None:
    assert claim_name("Train_1", 3, 1) == "spotrain-train-1-s3-a1"
    assert claim_name("Train_1", 3, 1) == claim_name("Train_1", 3, 1)
    long_a, long_b = claim_name("x" * 80 + "a", 0, 0), claim_name("x" * 80 + "b", 0, 0)
    assert long_a != long_b and len(long_a) <= 63 and long_a.endswith("-s0-a0")
    assert all(re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?", n) for n in (long_a, long_b))


def test_a_claim_asks_for_what_the_spec_chose_and_says_whose_it_is() -> None:
    body = claim_body(request(zone="us-east-1b", gpus=4), REF, "training")
    labels = body["metadata"]["labels"]
    assert labels == {
        "spotrain.io/managed": "true",
        "spotrain.io/job": "Train_1",
        "spotrain.io/slot": "3",
        "spotrain.io/attempt": "1",
        "spotrain.io/generation": "7",
        "spotrain.io/node": "spotrain-train-1-s3-a1",
        "karpenter.sh/nodepool": "training",
    }
    assert body["metadata"]["annotations"] == {"karpenter.sh/do-not-disrupt": "true"}
    spec = body["spec"]
    assert {r["key"]: r["values"] for r in spec["requirements"]} == {
        "karpenter.sh/capacity-type": ["spot"],
        "node.kubernetes.io/instance-type": ["g5.xlarge"],
        "topology.kubernetes.io/zone": ["us-east-1b"],
    }
    assert spec["resources"] == {"requests": {"nvidia.com/gpu": "4"}}
    assert spec["nodeClassRef"] == {
        "group": "karpenter.k8s.aws",
        "kind": "EC2NodeClass",
        "name": "gpu",
    }
    assert spec["expireAfter"] == "Never"
    # on-demand in any zone, no GPUs, no NodePool: no zone requirement, requests or pool label
    plain = claim_body(request(lifecycle="on-demand"), REF, None)
    assert [r["key"] for r in plain["spec"]["requirements"]] == [
        "karpenter.sh/capacity-type",
        "node.kubernetes.io/instance-type",
    ]
    assert (
        "resources" not in plain["spec"]
        and "karpenter.sh/nodepool" not in plain["metadata"]["labels"]
    )


@pytest.mark.parametrize("bad", ["EC2NodeClass/gpu", "a/b/c/d", "a//c", ""])
def test_a_node_class_is_group_kind_name(bad: str) -> None:
    with pytest.raises(ValueError, match="group/kind/name"):
        node_class_ref(bad)


def ready(**meta: Any) -> dict[str, Any]:
    conditions = [{"type": "Launched", "status": "True"}, {"type": "Ready", "status": "True"}]
    return claim(status={"conditions": conditions, "nodeName": "ip-1"}, **meta)


def test_a_claims_status_is_a_node_state() -> None:
    assert claim_state(ready()) == ("ready", None)
    assert claim_state(ready(deletionTimestamp="2026-12-02T00:00:00Z")) == ("ready", None)
    assert claim_state(claim()) == ("requested", None)
    failed = claim(
        status={"conditions": [{"type": "Launched", "status": "False", "message": "ICE"}]}
    )
    assert claim_state(failed) == ("gone", "launch failed: ICE")
    deleting = claim(deletionTimestamp="2026-12-02T00:00:00Z")
    assert claim_state(deleting) == ("gone", "deleted before it was ready")


def test_karpenters_disruptions_are_notices_and_a_vanished_claim_a_loss() -> None:
    at = "2026-12-02T10:00:00Z"
    deleting = notice_for("MODIFIED", ready(deletionTimestamp=at, annotations={TERMINATION_AT: at}))
    assert deleting is not None
    job, signal, notice = deleting
    assert (job, signal) == ("j", "reclaim") and isinstance(notice, ReclaimNotice)
    assert (
        notice.node_id == "spotrain-j-s0-a0"
        and notice.deadline.isoformat() == "2026-12-02T10:00:00+00:00"
    )
    # Karpenter's voluntary disruption marks the claim first: the same event, no deadline
    marked = ready()
    marked["status"]["conditions"].append({"type": "DisruptionReason", "status": "True"})
    found = notice_for("MODIFIED", marked)
    assert found is not None and found[2].event_id == notice.event_id and found[2].deadline is None
    # gone without either: lost
    lost = notice_for("DELETED", ready())
    assert lost is not None and lost[1] == "node_lost" and isinstance(lost[2], NodeLost)
    assert notice_for("MODIFIED", ready()) is None and notice_for("ADDED", claim()) is None
    assert notice_for("DELETED", claim(labels={})) is None  # not a job's


def test_offers_are_the_specs_pools_at_its_prices() -> None:
    policy = SpotPolicy.model_validate(
        {
            "instance_types": [
                {"name": "p3.2xlarge", "gpus": 1, "on_demand_price": 3.06, "spot_price": 0.97},
                {"name": "g5.xlarge", "gpus": 1, "on_demand_price": 1.01, "spot_price": 0.40},
            ],
            "zones": ["us-east-1a", "us-east-1b"],
        }
    )
    assert [(o.instance_type, o.zone, o.price) for o in spec_offers(policy)] == [
        ("g5.xlarge", "us-east-1a", 0.40),
        ("g5.xlarge", "us-east-1b", 0.40),
        ("p3.2xlarge", "us-east-1a", 0.97),
        ("p3.2xlarge", "us-east-1b", 0.97),
    ]
    one = policy.instance_types[1].model_dump()
    anywhere = SpotPolicy.model_validate({"instance_types": [one]})
    assert [(o.zone, o.price) for o in spec_offers(anywhere)] == [("", 0.40)]
    capped = SpotPolicy.model_validate({"instance_types": [one], "max_price": 0.3})
    assert spec_offers(capped) == []  # the spec's spot price is over the cap
    assert spec_offers(policy.model_copy(update={"enabled": False})) == []
    # the cluster's zones stand in for the spec's only when the spec names none
    assert [o.zone for o in spec_offers(anywhere, ["us-east-1b", "us-east-1c"])] == [
        "us-east-1b",
        "us-east-1c",
    ]
    assert [o.zone for o in spec_offers(policy, ["us-east-1c"])] == [
        o.zone for o in spec_offers(policy)
    ]


def nodepool(*requirements: dict[str, Any]) -> dict[str, Any]:
    return {"spec": {"template": {"spec": {"requirements": list(requirements)}}}}


def node(zone: str | None, ready: str = "True") -> client.V1Node:
    labels = {"topology.kubernetes.io/zone": zone} if zone else {}
    return client.V1Node(
        metadata=client.V1ObjectMeta(name=f"n-{zone}", labels=labels),
        status=client.V1NodeStatus(conditions=[client.V1NodeCondition(type="Ready", status=ready)]),
    )


ZONE_IN = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["b-2", "a-1"]}
SPOT = {"key": "karpenter.sh/capacity-type", "operator": "In", "values": ["spot"]}


def test_a_spec_without_zones_is_offered_where_the_nodepool_else_the_nodes_allow() -> None:
    """The NodePool's zone requirement wins; a pool that restricts no zone (or none at all)
    falls back to the zones of Ready labelled nodes, less the pool's NotIn; else nothing
    (then the offers name no zone: Karpenter's pick)."""
    nodes = [node("c-3"), node("d-4"), node("e-5", ready="False"), node(None), node("c-3")]
    assert offer_zones(nodepool(SPOT, ZONE_IN), nodes) == ["a-1", "b-2"]
    assert offer_zones(nodepool(SPOT), nodes) == ["c-3", "d-4"]
    assert offer_zones(None, nodes) == ["c-3", "d-4"]
    assert offer_zones({}, nodes) == ["c-3", "d-4"]
    not_d = {"key": "topology.kubernetes.io/zone", "operator": "NotIn", "values": ["d-4"]}
    assert offer_zones(nodepool(not_d), nodes) == ["c-3"]
    assert offer_zones(nodepool(SPOT), []) == []
    assert offer_zones(None, [node("e-5", ready="False"), node(None)]) == []


def test_the_karpenter_provider_needs_the_kubernetes_runtime(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        worker_main(["--provider", "karpenter", "--runtime", "local"])
    assert exited.value.code == 2
    assert "use it with --runtime kubernetes" in capsys.readouterr().err
