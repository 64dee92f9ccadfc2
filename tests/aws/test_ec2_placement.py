"""Cluster placement groups on EC2 (`placement_group: true`), against moto's server on a
loopback port with placement groups added (tests/aws/moto_placement.py: moto has none): the
group is made once, tagged as the job's, and its nodes land in it; a retried launch reuses it;
the release that empties it deletes it, a group still in use failing no release; `spotrain
gc`'s reaper deletes an orphaned one; a type that cannot go in one launches without; an
endpoint without the API (plain moto) launches without; and a TrainingJob passes the spec's
choice to its launches and releases."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2 import models as moto_models
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.responses import EC2Response
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from spotrain.activities import ec2_placement
from spotrain.activities.ec2 import EC2Provider
from spotrain.activities.ec2_ownership import LIVE_STATES, MANAGED, TAG_JOB, find_instances, tags_of
from spotrain.activities.ec2_placement import group_name, reap_groups, supports_cluster
from spotrain.workflows.contract import LaunchRequest, ReleaseRequest
from spotrain.workflows.job.state import JobStatus
from tests.aws import moto_placement
from tests.aws.ec2_support import ENV, ec2_job, job_instances, launch, live, spot
from tests.aws.test_ec2 import fleet as fleet
from tests.jobs import fast_spec, polled

ZONE = "us-east-1b"  # spot()'s


@pytest.fixture
def groups_api(moto_endpoint: str) -> Iterator[None]:
    """moto's EC2 with placement groups for the test."""
    with moto_placement.installed():
        yield


@pytest.fixture
def sent(provider: EC2Provider) -> Iterator[dict[str, list[dict[str, Any]]]]:
    """The parameters boto3 sends, by operation (botocore's event hook)."""
    calls: dict[str, list[dict[str, Any]]] = {}
    ops = (
        "CreatePlacementGroup",
        "DescribePlacementGroups",
        "DeletePlacementGroup",
        "RunInstances",
    )
    hooks = []
    for op in ops:

        def record(params: dict[str, Any], op: str = op, **_: Any) -> None:
            calls.setdefault(op, []).append(params)

        event = f"provide-client-params.ec2.{op}"
        hooks.append((event, provider.client().meta.events.register(event, record)))
    yield calls
    for event, hook in hooks:
        provider.client().meta.events.unregister(event, hook)


def grouped(job: str, slot: int = 0, **kw: Any) -> LaunchRequest:
    return spot(job, slot=slot, placement_group=True, **kw)


def group(provider: EC2Provider, name: str) -> dict[str, Any] | None:
    return ec2_placement.describe(provider.client(), name)


def placed_in(provider: EC2Provider, job: str) -> dict[str, str]:
    """Each of the job's instances' placement group ('' for none), as describe_instances says."""
    return {i["InstanceId"]: i["Placement"]["GroupName"] for i in job_instances(provider, job)}


def release(provider: EC2Provider, job: str, ids: list[str]) -> list[str]:
    return ENV.run(provider.release_nodes, ReleaseRequest(job=job, node_ids=ids))


# --- launch ----------------------------------------------------------------------------------


@pytest.mark.usefixtures("groups_api")
def test_nodes_land_in_one_group_made_once_with_the_jobs_tags(
    provider: EC2Provider, job: str, sent: dict[str, list[dict[str, Any]]]
) -> None:
    nodes = [launch(provider, grouped(job, slot)) for slot in range(3)]
    name = group_name(job, ZONE)

    (create,) = sent["CreatePlacementGroup"]  # once, for every node of the zone
    assert create["GroupName"] == name and create["Strategy"] == "cluster"
    assert [p["Placement"] for p in sent["RunInstances"]] == [
        {"AvailabilityZone": ZONE, "GroupName": name}
    ] * 3
    assert placed_in(provider, job) == {n.node_id: name for n in nodes}

    made = group(provider, name)
    assert made is not None and made["Strategy"] == "cluster" and made["State"] == "available"
    owner = {MANAGED: "true", TAG_JOB: job}
    assert tags_of(made) == owner | {"Name": name}
    for instance in job_instances(provider, job):  # the very tags its nodes are found by
        assert owner.items() <= tags_of(instance).items()
    release(provider, job, [n.node_id for n in nodes])


