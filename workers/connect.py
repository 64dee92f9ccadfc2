"""One way to reach Temporal for every spotrain process: the SDK's standard settings."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfig

TASK_QUEUE = "spotrain"


async def connect() -> Client:
    """Connect with TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TLS settings and
    config profiles (TEMPORAL_PROFILE), defaulting to localhost:7233; the pydantic converter
    matches the workflow's."""
    settings: dict[str, Any] = {"target_host": "localhost:7233"}
    settings.update(ClientConfig.load_client_connect_config())
    return await Client.connect(**settings, data_converter=pydantic_data_converter)
