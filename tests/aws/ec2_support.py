"""Fault injection into moto's EC2 backend, and the requests and lookups the EC2 provider
tests share.

moto never runs out of capacity, throttles or fails on its own. Its ThreadedMotoServer runs
in this process, so patching `moto.ec2.models.EC2Backend` here changes what the server on the
loopback port answers: boto3 still sees real HTTP errors (400 with an EC2 error code, or 503).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import pytest
from moto.ec2 import models
from moto.ec2.exceptions import EC2ClientError
from temporalio.client import WorkflowHandle
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker
from werkzeug.exceptions import HTTPException

from spotrain.activities.ec2 import EC2Provider
from spotrain.activities.ec2_ownership import find_instances
from spotrain.workers.embedded.spot_market import terminate_as_reclaimed
from spotrain.workers.worker import WORKFLOWS
from spotrain.workflows.contract import LaunchRequest, NodeInfo
from spotrain.workflows.job.state import JobResult
from spotrain.workflows.spec import InstanceType, SpotPolicy
from tests.jobs import fast_runtime

ENV = ActivityEnvironment()


class ServiceUnavailable(HTTPException):
    """A 503 with an EC2 error body, as AWS sends under load (botocore retries it)."""

    code = 503
    description = (
        "<Response><Errors><Error><Code>Unavailable</Code>"
        "<Message>The service is unavailable.</Message></Error></Errors>"
        "<RequestID>spotrain-test</RequestID></Response>"
    )


def ec2_error(code: str) -> Callable[[], Exception]:
    """An EC2 API error with `code` (moto serializes it as HTTP 400, like AWS does)."""
    return lambda: EC2ClientError(code, f"injected {code}")


def inject(
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    error: Callable[[], Exception],
    when: Callable[[dict[str, Any]], bool],
) -> list[str]:
    """Make moto's `EC2Backend.<method>` raise `error()` whenever `when(kwargs)` is true.
    Returns a list that grows by the method name each time an error was injected."""
    original = getattr(models.EC2Backend, method)
    injected: list[str] = []

    def faulty(self: Any, *args: Any, **kwargs: Any) -> Any:
        if when(kwargs):
            injected.append(method)
            raise error()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(models.EC2Backend, method, faulty)
    return injected


def first_n(n: int) -> Callable[[dict[str, Any]], bool]:
    """True for the first `n` calls, then never again."""
    calls = iter(range(n))
    return lambda _kwargs: next(calls, None) is not None


def reclaim(instance_id: str, region: str = "us-east-1") -> None:
    """What a spot interruption looks like afterwards: terminated, with EC2's reclaim reason
    (the embedded stack's spot market does exactly this)."""
    terminate_as_reclaimed(instance_id, region)


# --- requests and lookups -----------------------------------------------------------------


def spot(job: str, slot: int = 0, **kw: Any) -> LaunchRequest:
    fields: dict[str, Any] = {
        "job": job,
        "slot": slot,
        "attempt": 0,
        "generation": 1,
        "lifecycle": "spot",
        "instance_type": "p3.2xlarge",
        "zone": "us-east-1b",
        "max_price": 1.5,
    } | kw
    return LaunchRequest(**fields)


def launch(provider: EC2Provider, req: LaunchRequest) -> NodeInfo:
    return ENV.run(provider.launch_node, req)


def job_instances(provider: EC2Provider, job: str) -> list[dict[str, Any]]:
    return find_instances(provider.client(), [{"Name": "tag:spotrain:job", "Values": [job]}])


def live(provider: EC2Provider, job: str) -> list[str]:
    return [
        i["InstanceId"]
        for i in job_instances(provider, job)
        if i["State"]["Name"] in {"pending", "running"}
    ]


def policy(**kw: Any) -> SpotPolicy:
    fields: dict[str, Any] = {
        "instance_types": [
            InstanceType(name="g5.xlarge", gpus=1, on_demand_price=1.0),
            InstanceType(name="g4dn.12xlarge", gpus=4, on_demand_price=3.912),
        ],
        "zones": ["us-east-1a", "us-east-1b", "us-east-1c"],
    } | kw
    return SpotPolicy(**fields)


@asynccontextmanager
async def ec2_job(
    env: WorkflowEnvironment, provider: EC2Provider, spec: dict[str, Any], queue: str
) -> AsyncIterator[WorkflowHandle[Any, JobResult]]:
    """A TrainingJob started on a worker with the EC2 provider and the simulated runtime."""
    with ThreadPoolExecutor(8) as pool:
        async with Worker(
            env.client,
            task_queue=queue,
            workflows=WORKFLOWS,
            activities=provider.activities() + fast_runtime().activities(),
            activity_executor=pool,
        ):
            yield await env.client.start_workflow(
                "TrainingJob", spec, id=spec["name"], task_queue=queue, result_type=JobResult
            )
