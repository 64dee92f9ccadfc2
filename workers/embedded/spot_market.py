"""The embedded stack's spot market: it takes nodes back the way EC2 does.

Capacity can follow a recorded spot trace (`follow`, the format of `../shared/traces/`):
launches beyond a zone's capacity fail with InsufficientInstanceCapacity, and when capacity
falls the newest spot nodes in that zone are reclaimed. moto has no capacity model of its own;
this market adds one to the moto server running in this process.

A reclaim with notice sends the "EC2 Spot Instance Interruption Warning" to the webhook as the
EventBridge event AWS would send; at the deadline the instance is terminated in moto with
EC2's reason `Server.SpotInstanceTermination`, and the node's worker processes die with it
(a real node's would). Without notice both happen at once, followed by the "EC2 Instance
State-change Notification". The job learns of it only through the webhook, like on AWS.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from moto.core import DEFAULT_ACCOUNT_ID
from moto.core.responses import ActionResult
from moto.ec2 import models
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.models.instances import StateReason
from moto.ec2.responses import EC2Response

from spotrain.activities.ec2_ownership import TAG_JOB
from spotrain.activities.local import LocalRuntime

RECLAIM_REASON = (
    "Server.SpotInstanceTermination: Spot instance termination",
    "Server.SpotInstanceTermination",
)
log = logging.getLogger("spotrain.spot_market")


ZONE_IN_NAME = re.compile(r"[a-z]{2}-[a-z]+-\d[a-z]")


@dataclass(frozen=True)
class Trace:
    """Spot capacity of one zone over time (nodes per tick); past its end it repeats."""

    zone: str
    gap_s: float
    data: tuple[int, ...]

    @classmethod
    def load(cls, arg: str) -> Trace:
        """`ZONE=PATH` or `PATH` (the zone is read from the file name, e.g. us-east-2b)."""
        zone, _, path = arg.rpartition("=")
        found = ZONE_IN_NAME.search(Path(path).name)
        zone = zone or (found.group(0) if found else Path(path).stem)
        doc = json.loads(Path(path).read_text())
        data = tuple(int(n) for n in doc["data"])
        if not data:
            raise ValueError(f"{path}: empty trace")
        return cls(zone=zone, gap_s=float(doc["metadata"]["gap_seconds"]), data=data)

    @property
    def span_s(self) -> float:
        return self.gap_s * len(self.data)

    def at(self, offset_s: float) -> int:
        return self.data[int(offset_s // self.gap_s) % len(self.data)]

    def drops(self, until_s: float) -> list[float]:
        """Offsets (s) of the ticks where capacity falls, up to `until_s`."""
        out = []
        for k in range(1, int(until_s // self.gap_s) + 1):
            if self.data[k % len(self.data)] < self.data[(k - 1) % len(self.data)]:
                out.append(k * self.gap_s)
        return out


def _backend(region: str) -> Any:
    return models.ec2_backends[DEFAULT_ACCOUNT_ID][region]


def terminate_as_reclaimed(instance_id: str, region: str = "us-east-1") -> str | None:
    """Terminate in moto's backend (same process) as a spot interruption; returns its job."""
    instance = _backend(region).get_instance(instance_id)
    instance.terminate()
    instance.state_reason = StateReason(*RECLAIM_REASON)
    return next((t["value"] for t in instance.get_tags() if t["key"] == TAG_JOB), None)


def aws_event(
    detail_type: str, instance_id: str, detail: dict[str, str], region: str
) -> dict[str, object]:
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": detail_type,
        "source": "aws.ec2",
        "account": DEFAULT_ACCOUNT_ID,
        "time": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "resources": [f"arn:aws:ec2:{region}:{DEFAULT_ACCOUNT_ID}:instance/{instance_id}"],
        "detail": {"instance-id": instance_id, **detail},
    }


