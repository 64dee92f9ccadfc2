"""The embedded stack's spot market: it takes nodes back the way EC2 does.

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
import uuid
from datetime import UTC, datetime

import aiohttp
from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2 import models
from moto.ec2.models.instances import StateReason

from spotrain.activities.ec2 import TAG_JOB
from spotrain.activities.local import LocalRuntime

RECLAIM_REASON = (
    "Server.SpotInstanceTermination: Spot instance termination",
    "Server.SpotInstanceTermination",
)
log = logging.getLogger("spotrain.spot_market")


def terminate_as_reclaimed(instance_id: str, region: str = "us-east-1") -> str | None:
    """Terminate in moto's backend (same process) as a spot interruption; returns its job."""
    instance = models.ec2_backends[DEFAULT_ACCOUNT_ID][region].get_instance(instance_id)
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