@pytest.mark.usefixtures("groups_api")
def test_a_retried_launch_reuses_the_group(
    provider: EC2Provider,
    job: str,
    sent: dict[str, list[dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = group_name(job, ZONE)
    # A crash after the group was made, before run_instances: the retry finds and uses it.
    assert provider._groups.ensure(provider.client(), job, ZONE, "p3.2xlarge", lambda: None)
    first = launch(provider, grouped(job))
    assert len(sent["CreatePlacementGroup"]) == 1
    assert placed_in(provider, job) == {first.node_id: name}

    # A crash after run_instances returned: the retry finds the slot's node, in the group.
    crashed = provider._run(provider.client(), grouped(job, slot=1))
    assert launch(provider, grouped(job, slot=1)).node_id == crashed["InstanceId"]
    assert len(sent["CreatePlacementGroup"]) == 1 and len(sent["RunInstances"]) == 2

    # Two tries racing to make it: the one that finds it made (Duplicate) uses it.
    raced = f"{job}-raced"
    unseen = iter([True])  # the first look finds nothing; meanwhile the other try makes it
    real = ec2_placement.describe
    monkeypatch.setattr(
        ec2_placement, "describe", lambda ec2, n: None if next(unseen, False) else real(ec2, n)
    )
    provider.client().create_placement_group(GroupName=group_name(raced, ZONE), Strategy="cluster")
    node = launch(provider, grouped(raced))
    assert placed_in(provider, raced) == {node.node_id: group_name(raced, ZONE)}
    release(provider, job, [first.node_id, crashed["InstanceId"]])
    release(provider, raced, [node.node_id])


@pytest.mark.usefixtures("groups_api")
def test_a_type_that_cannot_go_in_a_cluster_group_launches_without(
    provider: EC2Provider,
    job: str,
    sent: dict[str, list[dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger=ec2_placement.__name__):
        node = launch(provider, grouped(job, instance_type="t3.large"))
    assert node.state == "ready"
    assert set(sent) == {"RunInstances"} and placed_in(provider, job) == {node.node_id: ""}
    assert group(provider, group_name(job, ZONE)) is None
    assert any("t3.large cannot launch in a cluster placement group" in m for m in caplog.messages)
    release(provider, job, [node.node_id])


@pytest.mark.usefixtures("groups_api")
def test_a_fleet_launch_puts_each_pool_in_its_zones_group(fleet: EC2Provider, job: str) -> None:
    """With SPOTRAIN_EC2_LAUNCH=fleet each override names its zone's group, a type that cannot
    join none. (moto's fleet ignores an override's placement: what is sent is checked.)"""
    sent: list[dict[str, Any]] = []
    event = "provide-client-params.ec2.CreateFleet"
    hook = fleet.client().meta.events.register(event, lambda params, **_: sent.append(params))
    try:
        others = [("g5.xlarge", "us-east-1c"), ("t3.large", ZONE)]
        launch(fleet, grouped(job, fallback_pools=others))
    finally:
        fleet.client().meta.events.unregister(event, hook)
    (params,) = sent
    (config,) = params["LaunchTemplateConfigs"]
    assert [o.get("Placement") for o in config["Overrides"]] == [
        {"GroupName": group_name(job, ZONE)},
        {"GroupName": group_name(job, "us-east-1c")},
        None,
    ]
    made = reap_groups(fleet.client(), lambda _: False, apply=True, job=job)
    assert {(o.name, o.state) for o in made} == {
        (group_name(job, zone), "deleted") for zone in (ZONE, "us-east-1c")
    }
    ENV.run(fleet.release_nodes, ReleaseRequest(job=job, node_ids=[], everything=True))


def test_the_rule_for_types() -> None:
    """EC2's user guide: no burstable T family, no Mac, no flex family."""
    refused = ["t2.micro", "t3.large", "t3a.xlarge", "t4g.small", "mac2.metal", "m7i-flex.large"]
    accepted = ["p4d.24xlarge", "p3.2xlarge", "g5.xlarge", "trn1.32xlarge", "c5n.18xlarge"]
    assert [t for t in refused + accepted if supports_cluster(t)] == accepted


def test_an_endpoint_without_placement_groups_launches_without(
    provider: EC2Provider,
    job: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Plain moto (what `spotrain dev` runs) answers the API with an error page: the nodes
    launch without a group, said once; release and gc find no group to delete."""
    monkeypatch.setattr(provider, "_groups", ec2_placement.PlacementGroups())  # nothing said yet
    with caplog.at_level(logging.INFO, logger=ec2_placement.__name__):
        nodes = [launch(provider, grouped(job, slot)) for slot in range(2)]
        assert release(provider, job, [n.node_id for n in nodes]) == [n.node_id for n in nodes]
        assert reap_groups(provider.client(), lambda _: False, apply=True) == []
    assert set(placed_in(provider, job).values()) == {""}
    assert [m for m in caplog.messages if "no placement groups" in m] == [
        "this EC2 endpoint has no placement groups: nodes launch without",
        "gc: this EC2 endpoint has no placement groups",
    ]


def test_old_histories_decode() -> None:
    """Launches recorded before the field decode as not asking for a group."""
    old = spot("j").model_dump(exclude={"placement_group"})
    assert LaunchRequest.model_validate(old).placement_group is False


# --- release ---------------------------------------------------------------------------------


@pytest.mark.usefixtures("groups_api")
def test_the_release_that_empties_the_group_deletes_it(provider: EC2Provider, job: str) -> None:
    a, b = (launch(provider, grouped(job, slot)).node_id for slot in range(2))
    name = group_name(job, ZONE)
    assert release(provider, job, [a]) == [a]
    assert group(provider, name) is not None  # b is still in it
    assert release(provider, job, [b]) == [b]
    assert group(provider, name) is None
    assert release(provider, job, [a, b]) == [a, b]  # again: nothing left, no error


@pytest.mark.usefixtures("groups_api")
def test_a_job_without_groups_makes_no_placement_group_call(
    provider: EC2Provider, job: str, sent: dict[str, list[dict[str, Any]]]
) -> None:
    """So a policy without the placement-group permissions still serves such jobs."""
    nodes = [launch(provider, spot(job, slot)).node_id for slot in range(2)]
    assert release(provider, job, nodes) == nodes
    assert set(sent) == {"RunInstances"}


def shutting_down(instance_id: str, done: bool = False) -> None:
    """An instance EC2 has not finished terminating (moto's terminate is instant)."""
    instance = moto_models.ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"].get_instance(instance_id)
    instance.terminate()
    if not done:
        instance._state.name, instance._state.code = "shutting-down", 32


@pytest.mark.usefixtures("groups_api")
def test_a_group_still_in_use_never_fails_the_release(
    provider: EC2Provider, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ec2_placement, "DRAIN_S", 0.5)
    monkeypatch.setattr(ec2_placement, "POLL_S", 0.05)
    name = group_name(job, ZONE)
    # Its last node terminating during the release's wait: deleted by that release.
    node = launch(provider, grouped(job, slot=2)).node_id
    shutting_down(node)
    finish = threading.Timer(0.2, shutting_down, (node, True))
    finish.start()
    assert release(provider, job, [node]) == [node]
    finish.join()
    assert group(provider, name) is None

    node = launch(provider, grouped(job)).node_id
    shutting_down(node)  # still shutting down past the wait: EC2 says the group is in use
    assert release(provider, job, [node]) == [node]
    assert group(provider, name) is not None
    shutting_down(node, done=True)
    assert release(provider, job, [node]) == [node]  # the next release deletes it
    assert group(provider, name) is None

    # Someone else's instance in the group: the release is done all the same.
    node = launch(provider, grouped(job, slot=1)).node_id
    ec2 = provider.client()
    image = ec2.describe_instances(InstanceIds=[node])["Reservations"][0]["Instances"][0]
    foreign = ec2.run_instances(
        ImageId=image["ImageId"],
        MinCount=1,
        MaxCount=1,
        InstanceType="p3.2xlarge",
        Placement={"AvailabilityZone": ZONE, "GroupName": name},
    )["Instances"][0]["InstanceId"]
    assert release(provider, job, [node]) == [node]
    assert group(provider, name) is not None and live(provider, job) == []
    ec2.terminate_instances(InstanceIds=[foreign])
    # Nor does a refused delete (say, a policy without ec2:DeletePlacementGroup yet).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EC2Response, "delete_placement_group", refuse)
        assert release(provider, job, [node]) == [node]
    assert group(provider, name) is not None
    assert release(provider, job, [node]) == [node]
    assert group(provider, name) is None


def refuse(self: EC2Response) -> None:
    raise EC2ClientError("UnauthorizedOperation", "not authorized: ec2:DeletePlacementGroup")


# --- gc --------------------------------------------------------------------------------------


@pytest.mark.usefixtures("groups_api")
def test_gc_reaps_orphaned_groups_and_spares_running_jobs(provider: EC2Provider, job: str) -> None:
    ec2 = provider.client()
    running_job = f"{job}-running"
    for owner, zone in ((job, "us-east-1a"), (job, "us-east-1c"), (running_job, "us-east-1a")):
        assert provider._groups.ensure(ec2, owner, zone, "p3.2xlarge", lambda: None)
    orphaned = {group_name(job, "us-east-1a"), group_name(job, "us-east-1c")}
    spared = group_name(running_job, "us-east-1a")
    is_running = lambda name: name != job  # noqa: E731  # the CLI asks Temporal instead

    def mine(found: list[ec2_placement.OrphanGroup]) -> dict[str, str]:
        return {o.name: o.state for o in found if o.job in (job, running_job)}

    assert mine(reap_groups(ec2, is_running)) == dict.fromkeys(orphaned, "available")
    assert all(group(provider, n) for n in orphaned)  # a dry run changes nothing

    def unreachable(_name: str) -> bool:
        raise ConnectionError("temporal is down")

    with pytest.raises(ConnectionError):
        reap_groups(ec2, unreachable, apply=True)
    assert all(group(provider, n) for n in orphaned)  # in doubt, nothing is deleted

    # One still has a node shutting down in it: left for the next gc.
    held = group_name(job, "us-east-1c")
    node = launch(provider, grouped(job, zone="us-east-1c")).node_id
    shutting_down(node)
    assert mine(reap_groups(ec2, is_running, apply=True)) == {
        group_name(job, "us-east-1a"): "deleted",
        held: "in use",
    }
    shutting_down(node, done=True)
    assert mine(reap_groups(ec2, is_running, apply=True)) == {held: "deleted"}
    assert mine(reap_groups(ec2, is_running)) == {} and group(provider, spared) is not None
    assert mine(reap_groups(ec2, lambda _: False, apply=True, job=running_job)) == {
        spared: "deleted"
    }


# --- through a TrainingJob -------------------------------------------------------------------


@pytest.mark.usefixtures("groups_api")
async def test_a_job_with_placement_group_keeps_its_nodes_in_it_and_deletes_it(
    dev_env: WorkflowEnvironment, provider: EC2Provider
) -> None:
    """The spec's `placement_group` reaches every launch of the job (spot and its on-demand
    base node alike) and its final release: all in one group, deleted when the job ends."""
    spec = fast_spec(
        total_steps=10**6,
        elastic={"min_nodes": 3, "max_nodes": 3},
        spot={
            "instance_types": [{"name": "g5.xlarge", "gpus": 1, "on_demand_price": 1.0}],
            "zones": ["us-east-1b", "us-east-1c"],
        },
        on_demand={"base_nodes": 1},
        placement_group=True,
    )
    name = spec["name"]
    async with ec2_job(dev_env, provider, spec, f"pg-{name}") as handle:
        await polled(
            lambda: handle.query("status", result_type=JobStatus),
            lambda s: s.phase == "Running" and s.world_size == 3,
        )
        mine = [{"Name": f"tag:{TAG_JOB}", "Values": [name]}]
        running = [
            i for i in find_instances(provider.client(), mine) if i["State"]["Name"] in LIVE_STATES
        ]
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    (zone,) = {i["Placement"]["AvailabilityZone"] for i in running}
    assert len(running) == 3
    assert {i["Placement"]["GroupName"] for i in running} == {group_name(name, zone)}
    assert live(provider, name) == []
    assert ec2_placement.find(provider.client(), name) == []