class SpotMarket:
    def __init__(
        self, webhook_url: str, token: str, runtime: LocalRuntime, region: str = "us-east-1"
    ) -> None:
        self.webhook_url = webhook_url.rstrip("/")
        self.token = token
        self.runtime = runtime
        self.region = region
        self.capacity: dict[str, int] = {}  # zone -> spot nodes it can hold now (traced zones)
        self._serve_placement_scores()

    async def _post(self, event: dict[str, object]) -> None:
        async with aiohttp.ClientSession() as http:
            for attempt in range(5):  # as EventBridge does: retry until the webhook accepts
                try:
                    async with http.post(
                        f"{self.webhook_url}/v1/events/aws",
                        data=json.dumps(event),
                        headers={
                            "Authorization": f"Bearer {self.token}",
                            "Content-Type": "application/json",
                        },
                    ) as resp:
                        if resp.status < 500:
                            return
                except aiohttp.ClientError as err:
                    log.warning("webhook unreachable (%s), retrying", err)
                await asyncio.sleep(0.5 * 2**attempt)

    def _take(self, instance_id: str) -> None:
        job = terminate_as_reclaimed(instance_id, self.region)
        if job:
            self.runtime.kill_node(job, instance_id)

    async def reclaim(self, instance_id: str, notice_s: float | None = 120.0) -> None:
        """Reclaim one node, with `notice_s` seconds of warning (None: no warning at all)."""
        if notice_s is not None:
            await self._post(
                aws_event(
                    "EC2 Spot Instance Interruption Warning",
                    instance_id,
                    {"instance-action": "terminate"},
                    self.region,
                )
            )
            await asyncio.sleep(notice_s)
        self._take(instance_id)
        await self._post(
            aws_event(
                "EC2 Instance State-change Notification",
                instance_id,
                {"state": "terminated"},
                self.region,
            )
        )

    def spot_nodes(self, zone: str) -> list[Any]:
        """Running spot instances in `zone`, oldest first."""
        running = [
            i
            for i in _backend(self.region).all_instances()
            if i.lifecycle == "spot" and i.availability_zone == zone and i.state == "running"
        ]
        return sorted(running, key=lambda i: i.launch_time)

    def _limit_launches(self) -> None:
        """Spot launches into a traced zone that is full fail as EC2 says so."""
        original = models.EC2Backend.run_instances
        if getattr(original, "spot_market", None) is self:
            return
        market = self

        def limited(backend: Any, *args: Any, **kwargs: Any) -> Any:
            zone = kwargs.get("placement")
            full = zone in market.capacity and len(market.spot_nodes(zone)) >= market.capacity[zone]
            if kwargs.get("instance_market_options") and full:
                raise EC2ClientError("InsufficientInstanceCapacity", f"no spot capacity in {zone}")
            return original(backend, *args, **kwargs)

        limited.spot_market = market  # type: ignore[attr-defined]
        models.EC2Backend.run_instances = limited  # type: ignore[method-assign]

    def placement_score(self, zone: str, target: int) -> int:
        """EC2's 1-10 likelihood that `target` spot nodes launch in `zone`: 10 where the zone
        has room (untraced zones always do), 1 where the trace has it full."""
        if zone not in self.capacity:
            return 10
        return 10 if self.capacity[zone] - len(self.spot_nodes(zone)) >= target else 1

    def _serve_placement_scores(self) -> None:
        """Answer GetSpotPlacementScores (which moto does not implement) from this market's
        capacity, so the offers rank as EC2 would rank them."""
        market = self

        def scores(response: Any) -> ActionResult:
            target = response._get_int_param("TargetCapacity", 1)
            items = [
                {
                    "Region": region,
                    "AvailabilityZoneId": zone.zone_id,
                    "Score": market.placement_score(zone.name, target),
                }
                for region in response._get_param("RegionNames", []) or [market.region]
                for zone in _backend(region).describe_availability_zones()
            ]
            return ActionResult({"SpotPlacementScores": items})

        scores.spot_market = market  # type: ignore[attr-defined]
        EC2Response.get_spot_placement_scores = scores  # type: ignore[attr-defined]

    def close(self) -> None:
        """Hand GetSpotPlacementScores back to moto (the answer is per process, not per server)."""
        ours = getattr(EC2Response, "get_spot_placement_scores", None)
        if getattr(ours, "spot_market", None) is self:
            del EC2Response.get_spot_placement_scores  # type: ignore[attr-defined]

    async def follow(self, trace: Trace, speedup: float = 60.0, notice_s: float = 20.0) -> None:
        """Make `trace.zone`'s spot capacity follow the trace, `speedup` times faster than
        recorded; nodes above a falling capacity are reclaimed, newest first, with notice."""
        self._limit_launches()
        loop = asyncio.get_running_loop()
        start, taken, reclaims = loop.time(), set[str](), set[asyncio.Task[None]]()
        try:
            while True:
                self.capacity[trace.zone] = allowed = trace.at((loop.time() - start) * speedup)
                nodes = [i for i in self.spot_nodes(trace.zone) if i.id not in taken]
                for instance in nodes[allowed:]:
                    taken.add(instance.id)
                    log.warning(
                        "trace: %s holds %d, reclaiming %s", trace.zone, allowed, instance.id
                    )
                    task = asyncio.create_task(self.reclaim(instance.id, notice_s))
                    reclaims.add(task)
                    task.add_done_callback(reclaims.discard)
                await asyncio.sleep(min(trace.gap_s / speedup, 1.0))
        finally:  # the zone is no longer limited
            self.capacity.pop(trace.zone, None)
            for task in reclaims:
                task.cancel()
