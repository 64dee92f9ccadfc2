"""The EC2 node provider against moto's EC2 server on a loopback port (real boto3, real HTTP).

Capacity errors, throttling and 5xx are injected by patching moto's EC2 backend in-process
(tests/aws/ec2_support.py): this is how moto can produce them at all. Activities run under
temporalio's ActivityEnvironment (a real activity context, so heartbeats work), and once
through a real Temporal worker to prove the names, payloads and typed errors cross it.
"""

from __future__ import annotations

import json
import logging
import random
import re
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.models import fleets as moto_fleets
from moto.ec2.models import instances as moto_instances
from moto.ec2.responses import EC2Response
from temporalio import workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker

from spotrain.activities import ec2 as ec2_mod
from spotrain.activities import spot_scores
from spotrain.activities.ec2 import EC2Provider
from spotrain.activities.ec2_ownership import (
    LIVE_STATES,
    client_token,
    find_instances,
    find_orphans,
    reap,
    tags_of,
)
from spotrain.workers.worker import WORKFLOWS
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    DescribeRequest,
    LaunchRequest,
    NodeInfo,
    Offer,
    ReleaseRequest,
)
from spotrain.workflows.job.state import JobResult, JobStatus
from spotrain.workflows.spec import InstanceType, SpotPolicy
from tests.aws.ec2_support import ServiceUnavailable, ec2_error, first_n, inject, reclaim
from tests.jobs import fast_runtime, fast_spec, polled

ENV = ActivityEnvironment()
POLICY = Path(__file__).resolve().parents[2] / "infra" / "aws" / "iam-policy.json"


@pytest.fixture(scope="module")
def provider(moto_endpoint: str) -> EC2Provider:
    """Shared: creating an EC2 client loads botocore's EC2 model, about a second each."""
    return EC2Provider(endpoint_url=moto_endpoint)


@pytest.fixture(scope="module")
def impatient(moto_endpoint: str) -> EC2Provider:
    """botocore gives up after 2 attempts, so injected faults reach the caller."""
    return EC2Provider(endpoint_url=moto_endpoint, max_attempts=2)


@pytest.fixture
def job() -> str:
    """A fresh job name per test: the moto server is shared by the whole session."""
    return f"job-{uuid.uuid4().hex[:8]}"


def spot(job: str, slot: int = 0, **kw: Any) -> LaunchRequest:
    fields: dict[str, Any] = {
        "job": job,
        "slot": slot,
        "attempt": 0,
        "generation": 1,
        "lifecycle": "spot",
        "instance_type": "p3.2xlarge",
        "zone": "us-east-1b",
        "max_price": 1.5,
    } | kw
    return LaunchRequest(**fields)


def launch(provider: EC2Provider, req: LaunchRequest) -> NodeInfo:
    return ENV.run(provider.launch_node, req)


def job_instances(provider: EC2Provider, job: str) -> list[dict[str, Any]]:
    return find_instances(provider.client(), [{"Name": "tag:spotrain:job", "Values": [job]}])


def live(provider: EC2Provider, job: str) -> list[str]:
    return [
        i["InstanceId"]
        for i in job_instances(provider, job)
        if i["State"]["Name"] in {"pending", "running"}
    ]


@pytest.fixture
def run_params(provider: EC2Provider) -> Iterator[list[dict[str, Any]]]:
    """The parameters boto3 actually sends to RunInstances (botocore's event hook)."""
    sent: list[dict[str, Any]] = []
    event = "provide-client-params.ec2.RunInstances"
    hook = provider.client().meta.events.register(event, lambda params, **_: sent.append(params))
    yield sent
    provider.client().meta.events.unregister(event, hook)


