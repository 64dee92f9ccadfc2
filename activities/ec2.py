"""The EC2 node provider: buy, track and release spot and on-demand nodes with boto3.

Every instance and its volumes carry spotrain's ownership tags (activities/ec2_ownership.py),
set atomically by `run_instances`, or by an instant EC2 Fleet and then on the volumes, and
everything here finds instances through them.

Idempotency: (job, slot, attempt) names one node. A launch first looks the slot up by tag
(moto ignores ClientToken), then launches with a ClientToken derived from the same triple
(AWS honours it), so a launch retried after a crash at any line never buys a second node.

With `placement_group` asked, nodes launch into the job's cluster placement group in their zone,
created on first use and deleted by the release that empties it (activities/ec2_placement.py).

Errors: capacity and quota codes become non-retryable `CAPACITY_ERROR` (the workflow tries the
next pool, then on-demand), credential and parameter codes `CONFIG_ERROR`; throttling and 5xx
are retried by botocore ("standard" mode) and then by Temporal. A failed call never turns
into "gone": only EC2 saying an instance is terminated (or unknown) changes membership.

Credentials and region come from boto3's standard chain; nothing secret crosses the workflow.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from itertools import zip_longest
from typing import Any, Literal

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, NoCredentialsError, PartialCredentialsError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from spotrain.activities.ec2_ownership import (
    LIVE_STATES,
    TAG_ATTEMPT,
    TAG_JOB,
    TAG_SLOT,
    client_token,
    find_instances,
    ownership_tags,
    tags_of,
)
from spotrain.activities.ec2_placement import PlacementGroups, group_of
from spotrain.activities.spot_scores import PlacementScores
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    DescribeRequest,
    LaunchRequest,
    NodeInfo,
    Offer,
    ReleaseRequest,
)
from spotrain.workflows.spec import SpotPolicy

log = logging.getLogger(__name__)

# This pool cannot serve now: the workflow tries the next pool, then on-demand.
CAPACITY_CODES = frozenset(
    {
        "InsufficientInstanceCapacity",
        "InsufficientHostCapacity",
        "InsufficientCapacity",
        "UnfulfillableCapacity",
        "SpotMaxPriceTooLow",
        "MaxSpotInstanceCountExceeded",
        "InstanceLimitExceeded",
        "VcpuLimitExceeded",
        "InsufficientFreeAddressesInSubnet",
        "Unsupported",  # the type is not offered in this zone
    }
)
# Retrying cannot help: fail the job with a clear message.
CONFIG_CODES = frozenset(
    {
        "AuthFailure",
        "UnauthorizedOperation",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "OptInRequired",
        "InvalidInstanceType.NotFound",
        "InvalidParameterValue",
        "InvalidAMIID.NotFound",
        "InvalidAMIID.Malformed",
        "InvalidLaunchTemplateName.NotFoundException",
        "InvalidSubnetID.NotFound",
        "IdempotentParameterMismatch",
    }
)
NOT_FOUND = "InvalidInstanceID.NotFound"
RECLAIM_REASON = "Server.SpotInstanceTermination"
POLL_S = 2.0
LOCAL_AMI_NAME = "al2023-ami-*-x86_64"  # listing all of moto's 1,300 images takes seconds


def _launch_mode(value: str) -> Literal["instances", "fleet"]:
    if value not in ("instances", "fleet"):
        raise ValueError(f"SPOTRAIN_EC2_LAUNCH: expected 'instances' or 'fleet', got {value!r}")
    return value  # type: ignore[return-value]


def _pairs(setting: str, key: str, value: str) -> dict[str, str]:
    """A "key=value,key=value" setting, e.g. SPOTRAIN_SUBNETS's zone=subnet-id pairs."""
    pairs = {}
    for pair in filter(None, value.split(",")):
        k, sep, v = pair.partition("=")
        if not sep:
            raise ValueError(f"{setting}: expected {key}=id, got {pair!r}")
        pairs[k.strip()] = v.strip()
    return pairs


def _zones(ec2: Any) -> dict[str, str]:
    """The region's available zones: name -> zone id (placement scores speak in ids)."""
    zones = ec2.describe_availability_zones(Filters=[{"Name": "state", "Values": ["available"]}])
    return {z["ZoneName"]: z["ZoneId"] for z in zones["AvailabilityZones"]}


