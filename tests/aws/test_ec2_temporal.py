"""The EC2 provider's activities through a real Temporal worker (the dev server): names,
payloads and typed errors cross it; and a TrainingJob whose nodes live in its second region
recovers a reclaim there and leaks nothing (moto's EC2 server on a loopback port)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from temporalio import workflow
from temporalio.client import WorkflowFailureError
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from spotrain.activities.ec2 import EC2Provider
from spotrain.activities.ec2_ownership import LIVE_STATES, find_instances
from spotrain.workflows import contract
from spotrain.workflows.contract import DescribeRequest, NodeInfo, Offer, ReleaseRequest
from spotrain.workflows.job.state import JobStatus
from tests.aws.ec2_support import ENV, ec2_error, ec2_job, inject, live, policy, reclaim, spot
from tests.jobs import fast_spec, polled

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


@pytest.mark.slow
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
    async with ec2_job(dev_env, provider, spec, queue) as handle:
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


async def test_a_job_buys_its_spot_and_on_demand_instances_in_one_zone(
    dev_env: WorkflowEnvironment, provider: EC2Provider
) -> None:
    """`placement: zone` (the default) on EC2: spot offered in two zones, and an on-demand
    base node, which spotrain would otherwise put in the region's first zone: every instance
    the job launches is in the same zone, as describe_instances reports it."""
    spec = fast_spec(
        total_steps=10**6,
        elastic={"min_nodes": 3, "max_nodes": 3},
        spot={
            "instance_types": [{"name": "g5.xlarge", "gpus": 1, "on_demand_price": 1.0}],
            "zones": ["us-east-1b", "us-east-1c"],  # (not us-east-1a, EC2's pick for on-demand)
        },
        on_demand={"base_nodes": 1},
    )
    name, queue = spec["name"], f"zone-{spec['name']}"
    async with ec2_job(dev_env, provider, spec, queue) as handle:
        await polled(
            lambda: handle.query("status", result_type=JobStatus),
            lambda s: s.phase == "Running" and s.world_size == 3,
        )
        mine = [{"Name": "tag:spotrain:job", "Values": [name]}]
        running = [
            i
            for i in find_instances(provider.client("us-east-1"), mine)
            if i["State"]["Name"] in LIVE_STATES
        ]
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await handle.result()
    lifecycles = sorted(i.get("InstanceLifecycle", "on-demand") for i in running)
    assert lifecycles == ["on-demand", "spot", "spot"]
    assert len({i["Placement"]["AvailabilityZone"] for i in running}) == 1, running
    assert live(provider, name) == []
