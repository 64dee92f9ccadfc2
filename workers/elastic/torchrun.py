"""Run a spotrain-unaware training command under torchrun, speaking the rank contract for it.

A `type: command` job names a plain torchrun script (no spotrain import). The runtime starts
this module once per node (the local runtime: once per rank) in the script's place:

    python -m spotrain.elastic.torchrun node --nnodes N --node-rank R --nproc-per-node P \\
        -- COMMAND [ARG ...]

It waits for the gang, then runs `torch.distributed.run` with the generation's static
rendezvous (MASTER_ADDR and MASTER_PORT from the rank environment), and:
- turns the elastic event (or a SIGTERM of its own) into SIGTERM to the script's processes:
  the script's own SIGTERM handler is its checkpoint hook; it saves and exits 0;
- on exit 0 after that, acks for this node's ranks (the step is the script's business: 0);
  stopped before torchrun started, it acks at once;
- on exit 0 without one, training finished: node 0 leaves the completion marker, the other
  nodes wait for it, so no rank is seen exiting 0 for no reason;
- any other exit is passed on: a fault.

torchrun starts each worker in a session of its own, where a SIGKILL of the node's process
group (a node lost) would not reach it; so every worker starts through `exec`, which makes the
kernel kill it when its torchrun agent dies (PR_SET_PDEATHSIG), then execs the command.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from spotrain import elastic
from spotrain.elastic import environment

POLL_S = 0.1
DONE_WAIT_S = 120.0  # how long a non-zero node waits for node 0's completion marker
PR_SET_PDEATHSIG = 1


def children(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (torchrun's workers)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, ...
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(proc.name))
    return out


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """torchrun for this node, static rendezvous; each worker through `exec` (see above)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={args.nnodes}",
        f"--node-rank={args.node_rank}",
        f"--nproc-per-node={args.nproc_per_node}",
        f"--master-addr={os.environ['MASTER_ADDR']}",
        f"--master-port={os.environ['MASTER_PORT']}",
        "--max-restarts=0",  # spotrain restarts generations, not torchrun
        "--no-python",
        sys.executable,
        "-m",
        "spotrain.elastic.torchrun",
        "exec",
        "--",
        *args.command,
    ]


def ack(s: elastic.Settings, nproc: int) -> int:
    """This node's ranks are safe to stop (the step is the script's business: 0)."""
    for rank in range(s.rank, s.rank + nproc):
        elastic.store().write_ack(s.generation, rank, 0, time.time())
    return 0


def run_node(args: argparse.Namespace) -> int:
    notice = False

    def on_term(_signum: int, _frame: object) -> None:
        nonlocal notice
        notice = True  # acted on in the loop below, not inside the handler

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    s = elastic.wait_for_gang()
    event = notice or elastic.elastic_event_detected()
    if event:  # stopped before it started: nothing to save
        return ack(s, args.nproc_per_node)
    env = {k: v for k, v in os.environ.items() if k != environment.LOCAL_BATCH_SIZE}  # per rank
    agent = subprocess.Popen(torchrun_argv(args), env=env)
    signaled: set[int] = set()  # workers told; one that torchrun starts later is told too
    while agent.poll() is None:
        event = event or notice or elastic.elastic_event_detected()
        for pid in set(children(agent.pid)) - signaled if event else ():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            signaled.add(pid)
            print(f"command_node: elastic event: SIGTERM to worker {pid}", flush=True)
        time.sleep(POLL_S)
    code = agent.returncode
    if code != 0:
        return code if code > 0 else 128 - code
    if event:
        return ack(s, args.nproc_per_node)
    if args.node_rank == 0:
        elastic.mark_done(s.total_steps)
        return 0
    deadline = time.monotonic() + DONE_WAIT_S
    while elastic.store().done() is None:
        if time.monotonic() > deadline:
            print("command_node: node 0 never marked the job done", file=sys.stderr)
            return 1
        time.sleep(POLL_S)
    return 0


def exec_worker(command: list[str]) -> int:
    """Die with the torchrun agent (our parent), then become the command."""
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        print("command_node: PR_SET_PDEATHSIG failed", file=sys.stderr)
    if parent == 1 or os.getppid() != parent:  # the agent died before prctl took effect
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"command_node: cannot start {command[0]!r}: {err}", file=sys.stderr)
    return 127


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m spotrain.elastic.torchrun")
    sub = parser.add_subparsers(dest="mode", required=True)
    node = sub.add_parser("node", help="run torchrun for one node")
    node.add_argument("--nnodes", type=int, required=True)
    node.add_argument("--node-rank", type=int, required=True)
    node.add_argument("--nproc-per-node", type=int, required=True)
    node.add_argument("command", nargs=argparse.REMAINDER)
    worker = sub.add_parser("exec", help="(torchrun's) start one worker")
    worker.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        parser.error("no command after --")
    return run_node(args) if args.mode == "node" else exec_worker(args.command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
