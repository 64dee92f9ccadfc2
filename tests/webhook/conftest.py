"""The webhook tests' fixtures: a recording worker, the webhook service, an SQS queue fed by
EventBridge rules (tests/webhook/webhook_support.py has the rest)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import boto3
import pytest
import pytest_asyncio
from temporalio.testing import WorkflowEnvironment

from tests.webhook.webhook_support import (
    EVENTBRIDGE,
    Jobs,
    Webhook,
    recording_worker,
    running_webhook,
)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def jobs(dev_env: WorkflowEnvironment) -> AsyncIterator[Jobs]:
    async with recording_worker(dev_env.client) as recording:
        yield recording


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def hook(dev_env: WorkflowEnvironment) -> AsyncIterator[Webhook]:
    async with running_webhook(dev_env.client) as webhook:
        yield webhook


@pytest.fixture
def queue(moto_endpoint: str) -> tuple[Any, str]:
    """An SQS queue fed by EventBridge rules with infra/aws/eventbridge's event patterns."""
    sqs = boto3.client("sqs", endpoint_url=moto_endpoint, region_name="us-east-1")
    events = boto3.client("events", endpoint_url=moto_endpoint, region_name="us-east-1")
    name = f"reclaims-{uuid.uuid4().hex[:8]}"
    url = sqs.create_queue(QueueName=name)["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]
    for pattern in sorted((EVENTBRIDGE / "patterns").glob("*.json")):
        rule = f"{name}-{pattern.stem}"
        events.put_rule(Name=rule, EventPattern=pattern.read_text())
        events.put_targets(Rule=rule, Targets=[{"Id": "q", "Arn": arn["QueueArn"]}])
    return sqs, url
