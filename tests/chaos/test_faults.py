"""Faults beyond a dying worker: the Temporal server killed mid-resize, a flaky EC2 API, storms
of duplicate and out-of-order events, and jobs cancelled or terminated at random moments."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import socket
import sys
from typing import Any

import pytest
from moto.ec2.responses import EC2Response

from spotrain.workflows.job.state import JobResult
from tests.aws import ec2_support
from tests.chaos.harness import (
    CYCLE_PLANS,
    FULL,
    ChaosEnv,
    Figures,
    WorkerProcess,
    check_job,
    listens,
    member,
    memberships,
    reclaim,
    replaced,
    running,
    status,
    supervise,
    until,
)
from tests.jobs import record_history

FLAKY_ACTIONS = [
    "run_instances",
    "describe_instances",
    "terminate_instances",
    "describe_spot_price_history",
    "describe_availability_zones",
    "describe_images",
]
FLAKY_ERRORS = [ec2_support.ec2_error("RequestLimitExceeded"), ec2_support.ServiceUnavailable]


def flaky_ec2(monkeypatch: pytest.MonkeyPatch, rate: float, rng: random.Random) -> list[str]:
    """Make `rate` of the EC2 API calls above fail with throttling (400) or 503, before moto
    acts (so a failed RunInstances bought nothing). Patched at moto's HTTP layer: its backend
    methods also serve moto's own internals. Returns the failed actions, as they happen."""
    injected: list[str] = []
    for action in FLAKY_ACTIONS:
        original = getattr(EC2Response, action)

        def faulty(self: EC2Response, _original: Any = original, _action: str = action) -> Any:
            if rng.random() < rate:
                injected.append(_action)
                raise rng.choice(FLAKY_ERRORS)()
            return _original(self)

        monkeypatch.setattr(EC2Response, action, faulty)
    return injected


def finish(fig: Figures, result: Any, scenario: str) -> Figures:
    fig.scenario = scenario
    if not isinstance(result, JobResult) or result.phase != "Succeeded":
        fig.problems.append(f"job ended with {result!r}")
    fig.survived = int(not fig.problems)
    fig.write()
    return fig


def test_a_port_is_told_to_be_held_by_its_own_process() -> None:
    """The restarted server's wait: a listener on its port is not enough, it must be its own
    (another process may take the port while the server is down)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        assert not listens(os.getpid(), port)  # bound, not listening
        listener.listen()
        assert listens(os.getpid(), port)
        assert not listens(os.getppid(), port)  # another process


async def test_server_killed_and_restarted_mid_resize(chaos_env: ChaosEnv) -> None:
    """SIGKILL the dev server while a reclaim resize is in flight (ranks take 2 s to ack);
    restarted from its SQLite file, it carries the job through the rest of the cycle."""
    env, job = chaos_env, "server-restart"
    spec = env.spec(job)
    spec["env"]["CHAOS_ACK_DELAY_S"] = "2"
    worker = WorkerProcess(env, job)
    handle = await env.start(spec)
    before = await until(env, handle, running(4, min_step=20))
    victim = member(before, 1)
    await reclaim(handle, victim, "server-restart-notice")
    await until(env, handle, lambda s: s.phase == "Resizing", timeout=30)
    env.server.kill()
    await asyncio.sleep(1)
    env.server.start()
    await env.server.client()  # the restarted frontend serves the namespace again
    result, _ = await supervise(env, handle, worker, replaced(victim))
    await record_history(handle, "chaos_server_restart")
    fig = check_job(env, job, plans=CYCLE_PLANS, sizes_from=before.generation)
    finish(fig, result, "server SIGKILL mid-resize")
    assert not fig.problems


async def test_flaky_cloud_never_restarts_healthy_workers(
    chaos_env: ChaosEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20% of EC2 calls fail (throttling or 503) through a reclaim cycle: the only membership
    change is the real loss (and its replacement joining), no fault, no restart."""
    env, job = chaos_env, "flaky-cloud"
    injected = flaky_ec2(monkeypatch, 0.2, random.Random(8))
    worker = WorkerProcess(env, job)
    handle = await env.start(env.spec(job))
    before = await until(env, handle, running(4, min_step=20))
    victim = member(before, 1)
    await reclaim(handle, victim, "flaky-notice")
    result, _ = await supervise(env, handle, worker, replaced(victim))
    monkeypatch.undo()
    fig = check_job(env, job, plans=CYCLE_PLANS, sizes_from=before.generation)
    if isinstance(result, JobResult) and (
        result.faults or result.generations - before.generation not in (1, 2)  # CYCLE_PLANS
    ):
        fig.problems.append(f"{result.faults} faults, {result.generations} generations")
    if len(injected) < 5:
        fig.problems.append(f"only {len(injected)} errors injected")
    finish(fig, result, f"flaky EC2 (20%, {len(injected)} errors)")
    assert not fig.problems


