"""How spotrain marks the EC2 instances it owns, finds them again, and reaps the orphans.

Every instance carries ownership tags (on the instance and its volumes):

    spotrain:managed=true  spotrain:job  spotrain:generation  spotrain:slot
    spotrain:attempt       spotrain:lifecycle

(job, slot, attempt) names one node: the provider (activities/ec2.py) looks a slot up by these
tags before it launches, and launches with a `client_token` derived from the same triple.
`find_orphans` / `reap` back `spotrain gc`: they terminate tagged instances whose job is not
running, so a bug can never leave money burning. They live here, apart from the provider's
activities, because tags are all they need.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from spotrain.workflows.contract import LaunchRequest

log = logging.getLogger(__name__)

MANAGED = "spotrain:managed"
TAG_JOB = "spotrain:job"
TAG_GENERATION = "spotrain:generation"
TAG_SLOT = "spotrain:slot"
TAG_ATTEMPT = "spotrain:attempt"
TAG_LIFECYCLE = "spotrain:lifecycle"
LIVE_STATES = ("pending", "running", "stopping", "stopped")


def client_token(job: str, slot: int, attempt: int) -> str:
    """Stable across retries of one launch, distinct per (job, slot, attempt); max 64 chars."""
    digest = hashlib.sha256(f"{job}/{slot}/{attempt}".encode()).hexdigest()
    return f"spotrain-{digest[:48]}"


def job_tags(job: str) -> list[dict[str, str]]:
    """Whose it is: the tags gc and release find a job's resources by, the same on its nodes,
    their volumes and its placement groups (activities/ec2_placement.py)."""
    return [{"Key": MANAGED, "Value": "true"}, {"Key": TAG_JOB, "Value": job}]


def ownership_tags(req: LaunchRequest) -> list[dict[str, str]]:
    """The tags every node and its volumes carry: whose it is, for which slot and attempt."""
    return [
        *job_tags(req.job),
        {"Key": TAG_GENERATION, "Value": str(req.generation)},
        {"Key": TAG_SLOT, "Value": str(req.slot)},
        {"Key": TAG_ATTEMPT, "Value": str(req.attempt)},
        {"Key": TAG_LIFECYCLE, "Value": req.lifecycle},
        {"Key": "Name", "Value": f"spotrain-{req.job}-{req.slot}"},
    ]


def tags_of(resource: Mapping[str, Any]) -> dict[str, str]:
    """An instance's or volume's tags as a dict."""
    return {t["Key"]: t["Value"] for t in resource.get("Tags", [])}


def find_instances(ec2: Any, filters: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All instances matching server-side `filters` (tag and state filters only: moto does not
    implement `instance-lifecycle` or `client-token`)."""
    pages = ec2.get_paginator("describe_instances").paginate(Filters=filters)
    return [i for page in pages for r in page["Reservations"] for i in r["Instances"]]


# --- gc: the reaper behind `spotrain gc` ---------------------------------------------------


@dataclass(frozen=True)
class Orphan:
    """A spotrain-tagged live instance whose job is not running."""

    instance_id: str
    job: str
    state: str
    instance_type: str
    zone: str
    launched: datetime


def find_orphans(
    ec2: Any, is_job_running: Callable[[str], bool], job: str | None = None
) -> list[Orphan]:
    """Live spotrain instances whose job is closed or unknown (`is_job_running` False), or that
    name no job; only `job`'s when it is given. `is_job_running` is asked once per job; if it
    raises, nothing is reaped."""
    running: dict[str, bool] = {}
    orphans = []
    filters = [
        {"Name": f"tag:{MANAGED}", "Values": ["true"]},
        {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
    ]
    if job is not None:
        filters.append({"Name": f"tag:{TAG_JOB}", "Values": [job]})
    for i in find_instances(ec2, filters):
        job = tags_of(i).get(TAG_JOB, "")
        if job and job not in running:
            running[job] = is_job_running(job)
        if not running.get(job, False):
            orphans.append(
                Orphan(
                    instance_id=i["InstanceId"],
                    job=job,
                    state=i["State"]["Name"],
                    instance_type=i["InstanceType"],
                    zone=i["Placement"]["AvailabilityZone"],
                    launched=i["LaunchTime"],
                )
            )
    return orphans


def reap(
    ec2: Any, is_job_running: Callable[[str], bool], apply: bool = False, job: str | None = None
) -> list[Orphan]:
    """Find orphans (of `job` only, when given) and, only when `apply`, terminate them. Returns
    what was (or would be) reaped; the default is a dry run that changes nothing."""
    orphans = find_orphans(ec2, is_job_running, job)
    ids = [o.instance_id for o in orphans]
    if apply:
        for start in range(0, len(ids), 500):
            ec2.terminate_instances(InstanceIds=ids[start : start + 500])
    log.info("gc: %d orphan(s)%s: %s", len(ids), "" if apply else " (dry run)", ids)
    return orphans
