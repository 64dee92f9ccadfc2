"""EC2 spot placement scores (1-10 per zone), which refine the order of spot offers where the
endpoint has them. They are optional: without them offers rank by price, and the reason is
said once (quietly where the endpoint lacks the API, as moto does; as a warning where a
permission is missing or the call fails)."""

from __future__ import annotations

import logging
from typing import Any

from botocore.exceptions import ClientError
from botocore.parsers import ResponseParserError

log = logging.getLogger(__name__)
REFUSED = ("UnauthorizedOperation", "AccessDenied", "AccessDeniedException")


class PlacementScores:
    """One provider's scores lookup: zone -> score, or {} (and the reason said once)."""

    def __init__(self) -> None:
        self.explained = False

    def __call__(
        self, ec2: Any, types: list[str], region: str, zone_ids: dict[str, str]
    ) -> dict[str, float]:
        zone_names = {zone_id: name for name, zone_id in zone_ids.items()}
        try:
            resp = ec2.get_spot_placement_scores(
                InstanceTypes=types,
                TargetCapacity=1,
                SingleAvailabilityZone=True,
                RegionNames=[region],
            )
        except Exception as err:  # optional data: any failure means "no scores"
            if not self.explained:
                self.explained = True
                explain(err)
            return {}
        return {
            zone_names[s["AvailabilityZoneId"]]: float(s["Score"])
            for s in resp.get("SpotPlacementScores", [])
            if s.get("AvailabilityZoneId") in zone_names
        }


def explain(err: Exception) -> None:
    """Why there are no scores. moto answers the unimplemented call with an HTML error page
    (a parser error here): that endpoint has no scores, which is no fault."""
    code = err.response["Error"].get("Code", "") if isinstance(err, ClientError) else ""
    if isinstance(err, ResponseParserError) or code in ("NotImplemented", "InvalidAction"):
        log.info("this EC2 endpoint has no spot placement scores: offers rank by price")
    elif code in REFUSED:
        log.warning(
            "spot placement scores refused (%s): grant ec2:GetSpotPlacementScores "
            "(infra/aws/iam-policy.json); offers rank by price meanwhile",
            code,
        )
    else:
        reason = str(err).splitlines()[0][:120]  # not an endpoint's whole error page
        log.warning("spot placement scores unavailable, offers rank by price: %s", reason)
