"""AWS's own EC2 instance metadata mock (github.com/aws/amazon-ec2-metadata-mock, "AEMM"),
built from its Go module through the Go module proxy on first use and cached; tests of the
IMDS notice path and the reaction benchmark run against it (IMDSv2 only: `-I`).

`SPOTRAIN_AEMM` may name a prebuilt binary. Without Go and without a binary, `binary()` is
None and the tests that need it are skipped with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from spotrain.workers.embedded.stack import free_port

MODULE = "github.com/aws/amazon-ec2-metadata-mock/cmd/ec2-metadata-mock@v1.13.0"
CACHE = Path.home() / ".cache" / "spotrain" / "bin"


def binary() -> Path | None:
    """The mock's binary, built once (about 15 s with a warm Go cache) if it is not there."""
    if os.environ.get("SPOTRAIN_AEMM"):
        return Path(os.environ["SPOTRAIN_AEMM"])
    path = CACHE / "ec2-metadata-mock"
    if not path.exists() and shutil.which("go"):
        CACHE.mkdir(parents=True, exist_ok=True)
        built = subprocess.run(
            ["go", "install", MODULE],
            env={**os.environ, "GOBIN": str(CACHE)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        if built.returncode:
            raise RuntimeError(f"go install {MODULE} failed:\n{built.stderr}")
    return path if path.exists() else None


@contextmanager
def serve(*args: str, port: int | None = None) -> Iterator[str]:
    """Run the mock (`spot -d 3`, ...), IMDSv2 only, on `port` (default: a free loopback
    port); its URL."""
    path = binary()
    if path is None:
        raise RuntimeError("ec2-metadata-mock is not built and Go is not installed")
    port = port or free_port()
    proc = subprocess.Popen(
        [str(path), *args, "-I", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                token = urllib.request.Request(
                    f"{url}/latest/api/token",
                    method="PUT",
                    headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"},
                )
                urllib.request.urlopen(token, timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
