"""The embedded stack's spot market, against moto's server in this process: a zone's spot
capacity follows a trace (launches beyond it fail like EC2's, a falling capacity reclaims the
newest node with an EventBridge-shaped notice sent to the webhook URL), then reclaims."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import boto3
import pytest
from aiohttp import web
from botocore.exceptions import ClientError
from temporalio.testing import ActivityEnvironment

from spotrain.activities.ec2 import EC2Provider
from spotrain.activities.local import LocalRuntime
from spotrain.workers.embedded.spot_market import SpotMarket, Trace
from spotrain.workflows.contract import Offer
from spotrain.workflows.spec import InstanceType, SpotPolicy

ZONE = "us-east-1c"


def launch_spot(ec2: Any) -> str:
    image = ec2.describe_images(Owners=["amazon"], MaxResults=5)["Images"][0]["ImageId"]
    out = ec2.run_instances(
        ImageId=image,
        MinCount=1,
        MaxCount=1,
        InstanceType="m5.large",
        Placement={"AvailabilityZone": ZONE},
        InstanceMarketOptions={"MarketType": "spot"},
        TagSpecifications=[
            {"ResourceType": "instance", "Tags": [{"Key": "spotrain:job", "Value": "t"}]}
        ],
    )
    return out["Instances"][0]["InstanceId"]


async def test_capacity_follows_the_trace(moto_endpoint: str, tmp_path: Path) -> None:
    received: list[dict[str, Any]] = []

    async def webhook(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer secret"
        received.append(json.loads(await request.read()))
        return web.json_response({}, status=202)

    app = web.Application()
    app.router.add_post("/v1/events/aws", webhook)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_endpoint)
    market = SpotMarket(f"http://127.0.0.1:{port}", "secret", LocalRuntime(tmp_path))
    trace = Trace(zone=ZONE, gap_s=60, data=(2, 2, 2, 2, 1, 1, 1, 1))  # 0.1 s per tick at 600x
    follower = asyncio.create_task(market.follow(trace, speedup=600, notice_s=0.2))
    try:
        await asyncio.sleep(0.05)
        first, second = launch_spot(ec2), launch_spot(ec2)
        with pytest.raises(ClientError, match="InsufficientInstanceCapacity"):
            launch_spot(ec2)  # the zone is full
        # ... and its placement score says so (moto has none: the market answers for it)
        scores = {(o.zone, o.score) for o in offers(moto_endpoint)}
        assert scores == {("us-east-1a", 10.0), (ZONE, 1.0)}, scores
        assert offers(moto_endpoint)[-1].zone == ZONE  # the full zone ranks last
        for _ in range(200):  # capacity falls to 1 at tick 4: the newest node goes
            state = ec2.describe_instances(InstanceIds=[second])["Reservations"][0]["Instances"][0]
            if state["State"]["Name"] == "terminated" and len(received) >= 2:
                break  # (the state-change notice is posted once the instance is terminated)
            await asyncio.sleep(0.05)
        assert state["StateReason"]["Code"] == "Server.SpotInstanceTermination"
        oldest = ec2.describe_instances(InstanceIds=[first])["Reservations"][0]["Instances"][0]
        assert oldest["State"]["Name"] == "running"
        kinds = [(e["detail-type"], e["detail"]["instance-id"]) for e in received]
        assert kinds[:2] == [
            ("EC2 Spot Instance Interruption Warning", second),
            ("EC2 Instance State-change Notification", second),
        ]
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)
        await runner.cleanup()
        market.close()
    assert ZONE not in market.capacity  # no longer limited once the market stops following
    assert {o.score for o in offers(moto_endpoint)} == {None}  # moto's own answer again
    ec2.terminate_instances(InstanceIds=[first])


def offers(endpoint: str) -> list[Offer]:
    types = [InstanceType(name="m5.large", on_demand_price=0.096)]
    policy = SpotPolicy(instance_types=types, zones=["us-east-1a", ZONE])
    return ActivityEnvironment().run(EC2Provider(endpoint_url=endpoint).find_offers, policy)
