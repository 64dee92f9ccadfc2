"""Fault injection into moto's EC2 backend, for the EC2 provider tests.

moto never runs out of capacity, throttles or fails on its own. Its ThreadedMotoServer runs
in this process, so patching `moto.ec2.models.EC2Backend` here changes what the server on the
loopback port answers: boto3 still sees real HTTP errors (400 with an EC2 error code, or 503).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from moto.ec2 import models
from moto.ec2.exceptions import EC2ClientError
from werkzeug.exceptions import HTTPException

from spotrain.workers.embedded.spot_market import terminate_as_reclaimed


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
