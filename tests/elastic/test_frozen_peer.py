"""A node that vanishes without closing its connections (frozen, or cut off): once the job
learns of the loss, its control record names the lost node, and the survivors abort the
collective they wait on and park within seconds, not after the collective timeout. Real gloo
processes; the lost rank is frozen with SIGSTOP, so its sockets stay open, as a cut-off
node's do."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spotrain import elastic
from spotrain.elastic import environment
from spotrain.elastic.environment import rank_env
from spotrain.elastic.job_store import JobStore
from spotrain.workers.embedded.stack import free_port
from tests.elastic.test_live_resize import plan

pytest.importorskip("torch")

TRAINS = """
import os, signal, sys, time, torch, torch.distributed as dist
from spotrain import elastic
from spotrain.elastic import live
live.init_process_group("gloo")
rank, step = dist.get_rank(), 0
open(sys.argv[1] + f"/ready-{rank}", "w").close()
try:
    while not elastic.elastic_event_detected():  # a training loop's collectives
        dist.all_reduce(torch.ones(1000))
        step += 1
        if rank == 2 and step == 20:
            os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its connections stay open
        time.sleep(0.01)
except Exception as err:
    assert live.peer_failed(err), err
    print(f"failed at {time.time():.3f} holding step {step}", flush=True)
live.next_generation(step)  # parks (acks), then leaves when no next generation comes
os._exit(0)
"""

COLLECTIVE_TIMEOUT_S = 30.0


def start_ranks(tmp_path: Path, p: object) -> list[subprocess.Popen[str]]:
    port, procs = free_port(), []
    for rank in range(3):
        env = rank_env(p, rank, 0, master_port=port, control_file="")  # type: ignore[arg-type]
        env |= {"MASTER_ADDR": "127.0.0.1", environment.RESIZE: "live"}
        env |= {environment.PARK_TIMEOUT: "3", elastic.SIGTERM_ENV: "0"}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", TRAINS, str(tmp_path)],
                env={**os.environ, **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def test_survivors_of_a_frozen_node_park_within_seconds_of_the_loss(tmp_path: Path) -> None:
    p = plan(tmp_path, 3, [0, 1, 2]).model_copy(
        update={"collective_timeout_s": COLLECTIVE_TIMEOUT_S}
    )
    procs = start_ranks(tmp_path, p)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready-{r}").exists() for r in range(3)):
            assert time.monotonic() < deadline, "the ranks did not form their group"
            time.sleep(0.1)
        while "T" not in Path(f"/proc/{procs[2].pid}/stat").read_text().split(")")[1][:3]:
            assert time.monotonic() < deadline, "rank 2 never froze"
            time.sleep(0.05)
        time.sleep(1.0)  # the survivors now wait on it in their all-reduce
        signalled = time.time()
        # What the runtime's stop writes when the job learns of the loss (activities/notice.py)
        record = {"kind": "stop", "event_id": "stop-3", "time": signalled, "lost": ["node-2"]}
        JobStore(p.checkpoint).write_control(3, {**record, "checkpoint": False})
        outputs = [procs[r].communicate(timeout=60)[0] for r in (0, 1)]
    finally:
        for proc in procs:
            proc.kill()  # (SIGKILL ends a stopped process too)
            proc.wait()
    for out in outputs:
        assert "failed at " in out, outputs
        parked_after = float(out.split("failed at ")[1].split()[0]) - signalled
        assert parked_after < 3, outputs  # not the 30 s collective timeout
    held = JobStore(p.checkpoint).ack_steps(3)
    assert set(held) == {0, 1} and held[0] == held[1] >= 20, held  # parked, holding a step
