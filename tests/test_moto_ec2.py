"""The tests' moto made to match EC2 (tests/moto_ec2.py)."""

from __future__ import annotations

import boto3

from tests.moto_ec2 import forget_terminated_instances


def test_terminated_instances_are_forgotten_and_live_ones_kept(moto_endpoint: str) -> None:
    ec2 = boto3.client("ec2", region_name="us-east-1", endpoint_url=moto_endpoint)
    tags = [{"ResourceType": "instance", "Tags": [{"Key": "forget-test", "Value": "yes"}]}]
    launched = ec2.run_instances(
        ImageId="ami-12c6146b", MinCount=3, MaxCount=3, TagSpecifications=tags
    )
    ids = [i["InstanceId"] for i in launched["Instances"]]
    ec2.terminate_instances(InstanceIds=ids[:2])

    assert forget_terminated_instances() >= 2

    listed = ec2.describe_instances(Filters=[{"Name": "tag:forget-test", "Values": ["yes"]}])
    assert [i["InstanceId"] for r in listed["Reservations"] for i in r["Instances"]] == ids[2:]
    ec2.terminate_instances(InstanceIds=ids[2:])