# --- launch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("lifecycle", ["spot", "on-demand"])
def test_launch_lifecycle_and_tags(
    provider: EC2Provider, run_params: list[dict[str, Any]], job: str, lifecycle: str
) -> None:
    zone = "us-east-1b" if lifecycle == "spot" else None
    node = launch(provider, spot(job, slot=3, lifecycle=lifecycle, zone=zone))

    assert node.state == "ready" and node.lifecycle == lifecycle and node.slot == 3
    assert node.address and node.address != "127.0.0.1"
    assert node.zone == (zone or node.zone) and node.zone.startswith("us-east-1")
    (params,) = run_params
    assert params["ClientToken"] == client_token(job, 3, 0)
    if lifecycle == "spot":
        assert params["InstanceMarketOptions"] == {
            "MarketType": "spot",
            "SpotOptions": {
                "SpotInstanceType": "one-time",
                "InstanceInterruptionBehavior": "terminate",
                "MaxPrice": "1.50000",
            },
        }
    else:
        assert "InstanceMarketOptions" not in params

    ec2 = provider.client()
    (instance,) = job_instances(provider, job)
    assert instance.get("InstanceLifecycle") == ("spot" if lifecycle == "spot" else None)
    expected = {
        "spotrain:managed": "true",
        "spotrain:job": job,
        "spotrain:generation": "1",
        "spotrain:slot": "3",
        "spotrain:attempt": "0",
        "spotrain:lifecycle": lifecycle,
    }
    assert expected.items() <= tags_of(instance).items()
    volumes = ec2.describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [node.node_id]}]
    )["Volumes"]
    assert volumes
    for volume in volumes:
        assert expected.items() <= tags_of(volume).items()


def test_retried_launch_creates_no_duplicate(provider: EC2Provider, job: str) -> None:
    req = spot(job)
    first = launch(provider, req)
    assert launch(provider, req).node_id == first.node_id  # a plain retry

    # A crash after run_instances returned, before the activity completed: the retry finds it.
    crashed = spot(job, slot=1)
    orphan = provider._run(provider.client(), crashed)
    assert launch(provider, crashed).node_id == orphan["InstanceId"]
    assert len(live(provider, job)) == 2

    # Two racing attempts both launched (moto ignores ClientToken; AWS would not): one is kept
    # (the oldest; launch times have whole seconds, so the smaller id on a tie), the other
    # terminated.
    raced = spot(job, slot=2)
    both = {provider._run(provider.client(), raced)["InstanceId"] for _ in range(2)}
    kept = launch(provider, raced).node_id
    assert kept in both and len(live(provider, job)) == 3
    assert set(live(provider, job)) & both == {kept}


@pytest.fixture(scope="module")
def fleet(moto_endpoint: str) -> EC2Provider:
    """The provider in EC2 Fleet mode, with a launch template as on AWS."""
    ec2 = boto3.client("ec2", endpoint_url=moto_endpoint, region_name="us-east-1")
    images = ec2.describe_images(Filters=[{"Name": "name", "Values": [ec2_mod.LOCAL_AMI_NAME]}])
    template = f"spotrain-nodes-{uuid.uuid4().hex[:6]}"
    ec2.create_launch_template(
        LaunchTemplateName=template,
        LaunchTemplateData={"ImageId": images["Images"][0]["ImageId"]},
    )
    subnets = {
        sn["AvailabilityZone"]: sn["SubnetId"]
        for sn in ec2.describe_subnets(Filters=[{"Name": "default-for-az", "Values": ["true"]}])[
            "Subnets"
        ]
    }  # (moto places fleet instances by subnet; it ignores the zone of an override)
    return EC2Provider(
        endpoint_url=moto_endpoint, launch_template=template, subnets=subnets, launch_mode="fleet"
    )


