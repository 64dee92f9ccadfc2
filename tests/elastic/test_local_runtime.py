"""The local runtime against real processes: a small worker script using the real training
library (no torch, so each case takes seconds). Activities run inside the SDK's
ActivityEnvironment, so their heartbeats are real SDK calls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from spotrain.activities.local import LocalRuntime
from spotrain.activities.local_ranks import Rank, proc_start_time
from spotrain.elastic.job_store import JobStore
from spotrain.workflows.contract import (
    CONFIG_ERROR,
    CleanupRequest,
    GenerationPlan,
    Member,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)

# mode: "train" (acks the elastic event), "stubborn" (ignores the event and SIGTERM),
# "crash" (rank 1 exits 3 at step 5, once rank 0 has reported a step: a crash before that is
# a start failure, for which the runtime gives the other ranks a moment to fail too). Steps
# every 20 ms, checkpoint "files" every 10 steps.
WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from spotrain import elastic
    from spotrain.elastic.control import STORE_POLL_ENV

    mode = sys.argv[1]
    s = elastic.wait_for_gang()
    latest = elastic.latest_checkpoint()
    step = latest["step"] if latest else 0
    print(f"rank={s.rank} world={s.world_size} node={s.node_id} "
          f"port={os.environ['MASTER_PORT']} batch={s.local_batch_size} from={step} "
          f"s3_poll={os.environ.get(STORE_POLL_ENV)}", flush=True)
    # stands in for DDP's first collective: no rank steps (and checkpoints) before every rank
    # has read where to resume, else a late rank resumes from its peers' new checkpoint
    here = os.path.dirname(os.path.abspath(__file__))
    mark = lambda r: os.path.join(here, f"resumed-{s.generation}-{r}")
    open(mark(s.rank), "w").close()
    while not all(os.path.exists(mark(r)) for r in range(s.world_size)):
        time.sleep(0.02)
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while step < s.total_steps:
        time.sleep(0.02)
        step += 1
        if mode == "crash" and s.rank == 1 and step >= 5:
            if elastic.store().progress(s.generation) is not None:
                sys.exit(3)
        if step % 10 == 0:
            elastic.mark_checkpoint(step, f"ckpt-{step}")
        elastic.report_progress(step)
        if mode != "stubborn" and elastic.elastic_event_detected():
            elastic.mark_checkpoint(step, f"ckpt-{step}")
            elastic.ack_checkpoint(step)
            sys.exit(0)
    elastic.mark_done(step)
    while elastic.store().done() is None:  # stands in for the barrier after mark_done
        time.sleep(0.02)
    """
)


@pytest.fixture
def env() -> ActivityEnvironment:
    return ActivityEnvironment()


