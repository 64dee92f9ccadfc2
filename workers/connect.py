"""One way to reach Temporal for every spotrain process (CLI, worker, webhook, `spotrain
dev`): the SDK's standard environment configuration, so mutual TLS, API keys, namespaces and
profiles are set the same way as for the temporal CLI, and never in spotrain's own flags."""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfig
from temporalio.service import TLSConfig

TASK_QUEUE = "spotrain"
HINT = (
    "  set TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE or TEMPORAL_PROFILE (temporal.toml); a server "
    "that requires mutual TLS or an API key:\n  TEMPORAL_TLS_CLIENT_CERT_PATH and "
    "TEMPORAL_TLS_CLIENT_KEY_PATH (TEMPORAL_TLS_SERVER_CA_CERT_PATH for a private CA), or "
    "TEMPORAL_API_KEY"
)


def settings() -> dict[str, Any]:
    """TEMPORAL_ADDRESS, TEMPORAL_NAMESPACE, TEMPORAL_API_KEY, TEMPORAL_TLS_* and the profile
    (TEMPORAL_PROFILE in TEMPORAL_CONFIG_FILE or the default temporal.toml), defaulting to
    localhost:7233."""
    return {"target_host": "localhost:7233"} | dict(ClientConfig.load_client_connect_config())


def describe(s: dict[str, Any]) -> str:
    """Where and how a connection goes, for messages: never a key or a certificate."""
    tls = s.get("tls")
    if isinstance(tls, TLSConfig):
        how = "TLS with a client certificate" if tls.client_cert else "TLS, no client certificate"
    else:
        how = "TLS" if tls else "no TLS"
    key = ", an API key" if s.get("api_key") else ""
    return f"{s['target_host']} (namespace {s.get('namespace', 'default')}, {how}{key})"


class Unreachable(RuntimeError):
    """Temporal could not be reached, or refused the connection (e.g. no client certificate)."""

    def __init__(self, detail: str) -> None:
        try:
            where = describe(settings())
        except Exception:  # the configuration itself is what failed
            where = "(unreadable Temporal configuration)"
        super().__init__(f"cannot reach Temporal at {where}: {detail}\n{HINT}")


async def connect() -> Client:
    """A client with the standard settings and the pydantic converter the workflows use."""
    try:
        return await Client.connect(**settings(), data_converter=pydantic_data_converter)
    except (RuntimeError, ValueError, OSError) as err:
        raise Unreachable(str(err)) from None


def give_up(message: str) -> NoReturn:
    """Exit 1 with `message`, skipping the interpreter's finalization: a process that used the
    SDK's client can abort there (sdk-python#300) and report a crash instead."""
    print(message, file=sys.stderr, flush=True)
    os._exit(1)