def _node(instance: Mapping[str, Any]) -> NodeInfo:
    """EC2's view of an instance in the contract's terms; lifecycle from EC2, not our tag."""
    state = {"pending": "requested", "running": "ready"}.get(instance["State"]["Name"], "gone")
    reason = None
    if state == "gone":
        reclaimed = instance.get("StateReason", {}).get("Code") == RECLAIM_REASON
        reason = "reclaimed" if reclaimed else "terminated"
    return NodeInfo(
        node_id=instance["InstanceId"],
        slot=int(tags_of(instance).get(TAG_SLOT, -1)),
        lifecycle="spot" if instance.get("InstanceLifecycle") == "spot" else "on-demand",
        instance_type=instance["InstanceType"],
        zone=instance["Placement"]["AvailabilityZone"],
        state=state,
        reason=reason,
        address=instance.get("PrivateIpAddress") or "",
    )


def _log_launch(instance: Mapping[str, Any], req: LaunchRequest) -> None:
    log.info(
        "launched %s for %s slot %s (%s %s in %s)",
        instance["InstanceId"],
        req.job,
        req.slot,
        req.lifecycle,
        instance["InstanceType"],
        instance["Placement"]["AvailabilityZone"],
    )


@contextmanager
def _typed_errors() -> Iterator[None]:
    """Turn the errors the workflow acts on into typed non-retryable ApplicationErrors."""
    try:
        yield
    except ClientError as err:
        code = err.response.get("Error", {}).get("Code", "")
        message = err.response.get("Error", {}).get("Message", "")
        for kind, codes in (
            (contract.CAPACITY_ERROR, CAPACITY_CODES),
            (contract.CONFIG_ERROR, CONFIG_CODES),
        ):
            if code in codes:
                raise ApplicationError(f"{code}: {message}", type=kind, non_retryable=True) from err
        raise
    except (NoCredentialsError, PartialCredentialsError) as err:
        raise ApplicationError(
            f"no usable AWS credentials: {err}", type=contract.CONFIG_ERROR, non_retryable=True
        ) from err


