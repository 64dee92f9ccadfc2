"""EC2 cluster placement groups: a job's nodes packed close together in its zone (issue 49).

A job with `placement_group: true` (valid with `placement: zone` only) launches its nodes into
one cluster placement group per zone, `spotrain-<job>-<zone>`: lower latency and higher
bandwidth between them, at the price of InsufficientInstanceCapacity more often (EC2 must find
room for every node in one block of its network; the workflow then tries the next pool, as for
any capacity error).

Idempotency: the name is the group's identity. A launch looks the group up by name and creates
it only when absent, tagged at creation (TagSpecifications, atomic) with the job's ownership
tags (`ec2_ownership.job_tags`, the ones its nodes carry); losing a race to create it
(InvalidPlacementGroup.Duplicate) means using the winner's. A crash at any line leaves no group
or a tagged one, which the retry reuses.

Cleanup: a release of a job one of whose instances is in a group (a job without groups makes
no placement-group call) deletes the job's groups that none of its live nodes is in, once their
last nodes have terminated (EC2 refuses to delete a group while an instance in it is shutting
down; the wait is at most DRAIN_S). A group EC2 still finds in use stays, logged, and never
fails the release: the job's next release or `spotrain gc` (`reap_groups`: groups tagged with a
job that is not running) deletes it.

Some types cannot go in a cluster group (`supports_cluster`): such a node launches without
one, logged. So does every node against an endpoint without the API (moto, under
`spotrain dev`), said once.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from botocore.parsers import ResponseParserError

from spotrain.activities.ec2_ownership import (
    LIVE_STATES,
    MANAGED,
    TAG_JOB,
    find_instances,
    job_tags,
    tags_of,
)

log = logging.getLogger(__name__)

DRAIN_S = 90.0  # at most this long a release waits for a group's last nodes to terminate
POLL_S = 2.0
USABLE = ("pending", "available")
IN_USE = "InvalidPlacementGroup.InUse"
UNKNOWN = "InvalidPlacementGroup.Unknown"
DUPLICATE = "InvalidPlacementGroup.Duplicate"
NO_API = ("NotImplemented", "InvalidAction")
# EC2's user guide: every current type may launch in a cluster placement group except the
# burstable T families (t2, t3, t3a, t4g...), Mac, and the flex families (m7i-flex...). A type
# this rule lets through that EC2 still refuses fails its launch with EC2's own error.
UNSUPPORTED_FAMILY = re.compile(r"t\d[a-z0-9]*|mac.*|.*-flex")

Beat = Callable[[], None]


def supports_cluster(instance_type: str) -> bool:
    return UNSUPPORTED_FAMILY.fullmatch(instance_type.split(".", 1)[0]) is None


def group_name(job: str, zone: str) -> str:
    """One group per job and zone: a cluster group lives in one zone, and a hop moves on."""
    return f"spotrain-{job}-{zone}"


def group_of(instance: Mapping[str, Any]) -> str | None:
    return instance.get("Placement", {}).get("GroupName") or None


def _code(err: ClientError) -> str:
    return str(err.response.get("Error", {}).get("Code", ""))


def _no_api(err: Exception) -> bool:
    """moto answers an action it lacks with an HTML error page (a parser error here)."""
    return isinstance(err, ResponseParserError) or (
        isinstance(err, ClientError) and _code(err) in NO_API
    )


def describe(ec2: Any, name: str) -> dict[str, Any] | None:
    """The group of that name (a filter: an unknown name is no error), or None."""
    found = ec2.describe_placement_groups(Filters=[{"Name": "group-name", "Values": [name]}])
    return next((g for g in found["PlacementGroups"] if g["GroupName"] == name), None)


def find(ec2: Any, job: str | None = None) -> list[dict[str, Any]]:
    """spotrain's usable groups (tagged `spotrain:managed`), only `job`'s when given."""
    filters = [
        {"Name": f"tag:{MANAGED}", "Values": ["true"]},
        {"Name": "state", "Values": list(USABLE)},
    ]
    if job is not None:
        filters.append({"Name": f"tag:{TAG_JOB}", "Values": [job]})
    return list(ec2.describe_placement_groups(Filters=filters)["PlacementGroups"])


def delete(ec2: Any, name: str) -> str:
    """Delete a group: "deleted" (or already gone), or "in use" (EC2 still finds instances in
    it: a later release or gc deletes it). Other errors raise."""
    try:
        ec2.delete_placement_group(GroupName=name)
    except ClientError as err:
        if _code(err) == IN_USE:
            log.info("placement group %s still in use: left for a later release or gc", name)
            return "in use"
        if _code(err) != UNKNOWN:
            raise
    log.info("deleted placement group %s", name)
    return "deleted"


class PlacementGroups:
    """One provider's placement groups; `explained`: the endpoint's lack of them said once."""

    def __init__(self) -> None:
        self.explained = False

    def ensure(self, ec2: Any, job: str, zone: str, instance_type: str, beat: Beat) -> str | None:
        """The group a node of `job` in `zone` launches into, created if absent; None (said
        why) for a type that cannot go in one, or an endpoint without groups."""
        if not supports_cluster(instance_type):
            log.info(
                "%s cannot launch in a cluster placement group: %s's node in %s goes without",
                instance_type,
                job,
                zone,
            )
            return None
        try:
            return self._ensure(ec2, job, group_name(job, zone), beat)
        except (ClientError, ResponseParserError) as err:
            if not _no_api(err):
                raise
            if not self.explained:
                self.explained = True
                log.info("this EC2 endpoint has no placement groups: nodes launch without")
            return None

    @staticmethod
    def _ensure(ec2: Any, job: str, name: str, beat: Beat) -> str | None:
        deadline = time.monotonic() + DRAIN_S
        while True:
            group = describe(ec2, name)
            state = group["State"] if group else "deleted"
            if state in USABLE:
                return name
            if state == "deleted":
                tags = [*job_tags(job), {"Key": "Name", "Value": name}]
                try:
                    ec2.create_placement_group(
                        GroupName=name,
                        Strategy="cluster",
                        TagSpecifications=[{"ResourceType": "placement-group", "Tags": tags}],
                    )
                except ClientError as err:
                    if _code(err) != DUPLICATE:  # else a concurrent try made it: look again
                        raise
                else:
                    log.info("created cluster placement group %s", name)
                    return name
            if time.monotonic() > deadline:  # still being deleted (a release emptied it)
                log.warning("placement group %s is %s: the node launches without", name, state)
                return None
            beat()
            time.sleep(POLL_S)

    def tidy(self, ec2: Any, job: str, instances: list[dict[str, Any]], beat: Beat) -> list[str]:
        """After a release: delete the job's groups that none of its live `instances` is in,
        once their last ones have terminated. Never raises an API error (the release is done;
        what stays is deleted by a later release or gc). Returns the names deleted."""
        deleted = []
        try:
            for group in find(ec2, job):
                name = group["GroupName"]
                members = [i for i in instances if group_of(i) == name]
                if any(i["State"]["Name"] in LIVE_STATES for i in members):
                    continue
                self._drain(ec2, [i["InstanceId"] for i in members], beat)
                if delete(ec2, name) == "deleted":
                    deleted.append(name)
        except (ClientError, BotoCoreError, ResponseParserError) as err:
            if not _no_api(err):
                reason = str(err).splitlines()[0][:160]
                log.warning("placement groups of %s left for gc: %s", job, reason)
        return deleted

    @staticmethod
    def _drain(ec2: Any, ids: list[str], beat: Beat) -> None:
        """Wait (at most DRAIN_S) until the instances `ids` have terminated."""
        deadline = time.monotonic() + DRAIN_S
        filters = [{"Name": "instance-id", "Values": ids}]
        while ids and time.monotonic() < deadline:
            beat()
            if all(i["State"]["Name"] == "terminated" for i in find_instances(ec2, filters)):
                return
            time.sleep(POLL_S)


# --- gc: the groups behind `spotrain gc` ----------------------------------------------------


@dataclass(frozen=True)
class OrphanGroup:
    """A spotrain-tagged placement group whose job is not running. `state`: the group's, or
    after an applied gc "deleted" or "in use" (its nodes still shutting down: the next gc)."""

    name: str
    job: str
    state: str


def reap_groups(
    ec2: Any, is_job_running: Callable[[str], bool], apply: bool = False, job: str | None = None
) -> list[OrphanGroup]:
    """Groups whose job is closed or unknown (`is_job_running` False, asked once per job; if it
    raises, nothing is deleted), or that name no job; only `job`'s when given. Deleted only
    when `apply`: the default is a dry run."""
    try:
        groups = find(ec2, job)
    except (ClientError, ResponseParserError) as err:
        if not _no_api(err):
            raise
        log.info("gc: this EC2 endpoint has no placement groups")
        return []
    running: dict[str, bool] = {}
    orphans = []
    for group in groups:
        owner = tags_of(group).get(TAG_JOB, "")
        if owner and owner not in running:
            running[owner] = is_job_running(owner)
        if not running.get(owner, False):
            orphans.append(OrphanGroup(group["GroupName"], owner, group["State"]))
    if apply:
        orphans = [OrphanGroup(o.name, o.job, delete(ec2, o.name)) for o in orphans]
    names = [o.name for o in orphans]
    log.info(
        "gc: %d orphan placement group(s)%s: %s", len(names), "" if apply else " (dry run)", names
    )
    return orphans
