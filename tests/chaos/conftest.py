"""The chaos suite's own Temporal dev server (killable, SQLite-backed) and scratch space."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from .harness import ChaosEnv, TemporalServer


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def chaos_env(moto_endpoint: str) -> AsyncIterator[ChaosEnv]:
    with tempfile.TemporaryDirectory(prefix="spotrain-chaos-") as tmp:
        root = Path(tmp)
        server = TemporalServer(root / "temporal.db", root / "temporal.log")
        server.start()
        try:
            yield ChaosEnv(server, await server.client(), moto_endpoint, root)
        finally:
            server.kill()
