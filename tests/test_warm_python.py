"""tests/warm_python.py: a rank forked from the warm server behaves as one started cold, to its
arguments, environment, streams, exit code and signals, and never outlives its client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm_python
from tests.warm_python import WARM_PYTHON

pytestmark = pytest.mark.usefixtures("warm_python_server")
COLD = [sys.executable]

SCRIPT = """
import json, os, sys
warm = "torch" in sys.modules  # before this script imports anything heavy
print(json.dumps({
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("PROBE"),
    "stdin": sys.stdin.read(), "name": __name__, "warm": warm,
}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def run(python: list[str], args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*python, *args],
        input="fed on stdin",
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PROBE": "from the client"},
        timeout=120,
    )


def test_a_script_runs_as_it_would_cold_but_with_torch_imported(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    cold, warm = (run(python, [str(script), "3", "x"], tmp_path) for python in (COLD, WARM_PYTHON))
    assert (cold.returncode, warm.returncode) == (3, 3), warm.stderr
    assert (cold.stderr, warm.stderr) == ("to stderr\n", "to stderr\n")
    cold_out, warm_out = json.loads(cold.stdout), json.loads(warm.stdout)
    assert (cold_out.pop("warm"), warm_out.pop("warm")) == (False, True)
    assert warm_out == cold_out
    assert warm_out["argv"] == [str(script), "3", "x"] and warm_out["env"] == "from the client"


def test_c_and_m_and_a_traceback_as_cold(tmp_path: Path) -> None:
    code = "import sys; print(sys.argv, __name__); raise ValueError('boom')"
    cold, warm = (run(python, ["-c", code, "a"], tmp_path) for python in (COLD, WARM_PYTHON))
    assert (cold.returncode, warm.returncode) == (1, 1)
    assert warm.stdout == cold.stdout == "['-c', 'a'] __main__\n"
    assert warm.stderr == cold.stderr, warm.stderr  # no frame of the server's
    (tmp_path / "mod_probe.py").write_text("import sys; print(sys.argv[1:], __name__)")
    cold, warm = (run(python, ["-m", "mod_probe", "b"], tmp_path) for python in (COLD, WARM_PYTHON))
    assert warm.stdout == cold.stdout == "['b'] __main__\n", warm.stderr


def test_a_rank_killed_by_a_signal_looks_killed_by_it() -> None:
    code = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    warm = subprocess.run([*WARM_PYTHON, "-c", code], timeout=60)
    assert warm.returncode == -signal.SIGKILL


def test_sigterm_reaches_the_rank_and_a_killed_client_takes_it_along(tmp_path: Path) -> None:
    code = """if True:
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
        open(sys.argv[1], "w").write(str(os.getpid()))
        time.sleep(60)
    """
    pid_file = tmp_path / "pid"
    clients: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[subprocess.Popen[bytes], int]:
        pid_file.unlink(missing_ok=True)
        clients.append(subprocess.Popen([*WARM_PYTHON, "-c", code, str(pid_file)]))
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and clients[-1].poll() is None
            time.sleep(0.05)
        return clients[-1], int(pid_file.read_text())

    try:
        client, rank = start()
        assert rank != client.pid  # forked by the server, not the client itself
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=30) == 7

        client, rank = start()
        client.kill()
        client.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{rank}").exists() and "Z" not in _state(rank):
            assert time.monotonic() < deadline, f"rank {rank} outlived its killed client"
            time.sleep(0.05)
    finally:  # (a killed client takes its rank along)
        for started in clients:
            started.kill()
            started.wait()


# A rank that stops on SIGTERM and exits 0, once it is up.
EXITS_0_ON_SIGTERM = """if True:
    import os, signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    open(sys.argv[1], "w").write("up")
    time.sleep(60)
"""


def sigterms_until_it_exits(tmp_path: Path, attempts: int) -> list[int]:
    """Each attempt: a client for that rank; once the rank is up, a SIGTERM every 0.2 ms
    until the client has exited. Its exit codes."""
    codes = []
    for attempt in range(attempts):
        up = tmp_path / f"up-{attempt}"
        client = subprocess.Popen([*WARM_PYTHON, "-c", EXITS_0_ON_SIGTERM, str(up)])
        try:
            deadline = time.monotonic() + 60
            while not up.exists():
                assert time.monotonic() < deadline and client.poll() is None
                time.sleep(0.001)
            while client.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    client.send_signal(signal.SIGTERM)
                time.sleep(0.0002)
            codes.append(client.wait())
        finally:
            client.kill()
            client.wait()
    return codes


def test_a_signal_around_the_ranks_exit_does_not_change_its_exit_code(tmp_path: Path) -> None:
    """SIGTERMs keep coming (torchrun's wrapper sends one, the agent may send more): the
    client exits 0 as the rank did, never dies of a SIGTERM that came after the rank's end,
    nor of forwarding one to it."""
    assert sigterms_until_it_exits(tmp_path, 10) == [0] * 10


def test_a_signal_before_the_client_knows_its_rank_goes_to_the_rank(tmp_path: Path) -> None:
    """A SIGTERM that reaches the client before it has read its rank's pid (a client starved
    on a loaded machine, its rank up already) is held and then forwarded: the rank exits 0
    on it, and so does the client. It killed the client (-15) in a suite run at load 20.
    This test plays the fork server, so the signal comes exactly then."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(tmp_path / "socket"))
    listener.listen(1)
    listener.settimeout(60)
    env = os.environ | {warm_python.ENV: str(tmp_path / "socket")}
    client = subprocess.Popen([*WARM_PYTHON, "-c", "pass"], env=env)
    rank: subprocess.Popen[bytes] | None = None
    try:
        conn, _ = listener.accept()
        _request, fds, _flags, _addr = socket.recv_fds(conn, warm_python.MAX_MESSAGE, 3)
        for fd in fds:
            os.close(fd)
        up = tmp_path / "up"
        rank = subprocess.Popen([sys.executable, "-c", EXITS_0_ON_SIGTERM, str(up)])
        deadline = time.monotonic() + 60
        while not up.exists():
            assert time.monotonic() < deadline and rank.poll() is None
            time.sleep(0.01)
        client.send_signal(signal.SIGTERM)  # before the client knows its rank
        time.sleep(0.3)
        assert client.poll() is None, "the client died of a signal meant for its rank"
        conn.send(json.dumps({"pid": rank.pid}).encode())
        assert rank.wait(timeout=60) == 0  # the held SIGTERM reached it
        conn.send(json.dumps({"exit": 0}).encode())
        assert client.wait(timeout=60) == 0
    finally:
        for process in (client, rank):
            if process is not None:
                process.kill()
                process.wait()
        listener.close()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
