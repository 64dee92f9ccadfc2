"""The EC2 provider's offers (spot pools ranked by price and placement score, across regions),
its configuration from the environment, and the IAM policy it ships, against moto's EC2 and
IAM servers on a loopback port."""

from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.responses import EC2Response
from temporalio.exceptions import ApplicationError

from spotrain.activities import ec2 as ec2_mod
from spotrain.activities import spot_scores
from spotrain.activities.ec2 import EC2Provider
from spotrain.activities.ec2_ownership import find_instances
from spotrain.workflows import contract
from spotrain.workflows.contract import DescribeRequest, ReleaseRequest
from tests.aws.ec2_support import ENV, launch, live, policy, spot

POLICY = Path(__file__).resolve().parents[2] / "infra" / "aws" / "iam-policy.json"


def test_find_offers_diversifies_and_respects_max_price(
    provider: EC2Provider, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger=spot_scores.__name__):
        offers = ENV.run(provider.find_offers, policy())
        ENV.run(provider.find_offers, policy())
    pools = {(o.instance_type, o.zone) for o in offers}
    assert len(pools) == len(offers) and {z for _, z in pools} == {
        "us-east-1a",
        "us-east-1b",
        "us-east-1c",
    }
    assert {o.zone for o in offers[:3]} == {"us-east-1a", "us-east-1b", "us-east-1c"}  # spread
    # Same spot price everywhere (moto): the 4-GPU type is cheaper per GPU, in every zone first.
    assert [o.instance_type for o in offers] == ["g4dn.12xlarge"] * 3 + ["g5.xlarge"] * 3
    assert all(o.price == 0.00001 and o.score is None for o in offers)  # moto: no scores
    # moto lacks the API: said once, quietly (no warning, no XML parser error)
    ours = [r for r in caplog.records if r.name == spot_scores.__name__]  # not moto's
    assert [(r.levelno, r.message) for r in ours] == [
        (logging.INFO, "this EC2 endpoint has no spot placement scores: offers rank by price")
    ]

    assert ENV.run(provider.find_offers, policy(max_price=0.000001)) == []
    assert {o.zone for o in ENV.run(provider.find_offers, policy(zones=["us-east-1d"]))} <= {
        "us-east-1d"
    }


