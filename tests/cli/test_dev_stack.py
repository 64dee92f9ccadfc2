"""`spotrain dev` as a user runs it: a real subprocess bringing up the Temporal dev server
(SQLite file), moto, the worker and the webhook; Ctrl-C stops all of it, and what Temporal
held (here a capacity pool, a workflow that never ends by itself) is there after a restart."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotrain.workers.embedded.stack import free_port, port_block


def processes_using(path: Path) -> list[int]:
    """Live processes whose command line names `path` (the dev server's database)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if str(path) in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


class Dev:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.ports = [free_port() for _ in range(4)]
        self.env = os.environ | {"TEMPORAL_ADDRESS": f"127.0.0.1:{self.ports[0]}"}
        self.banner = ""

    def start(self) -> subprocess.Popen[str]:
        names = ("--temporal-port", "--ui-port", "--moto-port", "--webhook-port")
        ports = [
            arg for name, port in zip(names, self.ports, strict=True) for arg in (name, str(port))
        ]
        command = [sys.executable, "-m", "spotrain.workers.cli.main", "dev"]
        proc = subprocess.Popen(
            [*command, "--state-dir", str(self.state), *ports],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
        )
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C to stop." in line:  # (the end of the banner)
                self.banner = "".join(lines)
                return proc
            assert line or proc.poll() is None, "".join(lines)
        proc.kill()
        raise AssertionError("spotrain dev did not come up: " + "".join(lines))

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "spotrain.workers.cli.main", *args]
        return subprocess.run(command, capture_output=True, text=True, env=self.env, timeout=60)

    def interrupt(self, proc: subprocess.Popen[str]) -> int:
        proc.send_signal(signal.SIGINT)
        try:
            return proc.wait(timeout=45)
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.mark.slow
def test_ctrl_c_stops_everything_and_temporal_state_survives_a_restart(tmp_path: Path) -> None:
    dev = Dev(tmp_path / "state")
    proc = dev.start()
    try:
        created = dev.cli("pool", "create", "kept", "--max-nodes", "3")
        assert created.returncode == 0, created.stderr
        # The banner's exports work as written: `spotrain gc` reaches the stack's EC2.
        exports = "\n".join(
            line.strip() for line in dev.banner.splitlines() if line.strip().startswith("export ")
        )
        assert "SPOTRAIN_WEBHOOK_TOKEN" in exports and "SPOTRAIN_EC2_ENDPOINT" in exports
        gc = subprocess.run(
            ["bash", "-c", f"{exports}\n{sys.executable} -m spotrain.workers.cli.main gc"],
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in dev.env.items() if not k.startswith(("AWS_", "SPOTRAIN_EC2"))},
        )
        assert gc.returncode == 0, gc.stdout + gc.stderr
    finally:
        assert dev.interrupt(proc) == 0
    database = dev.state / "temporal.db"
    assert database.exists()
    deadline = time.monotonic() + 15
    while processes_using(database) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_using(database) == []  # no dev server outlives the stack

    proc = dev.start()
    try:
        status = dev.cli("pool", "status", "kept", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["config"]["max_nodes"] == 3
    finally:
        assert dev.interrupt(proc) == 0


def test_port_blocks_held_at_once_do_not_overlap() -> None:
    """Tests on this host each take a block of rendezvous ports (a live job under the stand-in
    kubelet): a block is free when given, and no other is given while it is held, even to a
    caller whose random draw starts where the first one's did."""
    with contextlib.ExitStack() as held:
        bases = []
        for _ in range(3):
            random.seed(17)  # the same first candidate each time
            bases.append(held.enter_context(port_block(50)))
        first, second, third = sorted(bases)
        assert second - first >= 50 and third - second >= 50  # no two overlap
        for base in bases:
            assert base >= 10000 and base + 50 <= 20000  # below what free_port picks
            for port in (base, base + 49):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))  # free: no OSError