@pytest.fixture
def worker(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


def plan(
    tmp_path: Path, worker: Path, mode: str, generation: int = 0, total_steps: int = 10_000
) -> GenerationPlan:
    return GenerationPlan(
        job="job",
        generation=generation,
        members=[
            Member(node_id="node-a", address="127.0.0.1", procs=2),
            Member(node_id="node-b", address="127.0.0.1"),
        ],
        command=[sys.executable, str(worker), mode],
        checkpoint=f"file://{tmp_path}/store",
        global_batch_size=10,
        total_steps=total_steps,
    )


def stop_req(p: GenerationPlan, graceful: bool, grace_s: float = 10, **kw: object) -> StopRequest:
    return StopRequest(
        job=p.job,
        generation=p.generation,
        world_size=p.world_size,
        checkpoint=p.checkpoint,
        graceful=graceful,
        grace_s=grace_s,
        **kw,
    )


def watch_req(p: GenerationPlan, report_after_s: float = 0.5) -> WatchRequest:
    return WatchRequest(
        job=p.job,
        generation=p.generation,
        world_size=p.world_size,
        checkpoint=p.checkpoint,
        report_after_s=report_after_s,
    )


def wait_for(env: ActivityEnvironment, rt: LocalRuntime, p: GenerationPlan, step: int) -> None:
    """Watch until rank 0 reported progress at `step` or beyond."""
    deadline = time.monotonic() + 30
    while (env.run(rt.watch_generation, watch_req(p)).step or 0) < step:
        assert time.monotonic() < deadline, rt.log_path(p.job, 0, p.generation).read_text()


def first_lines(rt: LocalRuntime, p: GenerationPlan) -> list[str]:
    """Each rank's first line of output, once every rank has written one (the others may start
    later than rank 0 on a loaded machine: the gang start is no barrier)."""
    logs = [rt.log_path(p.job, r, p.generation) for r in range(p.world_size)]
    deadline = time.monotonic() + 30
    while not all(log.exists() and log.read_text() for log in logs):
        assert time.monotonic() < deadline, [log.exists() and log.read_text() for log in logs]
        time.sleep(0.05)
    return [log.read_text().splitlines()[0] for log in logs]


def pids(rt: LocalRuntime, p: GenerationPlan) -> list[int]:
    return [r.record()["pid"] for r in rt._ranks(p.job, p.generation)]


def running(pid: int) -> bool:
    return proc_start_time(pid) is not None


def test_start_is_idempotent_and_sets_the_worker_environment(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    rt = LocalRuntime(tmp_path / "rt")
    p = plan(tmp_path, worker, "train")
    env.run(rt.start_generation, p)
    first = pids(rt, p)
    env.run(rt.start_generation, p)
    assert pids(rt, p) == first and len(first) == 3 and all(map(running, first))

    wait_for(env, rt, p, 1)
    heads = first_lines(rt, p)
    port = (rt.gen_dir("job", 0) / "master_port").read_text()
    # the control file is the prompt channel here: an S3 store's record is polled each second
    assert heads == [
        f"rank=0 world=3 node=node-a port={port} batch=3 from=0 s3_poll=1.0",
        f"rank=1 world=3 node=node-a port={port} batch=3 from=0 s3_poll=1.0",
        f"rank=2 world=3 node=node-b port={port} batch=4 from=0 s3_poll=1.0",
    ]

    result = env.run(rt.stop_generation, stop_req(p, graceful=False))
    assert result.forced and not any(map(running, first))
    again = env.run(rt.stop_generation, stop_req(p, graceful=False))
    # A repeated stop finds nothing left to stop: the same figures, nothing forced this time.
    assert again == StopResult(
        acked_ranks=[], checkpoint_step=result.checkpoint_step, forced=False, step=result.step
    )
    unknown = plan(tmp_path, worker, "train", generation=7)
    assert not env.run(rt.stop_generation, stop_req(unknown, graceful=True)).forced


def test_elastic_event_is_acked_within_the_grace_period(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    rt = LocalRuntime(tmp_path / "rt")
    p = plan(tmp_path, worker, "train")
    env.run(rt.start_generation, p)
    wait_for(env, rt, p, 1)
    started = time.monotonic()
    result = env.run(rt.stop_generation, stop_req(p, graceful=True, grace_s=20))
    assert time.monotonic() - started < 5
    assert result.acked_ranks == [0, 1, 2] and not result.forced
    assert result.checkpoint_step == JobStore(p.checkpoint).latest_checkpoint()["step"]
    codes = [r.exit_code() for r in rt._ranks("job", 0)]
    assert codes == [0, 0, 0]


def test_stubborn_worker_is_killed_at_the_timeout_and_next_generation_resumes(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    rt = LocalRuntime(tmp_path / "rt", term_grace_s=1)
    p = plan(tmp_path, worker, "stubborn")
    env.run(rt.start_generation, p)
    wait_for(env, rt, p, 10)
    started = time.monotonic()
    result = env.run(rt.stop_generation, stop_req(p, graceful=True, grace_s=1))
    # grace (1 s), SIGTERM ignored for term_grace_s (1 s), then SIGKILL.
    assert 2 <= time.monotonic() - started < 6
    assert result.forced and result.acked_ranks == []
    assert result.checkpoint_step is not None and result.checkpoint_step >= 10
    assert not any(map(running, pids(rt, p)))

    nxt = plan(tmp_path, worker, "train", generation=1, total_steps=result.checkpoint_step + 5)
    env.run(rt.start_generation, nxt)
    done = env.run(rt.watch_generation, watch_req(nxt, report_after_s=20))
    assert done.outcome == "completed", done
    assert done.exit_codes == {0: 0, 1: 0, 2: 0} and done.step == nxt.total_steps
    log = rt.log_path("job", 2, 1).read_text()
    assert f"from={result.checkpoint_step}" in log


def test_crashed_rank_fails_the_watch_at_once(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    rt = LocalRuntime(tmp_path / "rt")
    p = plan(tmp_path, worker, "crash")
    env.run(rt.start_generation, p)
    started = time.monotonic()
    result = env.run(rt.watch_generation, watch_req(p, report_after_s=120))
    assert result.outcome == "failed" and result.exit_codes == {1: 3}
    assert time.monotonic() - started < 30  # (the three ranks' start included)
    assert result.detail.startswith("rank 1 exited with code 3: rank=1 world=3")
    env.run(rt.cleanup_job, CleanupRequest(job="job"))
    assert not rt.job_dir("job").exists()


def test_lost_node_processes_are_killed_and_the_watch_names_them(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    rt = LocalRuntime(tmp_path / "rt")
    p = plan(tmp_path, worker, "train")
    env.run(rt.start_generation, p)
    assert rt.kill_node("job", "node-b") == [2]
    result: WatchResult = env.run(rt.watch_generation, watch_req(p))
    assert result.outcome == "failed"
    assert result.detail == "rank 2 vanished without an exit code"
    alive = pids(rt, p)[:2]
    assert all(map(running, alive))

    env.run(rt.cleanup_job, CleanupRequest(job="job", keep=True))
    assert not any(map(running, alive))
    assert rt.log_path("job", 0).exists()  # kept for `spotrain logs`


CONTROLLER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from spotrain.activities.local import LocalRuntime
    from spotrain.workflows.contract import GenerationPlan

    LocalRuntime(Path(sys.argv[1])).start_generation(GenerationPlan.model_validate_json(sys.argv[2]))
    print("started", flush=True)
    time.sleep(60)
    """
)


def test_ranks_survive_a_killed_controller_and_a_new_one_finds_them(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    """The controller is a real process that gets SIGKILLed while its ranks run."""
    p = plan(tmp_path, worker, "train", total_steps=60)
    controller = subprocess.Popen(
        [sys.executable, "-c", CONTROLLER, str(tmp_path / "rt"), p.model_dump_json()],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert controller.stdout is not None and controller.stdout.readline() == "started\n"
    os.kill(controller.pid, signal.SIGKILL)
    controller.wait()

    rt = LocalRuntime(tmp_path / "rt")  # the restarted controller
    env.run(rt.start_generation, p)  # the retried activity starts nothing new
    assert len(set(pids(rt, p))) == 3
    progress = env.run(rt.watch_generation, watch_req(p, report_after_s=0.3))
    assert progress.outcome == "progress"
    done = env.run(rt.watch_generation, watch_req(p, report_after_s=20))
    assert done.outcome == "completed" and done.exit_codes == {0: 0, 1: 0, 2: 0}


def test_completed_waits_until_every_launcher_has_exited(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    """A launcher lives a moment past writing its exit code (longer on a loaded machine):
    "completed" lets the workflow release the nodes, so it must mean no process is left."""
    rt = LocalRuntime(tmp_path / "rt")
    p = plan(tmp_path, worker, "train", total_steps=5)
    env.run(rt.start_generation, p)
    assert env.run(rt.watch_generation, watch_req(p, report_after_s=20)).outcome == "completed"

    # Rank 1's launcher, caught between writing its exit code and exiting: a live process
    # recorded under its pid file (its exit file, and the done marker, are already there).
    lingering = subprocess.Popen(["sleep", "30"], start_new_session=True)
    rank1 = rt._ranks(p.job, p.generation)[1]
    start = proc_start_time(lingering.pid)
    rank1.pid_file.write_text(f'{{"pid": {lingering.pid}, "start": {start}, "node_id": "node-a"}}')
    assert rank1.exit_code() == 0
    assert env.run(rt.watch_generation, watch_req(p, report_after_s=0.3)).outcome == "progress"

    lingering.kill()
    lingering.wait()
    done = env.run(rt.watch_generation, watch_req(p, report_after_s=5))
    assert done.outcome == "completed" and done.exit_codes == {0: 0, 1: 0, 2: 0}


def test_a_notice_a_rank_found_goes_to_the_workflow_and_its_stop_is_no_fault(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    """A rank that heard EC2 itself (workers/elastic/imds.py) reports the notice to the store and
    stops; here SIGTERM stands in for its own elastic event. The watch hands the notice over
    at once, and after that the rank's exit 0 is no fault."""
    rt = LocalRuntime(tmp_path / "rt")
    p = plan(tmp_path, worker, "train")
    env.run(rt.start_generation, p)
    try:
        reports_the_notice(env, rt, p)
    finally:  # (the other ranks train on)
        env.run(rt.cleanup_job, CleanupRequest(job="job"))


def reports_the_notice(env: ActivityEnvironment, rt: LocalRuntime, p: GenerationPlan) -> None:
    wait_for(env, rt, p, 1)
    notice = {"kind": "interruption", "node_id": "node-b", "deadline": None, "event_id": "imds-1"}
    JobStore(p.checkpoint).report_notice(p.generation, notice)
    started = time.monotonic()
    found = env.run(rt.watch_generation, watch_req(p, report_after_s=30))
    assert time.monotonic() - started < 10  # not the 30 s report interval
    assert [n.model_dump(mode="json") for n in found.notices] == [notice]

    deadline = time.monotonic() + 30
    while "rank=2" not in rt.log_path("job", 2, 0).read_text():  # past the library's start
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert Rank(2, rt.gen_dir("job", 0)).signal(signal.SIGTERM, group=False)
    known = watch_req(p).model_copy(update={"known_events": ["imds-1"]})
    deadline = time.monotonic() + 30
    while Rank(2, rt.gen_dir("job", 0)).exit_code() is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    after = env.run(rt.watch_generation, known)
    assert after.outcome == "progress" and after.notices == [], after
    assert JobStore(p.checkpoint).acked_ranks(0) == [2]  # SIGTERM: checkpointed, then exit 0


def test_a_stale_stop_left_by_an_earlier_job_is_not_obeyed(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    """A job submitted again under the same name and checkpoint location starts at
    generation 0 again, where the earlier run left a 'stop' control record."""
    rt = LocalRuntime(tmp_path / "rt")
    p = plan(tmp_path, worker, "train")
    JobStore(p.checkpoint).write_control(0, {"kind": "stop", "event_id": "old", "time": 0})
    env.run(rt.start_generation, p)
    wait_for(env, rt, p, 40)  # over a second of steps: several polls of the control record
    assert all(r.alive() for r in rt._ranks("job", 0))
    assert JobStore(p.checkpoint).acked_ranks(0) == []
    env.run(rt.cleanup_job, CleanupRequest(job="job"))


def test_a_finished_jobs_location_is_refused_at_the_first_start(
    env: ActivityEnvironment, tmp_path: Path, worker: Path
) -> None:
    """A reused name started by any means (`temporal workflow start` too): the first
    generation finds the earlier job's completion marker and fails the job, saying how to
    resume; `spotrain submit --resume` (which removes the marker) starts."""
    rt = LocalRuntime(tmp_path / "rt")
    p = plan(tmp_path, worker, "train", generation=1)
    JobStore(p.checkpoint).write_done(600, 0)
    with pytest.raises(ApplicationError) as refused:
        env.run(rt.start_generation, p)
    assert refused.value.type == CONFIG_ERROR and refused.value.non_retryable
    assert "already finished (step 600)" in str(refused.value) and "--resume" in str(refused.value)
    assert rt._ranks("job", 1) == []  # nothing started
    JobStore(p.checkpoint).reopen()
    env.run(rt.start_generation, p)
    assert len(rt._ranks("job", 1)) == 3
    env.run(rt.cleanup_job, CleanupRequest(job="job"))