def test_refused_placement_scores_warn_naming_the_permission(
    moto_endpoint: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(_response: Any) -> None:
        raise EC2ClientError("UnauthorizedOperation", "not authorized to GetSpotPlacementScores")

    monkeypatch.setattr(EC2Response, "get_spot_placement_scores", refused, raising=False)
    provider = EC2Provider(endpoint_url=moto_endpoint)
    with caplog.at_level(logging.INFO, logger=spot_scores.__name__):
        assert ENV.run(provider.find_offers, policy())  # still offers, by price
    [warning] = [r for r in caplog.records if r.name == spot_scores.__name__]
    assert warning.levelno == logging.WARNING
    assert "UnauthorizedOperation" in warning.message
    assert "grant ec2:GetSpotPlacementScores" in warning.message


def test_spot_disabled_means_no_offers(provider: EC2Provider) -> None:
    assert ENV.run(provider.find_offers, policy(enabled=False)) == []


def test_more_regions_offer_launch_track_and_release_across_regions(
    provider: EC2Provider, job: str
) -> None:
    """A job whose spot pools span two regions: offers come from both, a node lands in its
    zone's region, and describe/release find it there (the home region alone would not)."""
    two = policy(more_regions=["us-west-2"], zones=["us-east-1a", "us-west-2a"])
    assert {o.zone for o in ENV.run(provider.find_offers, two)} == {"us-east-1a", "us-west-2a"}

    where = {"region": "us-east-1", "more_regions": ["us-west-2"]}
    west = launch(provider, spot(job, zone="us-west-2a", **where))
    east = launch(provider, spot(job, slot=1, zone="us-east-1a", **where))
    assert (west.zone, east.zone) == ("us-west-2a", "us-east-1a")
    in_west = find_instances(
        provider.client("us-west-2"), [{"Name": "tag:spotrain:job", "Values": [job]}]
    )
    assert [i["InstanceId"] for i in in_west] == [west.node_id]
    assert live(provider, job) == [east.node_id]  # the home region holds only its own

    ids = [west.node_id, east.node_id]
    described = ENV.run(provider.describe_nodes, DescribeRequest(job=job, node_ids=ids, **where))
    assert [n.state for n in described] == ["ready", "ready"]
    home_only = ENV.run(provider.describe_nodes, DescribeRequest(job=job, node_ids=ids))
    assert [n.reason for n in home_only] == ["not-found", None]

    released = ENV.run(provider.release_nodes, ReleaseRequest(job=job, node_ids=ids, **where))
    assert sorted(released) == sorted(ids)
    west_state = provider.client("us-west-2").describe_instances(InstanceIds=[west.node_id])
    assert west_state["Reservations"][0]["Instances"][0]["State"]["Name"] in {
        "shutting-down",
        "terminated",
    }
    assert live(provider, job) == []


# --- configuration and IAM -------------------------------------------------------------------


def test_from_env() -> None:
    env = {
        "SPOTRAIN_EC2_ENDPOINT": "http://127.0.0.1:5000",
        "SPOTRAIN_AMI": "ami-12345678",
        "SPOTRAIN_SUBNETS": "us-east-1a=subnet-a, us-east-1b=subnet-b",
    }
    provider = EC2Provider.from_env(env)
    assert provider.launch_mode == "instances"
    assert EC2Provider.from_env({"SPOTRAIN_EC2_LAUNCH": "fleet"}).launch_mode == "fleet"
    with pytest.raises(ValueError, match="SPOTRAIN_EC2_LAUNCH"):
        EC2Provider.from_env({"SPOTRAIN_EC2_LAUNCH": "fleets"})
    assert (provider.endpoint_url, provider.amis, provider.launch_template) == (
        "http://127.0.0.1:5000",
        {"*": "ami-12345678"},
        None,
    )
    assert provider.subnets == {"us-east-1a": "subnet-a", "us-east-1b": "subnet-b"}
    with pytest.raises(ValueError, match="zone=id"):
        EC2Provider.from_env({"SPOTRAIN_SUBNETS": "subnet-a"})
    regional = EC2Provider.from_env({"SPOTRAIN_AMI": "us-east-1=ami-1, us-west-2=ami-2"})
    assert regional.amis == {"us-east-1": "ami-1", "us-west-2": "ami-2"}
    with pytest.raises(ValueError, match="region=id"):
        EC2Provider.from_env({"SPOTRAIN_AMI": "us-east-1=ami-1,ami-2"})


def test_amis_are_regional(provider: EC2Provider) -> None:
    east, west = provider.client("us-east-1"), provider.client("us-west-2")
    on_aws = EC2Provider(amis={"us-east-1": "ami-1"})  # no local endpoint: nothing is guessed
    assert on_aws._image(east) == "ami-1"
    with pytest.raises(ApplicationError, match="no AMI configured for us-west-2") as err:
        on_aws._image(west)
    assert err.value.type == contract.CONFIG_ERROR
    templated = EC2Provider(amis={"us-east-1": "ami-1"}, launch_template="gpu-nodes")
    assert templated._image(west) is None  # the region's template brings its image
    assert EC2Provider(amis={"*": "ami-any"})._image(west) == "ami-any"


def test_iam_policy_is_valid_and_allows_every_call_the_provider_makes(
    provider: EC2Provider,
) -> None:
    document = POLICY.read_text()
    # moto's IAM validates the policy grammar the way IAM does (actions, ARNs, conditions).
    iam = boto3.client("iam", endpoint_url=provider.endpoint_url, region_name="us-east-1")
    iam.create_policy(PolicyName=f"spotrain-{uuid.uuid4().hex[:8]}", PolicyDocument=document)

    allowed = {
        action
        for st in json.loads(document)["Statement"]
        if st["Effect"] == "Allow"
        for action in ([st["Action"]] if isinstance(st["Action"], str) else st["Action"])
    }
    modules = Path(ec2_mod.__file__).parent.glob("ec2*.py")  # the provider and its ownership
    source = "".join(module.read_text() for module in modules)
    methods = set(re.findall(r"ec2\.(\w+)\(", source) + re.findall(r'paginator\("(\w+)"', source))
    methods -= {"get_paginator", "describe_images"}  # describe_images: local endpoints only
    api = provider.client().meta.method_to_api_mapping
    needed = {f"ec2:{api[m]}" for m in methods} | {"ec2:CreateTags"}  # TagSpecifications
    assert "ec2:RunInstances" in needed and needed <= allowed, needed - allowed