class EC2Provider:
    """The node provider activities over EC2.

    `amis`: image id per region, "*" for any region (AMI ids are regional; against a local
    endpoint such as moto, a stock image when unset).
    `launch_mode`: "instances" (one `run_instances` per pool, the workflow moving from pool
    to pool), or "fleet" (an instant EC2 Fleet over all the pools at once; needs
    `launch_template`).
    `launch_template`: name of a template carrying network, user data and
    instance profile for nodes joining the cluster. `subnets`: zone -> subnet id for
    non-default VPCs. `ready_timeout_s`: a node still pending after this is terminated and the
    pool reported as out of capacity.
    """

    def __init__(
        self,
        region: str = "us-east-1",
        endpoint_url: str | None = None,
        *,
        amis: Mapping[str, str] | None = None,
        launch_template: str | None = None,
        subnets: Mapping[str, str] | None = None,
        ready_timeout_s: float = 600.0,
        max_attempts: int = 5,
        launch_mode: Literal["instances", "fleet"] = "instances",
    ) -> None:
        self.region = region
        self.launch_mode = launch_mode
        self.endpoint_url = endpoint_url
        self.amis = dict(amis or {})
        self.launch_template = launch_template
        self.subnets = dict(subnets or {})
        self.ready_timeout_s = ready_timeout_s
        self._config = Config(retries={"mode": "standard", "total_max_attempts": max_attempts})
        self._session = boto3.session.Session()
        self._clients: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._scores = PlacementScores()
        self._groups = PlacementGroups()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> EC2Provider:
        """The worker's configuration: SPOTRAIN_EC2_ENDPOINT (a local endpoint such as moto),
        SPOTRAIN_AMI (an id, or "region=ami-id,..." when the job spans regions),
        SPOTRAIN_LAUNCH_TEMPLATE, SPOTRAIN_SUBNETS ("zone=subnet-id,..."),
        SPOTRAIN_EC2_LAUNCH ("instances", the default, or "fleet").
        Region and credentials: boto3's chain (AWS_REGION, AWS_PROFILE, instance role...)."""
        ami = env.get("SPOTRAIN_AMI", "")
        amis = _pairs("SPOTRAIN_AMI", "region", ami) if "=" in ami else {"*": ami}
        return cls(
            region=boto3.session.Session().region_name or "us-east-1",
            endpoint_url=env.get("SPOTRAIN_EC2_ENDPOINT") or None,
            amis={region: image for region, image in amis.items() if image},
            launch_template=env.get("SPOTRAIN_LAUNCH_TEMPLATE") or None,
            subnets=_pairs("SPOTRAIN_SUBNETS", "zone", env.get("SPOTRAIN_SUBNETS", "")),
            launch_mode=_launch_mode(env.get("SPOTRAIN_EC2_LAUNCH") or "instances"),
        )

    def client(self, region: str | None = None) -> Any:
        """One thread-safe EC2 client per region (the CLI's `gc` uses it too)."""
        region = region or self.region
        with self._lock:
            if region not in self._clients:
                self._clients[region] = self._session.client(
                    "ec2", region_name=region, endpoint_url=self.endpoint_url, config=self._config
                )
            return self._clients[region]

    def activities(self) -> list[Callable[..., Any]]:
        self.client()  # its service model loads now, while the worker starts, not mid-job
        return [self.find_offers, self.launch_node, self.describe_nodes, self.release_nodes]

    # --- offers ------------------------------------------------------------------------------

    @activity.defn(name=contract.FIND_OFFERS)
    def find_offers(self, policy: SpotPolicy) -> list[Offer]:
        """Spot pools whose current price is within the cap, best first, spread over zones.

        Best: highest placement score (when the API has one), then lowest price per GPU.
        The list interleaves zones, so taking its first k offers puts k nodes in k zones.
        """
        if not policy.enabled:
            return []
        types = {t.name: t for t in policy.instance_types}
        offers = []
        for region in policy.regions:
            ec2 = self.client(region)
            with _typed_errors():
                zone_ids = _zones(ec2)
                zones = [z for z in policy.zones if z in zone_ids] if policy.zones else zone_ids
                prices = self._spot_prices(ec2, list(types), list(zones))
            scores = self._scores(ec2, list(types), region, zone_ids)
            offers += [
                Offer(instance_type=name, zone=zone, price=price, score=scores.get(zone))
                for (name, zone), price in prices.items()
                if price <= (policy.max_price or types[name].on_demand_price)
            ]
        offers.sort(
            key=lambda o: (-(o.score or 0.0), o.price / max(types[o.instance_type].gpus, 1))
        )
        by_zone: dict[str, list[Offer]] = {}
        for o in offers:
            by_zone.setdefault(o.zone, []).append(o)
        return [o for rnd in zip_longest(*by_zone.values()) for o in rnd if o is not None]

    @staticmethod
    def _spot_prices(ec2: Any, types: list[str], zones: list[str]) -> dict[tuple[str, str], float]:
        """Latest Linux spot price per (type, zone); pools without a price cannot serve."""
        pages = ec2.get_paginator("describe_spot_price_history").paginate(
            InstanceTypes=types,
            ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
            StartTime=datetime.now(UTC),
        )
        latest: dict[tuple[str, str], tuple[datetime, float]] = {}
        for page in pages:
            for p in page["SpotPriceHistory"]:
                key = (p["InstanceType"], p["AvailabilityZone"])
                if p["AvailabilityZone"] in zones and (
                    key not in latest or p["Timestamp"] > latest[key][0]
                ):
                    latest[key] = (p["Timestamp"], float(p["SpotPrice"]))
        return {key: price for key, (_, price) in latest.items()}

    # --- launch ------------------------------------------------------------------------------

    @activity.defn(name=contract.LAUNCH_NODE)
    def launch_node(self, req: LaunchRequest) -> NodeInfo:
        """The node for (job, slot, attempt), launched at most once, once it is running.

        A node that dies before it runs (spot reclaimed at once, pending past the timeout)
        means this pool cannot serve: CAPACITY_ERROR, and the workflow moves on.
        """
        ec2 = self.client(req.region_of(req.zone))
        launch = self._fleet if self.launch_mode == "fleet" else self._run
        with _typed_errors():
            instance = self._find_slot(ec2, req) or launch(ec2, req)
            return self._wait_ready(ec2, instance["InstanceId"])

    def _find_slot(self, ec2: Any, req: LaunchRequest) -> dict[str, Any] | None:
        """The slot's instance if an earlier try launched it (any state). Should a race have
        launched two (moto ignores ClientToken), keep the oldest and terminate the rest."""
        found = find_instances(
            ec2,
            [
                {"Name": f"tag:{TAG_JOB}", "Values": [req.job]},
                {"Name": f"tag:{TAG_SLOT}", "Values": [str(req.slot)]},
                {"Name": f"tag:{TAG_ATTEMPT}", "Values": [str(req.attempt)]},
            ],
        )
        if not found:
            return None
        keep, *extra = sorted(found, key=lambda i: (i["LaunchTime"], i["InstanceId"]))
        if extra:
            ids = [i["InstanceId"] for i in extra]
            log.warning("slot %s/%s had duplicates %s: terminating them", req.job, req.slot, ids)
            ec2.terminate_instances(InstanceIds=ids)
        return keep

    def _run(self, ec2: Any, req: LaunchRequest) -> dict[str, Any]:
        params: dict[str, Any] = {
            "InstanceType": req.instance_type,
            "MinCount": 1,
            "MaxCount": 1,
            "ClientToken": client_token(req.job, req.slot, req.attempt),
            "TagSpecifications": [
                {"ResourceType": kind, "Tags": ownership_tags(req)}
                for kind in ("instance", "volume")
            ],
        }
        zone = req.zone or min(_zones(ec2))  # on-demand may leave the zone open
        params["Placement"] = {"AvailabilityZone": zone} | self._group(ec2, req, zone, None)
        if zone in self.subnets:
            params["SubnetId"] = self.subnets[zone]
        if self.launch_template:
            params["LaunchTemplate"] = {"LaunchTemplateName": self.launch_template}
        if image := self._image(ec2):
            params["ImageId"] = image
        if req.lifecycle == "spot":  # on-demand gets no market options at all
            spot: dict[str, Any] = {
                "SpotInstanceType": "one-time",
                "InstanceInterruptionBehavior": "terminate",
            }
            if req.max_price is not None:
                spot["MaxPrice"] = f"{req.max_price:.5f}"
            params["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": spot}
        instance = ec2.run_instances(**params)["Instances"][0]
        _log_launch(instance, req)
        return instance

    def _fleet(self, ec2: Any, req: LaunchRequest) -> dict[str, Any]:
        """One node through an instant EC2 Fleet: EC2 picks, among the requested pool and its
        `fallback_pools`, the one with the most capacity at a low price
        (price-capacity-optimized), in one call instead of one call per pool."""
        if not self.launch_template:
            raise ApplicationError(
                "launching through EC2 Fleet needs a launch template: set SPOTRAIN_LAUNCH_TEMPLATE",
                type=contract.CONFIG_ERROR,
                non_retryable=True,
            )
        region = req.region_of(req.zone)  # a fleet is regional: other regions' pools stay out
        others = [(t, z) for t, z in req.fallback_pools if req.region_of(z) == region]
        pools = [(req.instance_type, req.zone or min(_zones(ec2))), *others]
        overrides = []
        for itype, zone in pools:
            override: dict[str, Any] = {"InstanceType": itype, "AvailabilityZone": zone}
            if group := self._group(ec2, req, zone, itype):
                override["Placement"] = group
            if zone in self.subnets:
                override["SubnetId"] = self.subnets[zone]
            if image := self._image(ec2):
                override["ImageId"] = image
            if req.lifecycle == "spot" and req.max_price is not None:
                override["MaxPrice"] = f"{req.max_price:.5f}"
            overrides.append(override)
        template = {"LaunchTemplateName": self.launch_template, "Version": "$Latest"}
        resp = ec2.create_fleet(
            Type="instant",
            ClientToken=client_token(req.job, req.slot, req.attempt),
            TargetCapacitySpecification={
                "TotalTargetCapacity": 1,
                "DefaultTargetCapacityType": req.lifecycle,
            },
            SpotOptions={
                "AllocationStrategy": "price-capacity-optimized",
                "InstanceInterruptionBehavior": "terminate",
            },
            OnDemandOptions={"AllocationStrategy": "lowest-price"},
            LaunchTemplateConfigs=[
                {"LaunchTemplateSpecification": template, "Overrides": overrides}
            ],
            TagSpecifications=[{"ResourceType": "instance", "Tags": ownership_tags(req)}],
        )
        ids = [i for launched in resp.get("Instances", []) for i in launched["InstanceIds"]]
        if not ids:  # an instant fleet reports what it could not launch instead of raising
            errors = resp.get("Errors") or [{"ErrorCode": "InsufficientInstanceCapacity"}]
            code, message = errors[0].get("ErrorCode", ""), errors[0].get("ErrorMessage", "")
            raise ClientError({"Error": {"Code": code, "Message": message}}, "CreateFleet")
        instance = ec2.describe_instances(InstanceIds=ids[:1])["Reservations"][0]["Instances"][0]
        volumes = [m["Ebs"]["VolumeId"] for m in instance.get("BlockDeviceMappings", [])]
        if volumes:  # a fleet tags instances only; the volumes get the same owner tags
            ec2.create_tags(Resources=volumes, Tags=ownership_tags(req))
        _log_launch(instance, req)
        return instance

    def _group(self, ec2: Any, req: LaunchRequest, zone: str, itype: str | None) -> dict[str, str]:
        """{"GroupName": the job's cluster placement group in `zone`} when the request asks for
        one and the type (`itype`, else the request's) can go in it; else {}."""
        if not req.placement_group:
            return {}
        itype = itype or req.instance_type
        group = self._groups.ensure(ec2, req.job, zone, itype, activity.heartbeat)
        return {"GroupName": group} if group else {}

    def _image(self, ec2: Any) -> str | None:
        """The region's AMI: the configured one, else the launch template's (None), else
        against a local endpoint (moto) a stock image, resolved once per region."""
        region = ec2.meta.region_name
        image = self.amis.get(region) or self.amis.get("*")
        if image or self.launch_template:
            return image
        if self.endpoint_url is None:
            raise ApplicationError(
                f"no AMI configured for {region}: set SPOTRAIN_AMI or a launch template",
                type=contract.CONFIG_ERROR,
                non_retryable=True,
            )
        images = ec2.describe_images(Filters=[{"Name": "name", "Values": [LOCAL_AMI_NAME]}])
        self.amis[region] = images["Images"][0]["ImageId"]
        return self.amis[region]

    def _wait_ready(self, ec2: Any, instance_id: str) -> NodeInfo:
        """Poll (heartbeating) until the instance runs; CAPACITY_ERROR if it never will."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            activity.heartbeat(instance_id)
            try:
                instance = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"][0][
                    "Instances"
                ][0]
            except ClientError as err:  # a fresh id may not be visible yet (eventual consistency)
                if err.response["Error"]["Code"] != NOT_FOUND:
                    raise
            else:
                node = _node(instance)
                if node.state == "ready":
                    return node
                if node.state == "gone":
                    reason = instance.get("StateReason", {}).get("Message", node.reason)
                    raise ApplicationError(
                        f"{instance_id} ended before it ran: {reason}",
                        type=contract.CAPACITY_ERROR,
                        non_retryable=True,
                    )
            if time.monotonic() > deadline:
                ec2.terminate_instances(InstanceIds=[instance_id])
                raise ApplicationError(
                    f"{instance_id} still pending after {self.ready_timeout_s:.0f}s: terminated",
                    type=contract.CAPACITY_ERROR,
                    non_retryable=True,
                )
            time.sleep(POLL_S)

    # --- track and release -------------------------------------------------------------------

    @activity.defn(name=contract.DESCRIBE_NODES)
    def describe_nodes(self, req: DescribeRequest) -> list[NodeInfo]:
        """One NodeInfo per asked id (DescribeRequest.answer): an id EC2 does not list as
        tagged with the job is gone.

        API errors raise (and are retried): a flapping API never makes a node look gone.
        """
        with _typed_errors():
            found = {i["InstanceId"]: _node(i) for _, i in self._job_instances(req)}
        return req.answer(found)

    @activity.defn(name=contract.RELEASE_NODES)
    def release_nodes(self, req: ReleaseRequest) -> list[str]:
        """Terminate the job's nodes among `node_ids` and wait until EC2 confirms they are
        shutting down. Only instances tagged with this job are touched; unknown ids are fine.
        Returns the asked ids that belong to the job (all confirmed gone), idempotently.

        Then, when one of the job's instances is in a placement group, the job's groups that
        none of its live nodes is in are deleted; one EC2 still finds in use stays for a later
        release or `spotrain gc`, without failing this one. A job without groups makes no
        placement-group call."""
        while True:
            activity.heartbeat()
            with _typed_errors():
                found = list(self._job_instances(req))
                owned = [(r, i) for r, i in found if req.asks_for(i["InstanceId"])]
                live: dict[str, list[str]] = {}
                for region, i in owned:
                    if i["State"]["Name"] in LIVE_STATES:
                        live.setdefault(region, []).append(i["InstanceId"])
                if not live:
                    break
                for region, ids in live.items():
                    self.client(region).terminate_instances(InstanceIds=ids)
            time.sleep(POLL_S / 4)
        for region in req.regions:
            mine = [i for r, i in found if r == region]
            if any(group_of(i) for i in mine):
                self._groups.tidy(self.client(region), req.job, mine, activity.heartbeat)
        return [i["InstanceId"] for _, i in owned]

    def _job_instances(
        self, req: DescribeRequest | ReleaseRequest
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(region, instance) for every instance tagged with the job, in each of its regions."""
        for region in req.regions:
            for i in find_instances(
                self.client(region), [{"Name": f"tag:{TAG_JOB}", "Values": [req.job]}]
            ):
                yield region, i
