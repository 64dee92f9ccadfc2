"""Fixtures of the EC2 provider tests (moto's server is the session's, tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest

from spotrain.activities.ec2 import EC2Provider


@pytest.fixture(scope="module")
def provider(moto_endpoint: str) -> EC2Provider:
    """Shared: creating an EC2 client loads botocore's EC2 model, about a second each."""
    return EC2Provider(endpoint_url=moto_endpoint)


@pytest.fixture(scope="module")
def impatient(moto_endpoint: str) -> EC2Provider:
    """botocore gives up after 2 attempts, so injected faults reach the caller."""
    return EC2Provider(endpoint_url=moto_endpoint, max_attempts=2)


@pytest.fixture
def job() -> str:
    """A fresh job name per test: the moto server is shared by the whole session."""
    return f"job-{uuid.uuid4().hex[:8]}"
