"""A `python` for the tests' rank processes that starts warm: `[*WARM_PYTHON, script, ...]`
runs as `[sys.executable, script, ...]` would, but forked from a server that has already
imported torch, so a rank costs its own work, not `import torch` (4-5 s of CPU each on a busy
2-core machine; rank start-up was over half of the suite's CPU).

Run as a command (`python tests/warm_python.py SCRIPT|-m MOD|-c CODE [ARG ...]`) it is the
client: standard library only, it hands its argv, environment, working directory and standard
streams to the server named by SPOTRAIN_TEST_WARM_PYTHON and stands in for the forked child
until it exits, with the child's exit code, or killed by the same signal. Signals sent to the
client (the launcher forwards SIGTERM) reach the child; a client killed outright (SIGKILL of its
process group) takes the child with it. With no server it execs the interpreter: the run is
cold, not lost.

Not for tests about process start-up (a bad interpreter, an import error at start), nor for a
rank a test freezes with SIGSTOP of its process group: the child is not in the client's group.

`serve(path)` is the server: the session fixture in tests/conftest.py starts one per test
process (`python -m tests.warm_python --serve PATH`).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys

ENV = "SPOTRAIN_TEST_WARM_PYTHON"  # the server's socket
CLIENT = os.path.abspath(__file__)
WARM_PYTHON = [sys.executable, CLIENT]
# What a rank imports that costs: torch and its distributed, DDP, FSDP, checkpoint and
# compiler stacks (spotrain.elastic.live imports torch._dynamo). No spotrain module: those read
# their environment at import, and the breaks harness points `spotrain` at a copy.
WARM_MODULES = (
    "numpy",
    "torch",
    "torch.nn",
    "torch.optim",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.nn.parallel",
    "torch._dynamo",
)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
MAX_MESSAGE = 1 << 20
PR_SET_PDEATHSIG = 1


def _cold(argv: list[str]) -> None:
    os.execv(sys.executable, [sys.executable, *argv])


def client(argv: list[str]) -> int:
    path = os.environ.get(ENV)
    if not path:
        _cold(argv)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
    except OSError as err:
        print(f"warm_python: no server at {path} ({err}): starting cold", file=sys.stderr)
        conn.close()
        _cold(argv)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    # Held back until they can be forwarded: the child may be up (and the sender told so)
    # before this process, starved on a loaded machine, has read its pid. A SIGTERM then
    # killed us, not the child, whose handler would have made it exit 0.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    data = conn.recv(MAX_MESSAGE)  # the child's pid, from the child
    if data and "pid" in (first := json.loads(data)):

        def forward(signum: int, _frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):  # (it has just ended)
                os.kill(first["pid"], signum)

        for signum in FORWARDED:
            signal.signal(signum, forward)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # (those held go to the child)
        data = conn.recv(MAX_MESSAGE)  # its exit code or signal, from the server
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # (no child: they were for us)
    if not data:
        print("warm_python: the server went before the child reported", file=sys.stderr)
        return 1
    code = json.loads(data)["exit"]
    if code < 0:  # die as the child died, so whoever waits on us sees the same signal
        _die_of(-code)
    # At once, as the child did: at the interpreter's exit a forwarded signal's handler is
    # gone (CPython restores SIG_DFL), and a SIGTERM then would kill us after a child that
    # exited 0 (a torchrun worker's exit -15, once, in a clean-clone run beside heavy load).
    os._exit(code)


def _die_of(signum: int) -> None:
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # (a signal whose default is to go on)


class _Server:
    """A loop in one thread that holds no lock when it forks: a selector over the listening
    socket and a pidfd per child, so each child's end (exit code or signal, as waitpid has
    it) goes back to its client."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ)
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, conn)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda _s, _f: self.stop())
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.listener:
                    self._accept()
                else:
                    self._reap(key.fd)

    def stop(self) -> None:
        for _pidfd, (pid, _conn) in self.children.items():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sys.exit(0)

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        data, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, 3)
        if not data or len(fds) != 3:  # a client killed before it asked
            for fd in fds:
                os.close(fd)
            conn.close()
            return
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._close_all_but(conn)
            _run_child(conn, request, fds)  # never returns
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn)
        self.selector.register(pidfd, selectors.EVENT_READ)

    def _reap(self, pidfd: int) -> None:
        pid, conn = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):  # (the client may have gone)
            conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
        conn.close()

    def _close_all_but(self, conn: socket.socket) -> None:
        self.selector.close()
        self.listener.close()
        for pidfd, (_pid, other) in self.children.items():
            os.close(pidfd)
            other.close()
        self.children.clear()


def _run_child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """Become the process `python ARGV` would have started, run it, report, exit."""
    import atexit
    import runpy
    import threading

    os.setsid()  # a group of its own: a test's killpg of this rank reaches no other
    conn.send(json.dumps({"pid": os.getpid()}).encode())
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "OMP_NUM_THREADS" in os.environ:  # read by OpenMP at load, in the server
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "numpy" in sys.modules:  # seeded at import, and not again at fork as `random` is
        sys.modules["numpy"].random.seed()

    def lost_client() -> None:
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=lost_client, daemon=True).start()

    argv = request["argv"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:1] = ["", *extra]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[:1] = ["", *extra]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path[:1] = [os.path.dirname(os.path.realpath(argv[0])), *extra]
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as done:
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt as err:
        _print_without_this_frame(err)
        code = -signal.SIGINT
    except BaseException as err:
        _print_without_this_frame(err)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if code < 0:
        _die_of(-code)
    os._exit(code & 0xFF)


def _print_without_this_frame(err: BaseException) -> None:
    """The traceback a cold `python` prints: from the script's first frame on."""
    import traceback

    tb = err.__traceback__
    traceback.print_exception(type(err), err, tb.tb_next if tb else None)


def serve(path: str) -> None:
    """Import, listen, fork on demand; gone with the test process that started it."""
    import ctypes
    import importlib

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

    for name in WARM_MODULES:
        importlib.import_module(name)
    server = _Server(path)
    print("ready", flush=True)
    server.run()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    else:
        sys.exit(client(sys.argv[1:]))