@pytest.mark.parametrize("lifecycle", ["spot", "on-demand"])
def test_fleet_launch_offers_every_pool_tags_and_is_idempotent(
    fleet: EC2Provider, job: str, lifecycle: str
) -> None:
    sent: list[dict[str, Any]] = []
    event = "provide-client-params.ec2.CreateFleet"
    hook = fleet.client().meta.events.register(event, lambda params, **_: sent.append(params))
    try:
        others = [("p3.2xlarge", "us-east-1c"), ("g5.xlarge", "us-east-1a")]
        req = spot(job, slot=2, lifecycle=lifecycle, fallback_pools=others)
        node = launch(fleet, req)
        assert launch(fleet, req).node_id == node.node_id  # a retry finds the slot's node
    finally:
        fleet.client().meta.events.unregister(event, hook)

    (params,) = sent  # the retry bought nothing
    assert params["Type"] == "instant" and params["ClientToken"] == client_token(job, 2, 0)
    assert params["TargetCapacitySpecification"] == {
        "TotalTargetCapacity": 1,
        "DefaultTargetCapacityType": lifecycle,
    }
    assert params["SpotOptions"]["AllocationStrategy"] == "price-capacity-optimized"
    (config,) = params["LaunchTemplateConfigs"]
    pools = [(o["InstanceType"], o["AvailabilityZone"]) for o in config["Overrides"]]
    assert pools == [("p3.2xlarge", "us-east-1b"), *others]
    assert node.state == "ready" and node.lifecycle == lifecycle and node.slot == 2
    assert (node.instance_type, node.zone) in pools
    (instance,) = job_instances(fleet, job)
    owner = {"spotrain:job": job, "spotrain:slot": "2", "spotrain:lifecycle": lifecycle}
    assert owner.items() <= tags_of(instance).items()
    volumes = fleet.client().describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [node.node_id]}]
    )["Volumes"]
    assert volumes and all(owner.items() <= tags_of(v).items() for v in volumes)
    # `spotrain gc` and `release` find a fleet's node by the same tags as any other.
    found = find_orphans(fleet.client(), lambda _: False, job)
    assert [o.instance_id for o in found] == [node.node_id]


def test_the_client_token_is_stable_per_attempt_and_new_per_attempt() -> None:
    """A retried launch call must not buy twice; a new attempt (the first one's node failed)
    must not be answered with the old instance."""
    assert client_token("job", 3, 0) == client_token("job", 3, 0)
    tokens = {client_token(j, s, a) for j, s, a in [("job", 3, 0), ("job", 3, 1), ("job", 4, 0)]}
    assert len(tokens) == 3 and all(len(t) <= 64 for t in tokens)