async def test_event_storms_change_membership_once_per_real_loss(chaos_env: ChaosEnv) -> None:
    """The same reclaim 10 times (one event id) and 10 more times (new ids), reclaims for an
    unknown and a gone node, node_lost before reclaim, and a reclaim during a resize: each of
    the 4 real losses leaves the membership exactly once; nothing else restarts workers."""
    env, job = chaos_env, "event-storms"
    spec = env.spec(job)
    spec["env"]["CHAOS_ACK_DELAY_S"] = "1"
    spec["cleanup"] = "never"  # keep the runtime's pid files: they name each generation's nodes
    worker = WorkerProcess(env, job)
    handle = await env.start(spec)
    first = await until(env, handle, running(4, min_step=20))
    b = member(first, 1)
    for i in range(10):
        await reclaim(handle, b, "storm-b")
        await reclaim(handle, b, f"storm-b-{i}")
    await reclaim(handle, "i-0123456789abcdef0", "storm-unknown")
    await handle.signal("node_lost", {"node_id": b, "event_id": "storm-b-lost"})

    third = await until(env, handle, lambda s: running(4)(s) and s.generation >= 3)
    c = member(third, 1)
    ec2_support.reclaim(c)  # gone without notice; node_lost arrives before the late notice
    await handle.signal("node_lost", {"node_id": c, "event_id": "storm-c-lost"})
    await reclaim(handle, c, "storm-c-late", in_s=0)
    await reclaim(handle, b, "storm-b-again")

    fourth = await until(
        env, handle, lambda s: running(4)(s) and c not in (member(s, 0), member(s, 1))
    )
    a, d = member(fourth, 0), member(fourth, 1)
    await reclaim(handle, a, "storm-a")
    await until(env, handle, lambda s: s.phase == "Resizing", timeout=30)
    await reclaim(handle, d, "storm-d-during-resize")
    result, _ = await supervise(env, handle, worker, go_when=lambda _: True)
    await record_history(handle, "chaos_event_storms")

    losses = {a, b, c, d}
    fig = check_job(env, job)
    gens = memberships(env, job)
    left = [n for prev, nxt in itertools.pairwise(gens) for n in prev - nxt]
    same = any(p == n for p, n in itertools.pairwise(gens))
    if sorted(left) != sorted(losses) or same:
        fig.problems.append(f"memberships {[sorted(g) for g in gens]}, losses {losses}")
    if isinstance(result, JobResult) and result.reclaims != len(losses):
        fig.problems.append(f"{result.reclaims} reclaims booked for {len(losses)} losses")
    finish(fig, result, "event storms (4 real losses)")
    assert not fig.problems


async def stop_at_random(
    env: ChaosEnv, job: str, delay: float, training: bool, terminate: bool
) -> Figures:
    """Cancel or terminate `job` `delay` s after submission (or, if `training`, after it
    started running); then nothing may be left running (after terminate, which runs no
    cleanup, once `spotrain gc --apply` has reaped its instances and rank processes)."""
    worker = WorkerProcess(env, job)
    handle = await env.start(env.spec(job))
    if training:
        await until(env, handle, running(4))
    await asyncio.sleep(delay)
    step = getattr(await status(handle), "step", None)
    if terminate:
        await handle.terminate("chaos")
        worker.stop()  # the controller settles: no activity is still starting things
        gc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "spotrain.workers.cli.main", "gc", "--apply", "--json"),
            *("--state-dir", str(env.state_dir)),
            env=os.environ | env.worker_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await gc.communicate()
        assert gc.returncode == 0, err.decode()
        assert json.loads(out)["applied"]  # what it left is judged below: no leaks
    else:
        await handle.cancel()
        await supervise(env, handle, worker, go_when=lambda _: False)  # cancelled: no cycle
        if training:
            await record_history(handle, f"chaos_cancel_{job.replace('-', '_')}")
    await asyncio.sleep(1)  # anything started late would show up now
    fig = check_job(env, job, completed=False)
    fig.scenario = f"{'terminate' if terminate else 'cancel'} after {delay:.1f}s (step {step})"
    fig.survived = int(not fig.problems)
    fig.write()
    return fig


async def test_cancel_and_terminate_at_random_points_leave_nothing(chaos_env: ChaosEnv) -> None:
    rng = random.Random(88)
    figures = await asyncio.gather(
        *(
            stop_at_random(chaos_env, f"stop-{i}", rng.uniform(0, 4), i % 4 >= 2, i % 2 == 1)
            for i in range(12 if FULL else 4)
        )
    )
    failed = {f.scenario: f.problems for f in figures if f.problems}
    assert not failed, failed
