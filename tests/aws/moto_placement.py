"""Cluster placement groups for moto's EC2 server, which has none (moto 5.2 answers them with
an HTML error page): CreatePlacementGroup, DescribePlacementGroups and DeletePlacementGroup,
with EC2's errors, and RunInstances honouring `Placement.GroupName`.

EC2's behaviour copied here: names are unique per region (InvalidPlacementGroup.Duplicate);
launching into an unknown group fails (InvalidPlacementGroup.Unknown), and so does a burstable
type (InvalidParameterCombination); an instance in a group reports it in
describe_instances' `Placement.GroupName`; a group an instance that is not terminated is in
cannot be deleted (InvalidPlacementGroup.InUse). moto's ThreadedMotoServer runs in this
process, so `installed()` changes what the server on the loopback port answers, and undoes it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from moto.core.responses import ActionResult, EmptyResult
from moto.ec2.exceptions import EC2ClientError
from moto.ec2.responses import EC2Response
from moto.ec2.responses.instances import InstanceResponse

IDS = itertools.count(1)


def groups(backend: Any) -> dict[str, dict[str, Any]]:
    """One region's groups by name (kept on moto's backend for that region)."""
    found: dict[str, dict[str, Any]] = backend.__dict__.setdefault("_placement_groups", {})
    return found


def unknown(name: str) -> EC2ClientError:
    return EC2ClientError(
        "InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown."
    )


def members(backend: Any, name: str) -> list[Any]:
    """The instances in the group that are not terminated."""
    return [
        i
        for r in backend.reservations.values()
        for i in r.instances
        if i.placement.group_name == name and i.state != "terminated"
    ]


def matches(group: dict[str, Any], filters: dict[str, list[str]]) -> bool:
    tags = {t["Key"]: t["Value"] for t in group["Tags"]}
    for name, values in filters.items():
        if name.startswith("tag:"):
            value = tags.get(name[4:])
        else:
            field = {"group-name": "GroupName", "state": "State", "strategy": "Strategy"}
            if name not in field:
                raise EC2ClientError("InvalidParameterValue", f"The filter '{name}' is invalid")
            value = group[field[name]]
        if value not in values:
            return False
    return True


def create_placement_group(self: EC2Response) -> ActionResult:
    name, strategy = self._get_param("GroupName"), self._get_param("Strategy")
    found = groups(self.ec2_backend)
    if name in found:
        raise EC2ClientError(
            "InvalidPlacementGroup.Duplicate", f"The Placement Group '{name}' already exists."
        )
    tags = self._parse_tag_specification("placement-group").get("placement-group", {})
    found[name] = {
        "GroupName": name,
        "GroupId": f"pg-{next(IDS):017x}",
        "State": "available",
        "Strategy": strategy,
        "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
    }
    return ActionResult({"PlacementGroup": found[name]})


def describe_placement_groups(self: EC2Response) -> ActionResult:
    found = groups(self.ec2_backend)
    names = self._get_param("GroupNames", [])
    for name in names:
        if name not in found:
            raise unknown(name)
    filters = self._filters_from_querystring()
    listed = [g for n, g in found.items() if (not names or n in names) and matches(g, filters)]
    return ActionResult({"PlacementGroups": listed})


def delete_placement_group(self: EC2Response) -> ActionResult:
    name = self._get_param("GroupName")
    found = groups(self.ec2_backend)
    if name not in found:
        raise unknown(name)
    if members(self.ec2_backend, name):
        raise EC2ClientError(
            "InvalidPlacementGroup.InUse", f"The placement group '{name}' is in use."
        )
    del found[name]
    return EmptyResult()


@contextmanager
def installed() -> Iterator[None]:
    """moto's EC2 with placement groups while inside; as it was after."""
    launch = InstanceResponse.run_instances  # (the session's, which honours ClientTokens)

    def run_instances(self: InstanceResponse) -> ActionResult:
        name = self._get_param("Placement.GroupName")
        if name:
            group = groups(self.ec2_backend).get(name)
            if group is None or group["State"] != "available":
                raise unknown(name)
            itype = self._get_param("InstanceType", "m1.small")
            if itype.startswith(("t2.", "t3.", "t3a.", "t4g.")):
                raise EC2ClientError(
                    "InvalidParameterCombination",
                    f"The instance type {itype} is not supported in a cluster placement group.",
                )
        result = launch(self)
        if name:
            for instance in result.result.instances:  # type: ignore[attr-defined]
                instance.placement.group_name = name
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(InstanceResponse, "run_instances", run_instances)
        for action in (create_placement_group, describe_placement_groups, delete_placement_group):
            patch.setattr(EC2Response, action.__name__, action, raising=False)
        yield