def test_fleet_that_launches_nothing_is_a_capacity_error(
    fleet: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An instant fleet reports pools it could not fill in its answer instead of failing the
    call: moto's fleet is made to fill nothing (patched in-process, as moto has no capacity)."""
    monkeypatch.setattr(moto_fleets.Fleet, "create_spot_requests", lambda self, weight: None)
    with pytest.raises(ApplicationError) as info:
        launch(fleet, spot(job))
    assert info.value.type == contract.CAPACITY_ERROR and info.value.non_retryable
    assert live(fleet, job) == []


def test_fleet_without_a_launch_template_is_a_config_error(moto_endpoint: str, job: str) -> None:
    provider = EC2Provider(endpoint_url=moto_endpoint, launch_mode="fleet")
    with pytest.raises(ApplicationError) as info:
        launch(provider, spot(job))
    assert info.value.type == contract.CONFIG_ERROR and "SPOTRAIN_LAUNCH_TEMPLATE" in str(
        info.value
    )


def test_capacity_error_only_for_that_pool(
    provider: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    injected = inject(
        monkeypatch,
        "run_instances",
        ec2_error("InsufficientInstanceCapacity"),
        lambda kw: (
            (kw["instance_type"], kw["placement"], bool(kw["instance_market_options"]))
            == ("p3.2xlarge", "us-east-1a", True)
        ),
    )
    with pytest.raises(ApplicationError) as err:
        launch(provider, spot(job, zone="us-east-1a"))
    assert err.value.type == contract.CAPACITY_ERROR and err.value.non_retryable
    assert "InsufficientInstanceCapacity" in str(err.value)
    assert injected == ["run_instances"]  # typed at once: no botocore retry of a 400
    assert live(provider, job) == []

    # The next pool, another type in the same zone and on-demand there all serve.
    assert launch(provider, spot(job, slot=0, zone="us-east-1b")).state == "ready"
    assert launch(provider, spot(job, slot=1, zone="us-east-1a", instance_type="g5.xlarge"))
    on_demand = launch(provider, spot(job, slot=2, zone="us-east-1a", lifecycle="on-demand"))
    assert on_demand.state == "ready" and on_demand.lifecycle == "on-demand"


@pytest.mark.parametrize(
    ("code", "kind"),
    [(c, contract.CAPACITY_ERROR) for c in sorted(ec2_mod.CAPACITY_CODES)]
    + [("AuthFailure", contract.CONFIG_ERROR), ("UnauthorizedOperation", contract.CONFIG_ERROR)],
)
def test_error_codes_are_typed(
    provider: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch, code: str, kind: str
) -> None:
    inject(monkeypatch, "run_instances", ec2_error(code), lambda _kw: True)
    with pytest.raises(ApplicationError) as err:
        launch(provider, spot(job))
    assert (err.value.type, err.value.non_retryable) == (kind, True)


def test_unknown_instance_type_is_a_config_error(
    provider: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # moto's own validation (off by default), not an injected error.
    monkeypatch.setattr(moto_instances.settings, "EC2_ENABLE_INSTANCE_TYPE_VALIDATION", True)
    with pytest.raises(ApplicationError) as err:
        launch(provider, spot(job, instance_type="p9.nonexistent"))
    assert err.value.type == contract.CONFIG_ERROR and "p9.nonexistent" in str(err.value)


def test_missing_credentials_are_a_config_error(
    moto_endpoint: str, job: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role to find here
    with pytest.raises(ApplicationError) as err:
        launch(EC2Provider(endpoint_url=moto_endpoint), spot(job))
    assert err.value.type == contract.CONFIG_ERROR and "credentials" in str(err.value)


def test_throttling_and_5xx_are_retried(
    provider: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    throttled = inject(monkeypatch, "run_instances", ec2_error("RequestLimitExceeded"), first_n(2))
    unavailable = inject(
        monkeypatch, "get_reservations_by_instance_ids", ServiceUnavailable, first_n(2)
    )
    node = launch(provider, spot(job))
    assert node.state == "ready"
    assert len(throttled) == 2 and len(unavailable) == 2
    assert live(provider, job) == [node.node_id]


def test_throttling_past_botocore_retries_stays_retryable(
    impatient: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When botocore gives up, the error is a plain one: Temporal retries the activity."""
    provider = impatient
    inject(monkeypatch, "run_instances", ec2_error("RequestLimitExceeded"), first_n(2))
    with pytest.raises(ClientError) as err:
        launch(provider, spot(job))
    assert err.value.response["Error"]["Code"] == "RequestLimitExceeded"
    assert launch(provider, spot(job)).state == "ready"  # the activity's retry
    assert len(live(provider, job)) == 1


# --- track -----------------------------------------------------------------------------------


def test_describe_states_and_reclaim(provider: EC2Provider, job: str) -> None:
    a, b, c = (launch(provider, spot(job, slot=s)) for s in range(3))
    reclaim(b.node_id)
    ENV.run(provider.release_nodes, ReleaseRequest(job=job, node_ids=[c.node_id]))

    nodes = ENV.run(
        provider.describe_nodes,
        DescribeRequest(job=job, node_ids=[a.node_id, b.node_id, c.node_id, "i-0123456789abcdef0"]),
    )
    assert [(n.node_id, n.state, n.reason) for n in nodes] == [
        (a.node_id, "ready", None),
        (b.node_id, "gone", "reclaimed"),
        (c.node_id, "gone", "terminated"),
        ("i-0123456789abcdef0", "gone", "not-found"),
    ]
    everything = ENV.run(provider.describe_nodes, DescribeRequest(job=job, node_ids=[]))
    assert sorted(n.slot for n in everything) == [0, 1, 2]


def test_reclaimed_during_launch_is_a_capacity_error(provider: EC2Provider, job: str) -> None:
    req = spot(job)
    orphan = provider._run(provider.client(), req)  # launched, then reclaimed before ready
    reclaim(orphan["InstanceId"])
    with pytest.raises(ApplicationError) as err:
        launch(provider, req)
    assert err.value.type == contract.CAPACITY_ERROR and "SpotInstanceTermination" in str(err.value)
    assert live(provider, job) == []  # and the retry did not buy another node


def test_flapping_api_never_reports_a_healthy_node_gone(
    impatient: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    provider = impatient
    nodes = [launch(provider, spot(job, slot=s)) for s in range(2)]
    rng = random.Random(7)
    errors = [ec2_error("RequestLimitExceeded"), ServiceUnavailable]
    injected = inject(
        monkeypatch,
        "describe_instances",
        lambda: rng.choice(errors)(),
        lambda _kw: rng.random() < 0.2,
    )
    req = DescribeRequest(job=job, node_ids=[n.node_id for n in nodes])
    answers, raised = [], 0
    for i in range(30):
        if i == 20:
            reclaim(nodes[1].node_id)
        try:
            answers.append((i, ENV.run(provider.describe_nodes, req)))
        except ClientError:
            raised += 1  # plain: Temporal retries the activity; membership is unchanged
    assert injected and raised and answers  # faults reached the caller as errors, never as "gone"
    for i, answer in answers:
        assert answer[0].state == "ready"
        assert answer[1].state == ("ready" if i < 20 else "gone")
    assert answers[-1][1][1].reason == "reclaimed"


# --- release and gc --------------------------------------------------------------------------


def test_release_is_idempotent_and_touches_only_the_job(provider: EC2Provider, job: str) -> None:
    mine = launch(provider, spot(job))
    other_job = f"{job}-other"
    theirs = launch(provider, spot(other_job))
    req = ReleaseRequest(job=job, node_ids=[mine.node_id, theirs.node_id, "i-00000000000000000"])
    assert ENV.run(provider.release_nodes, req) == [mine.node_id]
    assert ENV.run(provider.release_nodes, req) == [mine.node_id]  # again: nothing new
    assert live(provider, job) == [] and live(provider, other_job) == [theirs.node_id]
    ENV.run(provider.release_nodes, ReleaseRequest(job=other_job, node_ids=[theirs.node_id]))


def test_gc_reaps_orphans_and_spares_live_jobs(provider: EC2Provider, job: str) -> None:
    running_job = f"{job}-running"
    orphan_ids = {launch(provider, spot(job, slot=s)).node_id for s in range(2)}
    spared = launch(provider, spot(running_job)).node_id
    is_running = lambda name: name != job  # noqa: E731  # the CLI asks Temporal instead
    ec2 = provider.client()

    dry = reap(ec2, is_running)
    assert {o.instance_id for o in dry} == orphan_ids and {o.job for o in dry} == {job}
    assert set(live(provider, job)) == orphan_ids  # a dry run changes nothing

    def unreachable(_name: str) -> bool:
        raise ConnectionError("temporal is down")

    with pytest.raises(ConnectionError):
        reap(ec2, unreachable, apply=True)
    assert set(live(provider, job)) == orphan_ids  # in doubt, nothing is reaped

    assert {o.instance_id for o in reap(ec2, is_running, apply=True)} == orphan_ids
    assert live(provider, job) == [] and live(provider, running_job) == [spared]
    assert not [o for o in reap(ec2, is_running) if o.job == job]
    ENV.run(provider.release_nodes, ReleaseRequest(job=running_job, node_ids=[spared]))


# --- offers ----------------------------------------------------------------------------------


def policy(**kw: Any) -> SpotPolicy:
    fields: dict[str, Any] = {
        "instance_types": [
            InstanceType(name="g5.xlarge", gpus=1, on_demand_price=1.0),
            InstanceType(name="g4dn.12xlarge", gpus=4, on_demand_price=3.912),
        ],
        "zones": ["us-east-1a", "us-east-1b", "us-east-1c"],
    } | kw
    return SpotPolicy(**fields)


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


# --- through a real Temporal worker ----------------------------------------------------------


@workflow.defn(sandboxed=False)
class EC2Probe:
    """Calls the provider's activities by name, as TrainingJob does."""

    @workflow.run
    async def run(self, job: str) -> list[str]:
        opts: dict[str, Any] = {
            "start_to_close_timeout": timedelta(seconds=60),
            "heartbeat_timeout": timedelta(seconds=10),
            "retry_policy": RetryPolicy(initial_interval=timedelta(milliseconds=100)),
        }
        offers = await workflow.execute_activity(
            contract.FIND_OFFERS, policy(), result_type=list[Offer], **opts
        )
        seen = []
        for slot, offer in enumerate(offers[:2]):
            req = spot(job, slot=slot, instance_type=offer.instance_type, zone=offer.zone)
            try:
                node = await workflow.execute_activity(
                    contract.LAUNCH_NODE, req, result_type=NodeInfo, **opts
                )
                seen.append(f"{node.state}:{node.zone}")
            except ActivityError as err:
                assert isinstance(err.cause, ApplicationError)
                seen.append(f"{err.cause.type}:{offer.zone}")
        nodes = await workflow.execute_activity(
            contract.DESCRIBE_NODES,
            DescribeRequest(job=job, node_ids=[]),
            result_type=list[NodeInfo],
            **opts,
        )
        released = await workflow.execute_activity(
            contract.RELEASE_NODES,
            ReleaseRequest(job=job, node_ids=[n.node_id for n in nodes]),
            result_type=list[str],
            **opts,
        )
        return [*seen, f"released:{len(released)}"]


async def test_activities_through_temporal(
    dev_env: WorkflowEnvironment, provider: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    offers = ENV.run(provider.find_offers, policy())
    bad = (offers[1].instance_type, offers[1].zone)
    inject(
        monkeypatch,
        "run_instances",
        ec2_error("InsufficientInstanceCapacity"),
        lambda kw: (kw["instance_type"], kw["placement"]) == bad,
    )
    with ThreadPoolExecutor(4) as pool:
        async with Worker(
            dev_env.client,
            task_queue=f"ec2-{job}",
            workflows=[EC2Probe],
            activities=provider.activities(),
            activity_executor=pool,
        ):
            try:
                result = await dev_env.client.execute_workflow(
                    EC2Probe.run, job, id=f"ec2-probe-{job}", task_queue=f"ec2-{job}"
                )
            except WorkflowFailureError as err:
                raise AssertionError(f"probe failed: {err.cause}") from err
    assert result == [
        f"ready:{offers[0].zone}",
        f"{contract.CAPACITY_ERROR}:{offers[1].zone}",
        "released:1",
    ]
    assert live(provider, job) == []


async def test_training_job_across_regions_recovers_a_reclaim_and_leaks_nothing(
    dev_env: WorkflowEnvironment, provider: EC2Provider
) -> None:
    """A TrainingJob (simulated workers) whose spot pools are only in its second region: its
    nodes are bought there, a node reclaimed there is noticed (no webhook: the job's own check
    describes it) and replaced there, and nothing is left running in either region."""
    spec = fast_spec(
        total_steps=300,
        elastic={"min_nodes": 2, "max_nodes": 2},
        spot={
            "instance_types": [{"name": "g5.xlarge", "gpus": 1, "on_demand_price": 1.0}],
            "more_regions": ["us-west-2"],
            "zones": ["us-west-2a", "us-west-2b"],
        },
        on_demand={"fallback": False},
    )
    name, queue = spec["name"], f"regions-{spec['name']}"
    with ThreadPoolExecutor(8) as pool:
        async with Worker(
            dev_env.client,
            task_queue=queue,
            workflows=WORKFLOWS,
            activities=provider.activities() + fast_runtime().activities(),
            activity_executor=pool,
        ):
            handle = await dev_env.client.start_workflow(
                "TrainingJob", spec, id=name, task_queue=queue, result_type=JobResult
            )
            status = await polled(
                lambda: handle.query("status", result_type=JobStatus),
                lambda s: s.phase == "Running" and s.step > 50,
            )
            first = next(n.node_id for n in status.nodes if n.state == "ready")
            assert first is not None
            reclaim(first, "us-west-2")
            result = await handle.result()
    assert result.phase == "Succeeded" and result.steps_done == 300, result.failure
    assert result.faults + result.reclaims >= 1 and result.generations >= 2
    ready = [e.detail for e in result.timeline if e.event == "node ready"]
    assert len(ready) >= 3 and all(d.startswith("spot g5.xlarge us-west-2") for d in ready), ready
    for region in ("us-east-1", "us-west-2"):
        owned = find_instances(
            provider.client(region), [{"Name": "tag:spotrain:job", "Values": [name]}]
        )
        assert [i for i in owned if i["State"]["Name"] in LIVE_STATES] == [], region
