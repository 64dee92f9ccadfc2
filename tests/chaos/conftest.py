"""The chaos suite's own Temporal dev server (killable, SQLite-backed) and scratch space.
CHAOS_KEEP=1 keeps the scratch space (server and worker logs, step records) for a post-mortem."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from .harness import ChaosEnv, TemporalServer


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def chaos_env(moto_endpoint: str) -> AsyncIterator[ChaosEnv]:
    root = Path(tempfile.mkdtemp(prefix="spotrain-chaos-"))
    server = TemporalServer(root / "temporal.db", root / "temporal.log")
    server.start()
    try:
        yield ChaosEnv(server, await server.client(), moto_endpoint, root)
    finally:
        server.kill()
        if os.environ.get("CHAOS_KEEP") != "1":
            shutil.rmtree(root, ignore_errors=True)
