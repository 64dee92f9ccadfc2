"""The EC2 node provider against moto's EC2 server on a loopback port (real boto3, real HTTP):
launches, fleets, typed errors, describe, release and garbage collection. Offers, regions and
IAM are in test_ec2_offers.py; the activities through a real Temporal worker in
test_ec2_temporal.py.

Capacity errors, throttling and 5xx are injected by patching moto's EC2 backend in-process
(tests/aws/ec2_support.py): this is how moto can produce them at all. Activities run under
temporalio's ActivityEnvironment (a real activity context, so heartbeats work).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto.ec2.models import fleets as moto_fleets
from moto.ec2.models import instances as moto_instances
from temporalio.exceptions import ApplicationError

from spotrain.activities import ec2 as ec2_mod
from spotrain.activities.ec2 import EC2Provider
from spotrain.activities.ec2_ownership import client_token, find_orphans, reap, tags_of
from spotrain.workflows import contract
from spotrain.workflows.contract import DescribeRequest, ReleaseRequest
from tests.aws.ec2_support import (
    ENV,
    ServiceUnavailable,
    ec2_error,
    first_n,
    inject,
    job_instances,
    launch,
    live,
    reclaim,
    spot,
)


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


def test_retried_launch_creates_no_duplicate(
    provider: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    req = spot(job)
    first = launch(provider, req)
    assert launch(provider, req).node_id == first.node_id  # a plain retry

    # A crash after run_instances returned, before the activity completed: the retry finds it.
    crashed = spot(job, slot=1)
    orphan = provider._run(provider.client(), crashed)
    assert launch(provider, crashed).node_id == orphan["InstanceId"]
    assert len(live(provider, job)) == 2

    # A retried call with the same ClientToken is the first launch (EC2's idempotency; the
    # tests' moto honours it too).
    raced = spot(job, slot=2)
    first = provider._run(provider.client(), raced)["InstanceId"]
    assert provider._run(provider.client(), raced)["InstanceId"] == first

    # Two launches for one slot all the same (say, by hand with another token): one is kept
    # (the oldest; launch times have whole seconds, so the smaller id on a tie), the other
    # terminated.
    monkeypatch.setattr(ec2_mod, "client_token", lambda *_: "launched-by-hand")
    both = {first, provider._run(provider.client(), raced)["InstanceId"]}
    assert len(both) == 2
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
    # one orphan stopped (by hand, or an instance's own shutdown): its volumes still bill
    ec2.stop_instances(InstanceIds=[min(orphan_ids)])

    def kept() -> set[str]:
        gone = {"shutting-down", "terminated"}
        return {
            i["InstanceId"] for i in job_instances(provider, job) if i["State"]["Name"] not in gone
        }

    dry = reap(ec2, is_running)
    assert {o.instance_id for o in dry} == orphan_ids and {o.job for o in dry} == {job}
    assert kept() == orphan_ids  # a dry run changes nothing

    def unreachable(_name: str) -> bool:
        raise ConnectionError("temporal is down")

    with pytest.raises(ConnectionError):
        reap(ec2, unreachable, apply=True)
    assert kept() == orphan_ids  # in doubt, nothing is reaped

    assert {o.instance_id for o in reap(ec2, is_running, apply=True)} == orphan_ids
    assert kept() == set() and live(provider, running_job) == [spared]
    assert not [o for o in reap(ec2, is_running) if o.job == job]
    ENV.run(provider.release_nodes, ReleaseRequest(job=running_job, node_ids=[spared]))


# --- the worker's heap -----------------------------------------------------------------------

HEAP_AFTER_FREEZE = """
import gc
from spotrain.activities.ec2 import EC2Provider
from spotrain.workers.worker import freeze_heap
provider = EC2Provider(region="us-east-1")
provider.activities()  # as the worker builds its activities
freeze_heap()  # as its entry point does before it serves
provider.client()  # as the first activity asks for it
gc.collect()
print(gc.get_freeze_count(), len(gc.get_objects()))
"""


def test_the_ec2_model_is_frozen_with_the_worker_s_heap() -> None:
    """boto3's EC2 model (some 55,000 objects) loads while the worker starts, so it is
    frozen with the rest and no later full collection scans it while holding the GIL: the
    scans that, under load, failed activations as deadlocks (workers/worker.py freeze_heap).
    In a process of its own: freezing pytest's heap would keep its garbage."""
    env = os.environ | {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local"}
    out = subprocess.run(
        [sys.executable, "-c", HEAP_AFTER_FREEZE], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    frozen, scanned = map(int, out.stdout.split())
    assert frozen > 100_000, frozen
    assert scanned < 5_000, scanned
