"""A node's processes in one pod: start the rank command once per process of the node.

The Kubernetes runtime runs one pod per node and one command per pod. For a `type: pytorch`
job with `procs_per_node > 1` it runs the command through this launcher, which starts it
`LOCAL_WORLD_SIZE` times with each process's own rank environment (RANK, LOCAL_RANK and its
share of the global batch), as the local runtime does for every rank. Each process then
follows the rank contract by itself (acks, parking in a live resize, its next rank); the pod
ends when all of them have.

    python -m spotrain.elastic.procs -- python train.py ...

SIGTERM and SIGINT go to every process once (each decides how to exit; the processes run in
sessions of their own, so a signal to the pod's process group is not a second one, which
the library takes as "exit now"), and each dies with the launcher. The exit code is 0 when
every process exited 0, else the first failure's (a signal as 128 + its number).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

from spotrain.elastic import environment
from spotrain.workflows.job.planner import local_batch_size

PR_SET_PDEATHSIG = 1


def process_env(env: dict[str, str], local_rank: int) -> dict[str, str]:
    """Process `local_rank`'s environment, from the pod's (its first process's)."""
    rank = int(env["RANK"]) + local_rank
    out = env | {"RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    if global_batch := env.get(environment.GLOBAL_BATCH_SIZE):
        share = local_batch_size(int(global_batch), int(env["WORLD_SIZE"]), rank)
        out[environment.LOCAL_BATCH_SIZE] = str(share)
    return out


SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _in_child() -> None:
    """The process dies with the launcher and takes signals again (blocked while starting)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def main(argv: list[str]) -> int:
    command = argv[1:] if argv[:1] == ["--"] else argv
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    children: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for signum in SIGNALS:
        signal.signal(signum, forward)
    # A signal while the processes start waits until they all have: then each gets it once.
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    env = dict(os.environ)
    for local in range(int(env.get("LOCAL_WORLD_SIZE", "1"))):
        children.append(
            subprocess.Popen(
                command,
                env=process_env(env, local),
                start_new_session=True,
                preexec_fn=_in_child,  # (no threads here to make it unsafe)
            )
        )
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    codes = [child.wait() for child in children]
    failed = next((c for c in codes if c != 0), 0)
    return failed if failed >= 0 else 128 - failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
