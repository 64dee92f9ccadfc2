"""The training library in this process, with the environment the runtimes really build
(environment.rank_env), against a file store and against S3 (moto's server on loopback)."""

from __future__ import annotations

import builtins
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import pytest

from spotrain import elastic
from spotrain.elastic import control, environment
from spotrain.elastic.job_store import AFTER_RESIZE, JobStore
from spotrain.elastic.step_times import STUCK_AFTER_S, StepClock
from spotrain.workflows.contract import GenerationPlan, Member


@pytest.fixture(autouse=True)
def fresh_library(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The library caches per process (one rank = one process); a test is a new 'process'.
    No SIGTERM handler in pytest's own process (tests/elastic/test_control_channel.py covers it)."""
    monkeypatch.setattr(elastic, "_channel", None)
    monkeypatch.setattr(elastic, "_last_progress", 0.0)
    monkeypatch.setenv(elastic.SIGTERM_ENV, "0")
    monkeypatch.setenv(control.POLL_ENV, "0.05")
    elastic.settings.cache_clear()
    elastic.store.cache_clear()
    yield
    if elastic._channel is not None:
        elastic._channel.close()
    elastic.settings.cache_clear()
    elastic.store.cache_clear()


def as_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int, checkpoint: str | None = None
) -> Path:
    """Set this process's environment to rank `rank` of a 2-node x 2-proc generation."""
    plan = GenerationPlan(
        job="lib",
        generation=3,
        members=[Member(node_id=n, address="10.0.0.1", procs=2) for n in ("i-a", "i-b")],
        command=["train"],
        checkpoint=checkpoint or f"file://{tmp_path}/store",
        scale_config={"lr": 0.1},
        global_batch_size=10,
        total_steps=100,
    )
    control = tmp_path / "control"
    node, local = divmod(rank, 2)
    env = environment.rank_env(plan, node, local, master_port=29500, control_file=str(control))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(elastic, "_last_progress", 0.0)  # a fresh process's throttles, clock
    monkeypatch.setattr(elastic, "_last_step_times", 0.0)
    monkeypatch.setattr(elastic, "_clock", StepClock())
    return control


def test_settings_follow_the_runtime_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    as_rank(monkeypatch, tmp_path, rank=3)
    s = elastic.settings()
    assert (s.job, s.generation, s.rank, s.local_rank, s.world_size) == ("lib", 3, 3, 1, 4)
    assert (s.node_id, s.total_steps, s.scale_config) == ("i-b", 100, {"lr": 0.1})
    # 10 over 4 ranks: 2, 2, 3, 3; rank 3 takes the last 3 positions of each global batch.
    assert (s.global_batch_size, s.local_batch_size) == (10, 3)
    assert s.batch_slice() == range(7, 10)


def test_batch_slices_tile_the_global_batch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    slices = []
    for rank in range(4):
        as_rank(monkeypatch, tmp_path, rank)
        elastic.settings.cache_clear()
        s = elastic.settings()
        assert len(s.batch_slice()) == s.local_batch_size
        slices.append(s.batch_slice())
    assert [p for sl in slices for p in sl] == list(range(10))


def test_control_file_is_read_only_when_it_changes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    control_path = tmp_path / "control"
    source = control.ControlFile(str(control_path), interval_s=1)
    opened: list[Any] = []
    real_open = builtins.open

    def counting_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    assert source.poll() is None  # no file yet: no event
    control_path.write_text("")
    assert source.poll() is None  # empty (Kubernetes: no annotation)
    for _ in range(100):
        assert source.poll() is None
    assert opened == [str(control_path)]  # read once, then only stat'ed

    control_path.write_text("stop")
    os.utime(control_path, ns=(1, 1))  # a different mtime even on coarse-clock filesystems
    assert source.poll() == {"kind": "stop", "detail": "stop"}


def test_elastic_event_latches_and_costs_no_io_per_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The training loop's check reads a flag: no stat, no open in the calling thread; the
    channel's own threads poll. Once raised, the event stays (the generation is stopping)."""
    control_file = as_rank(monkeypatch, tmp_path, rank=0)
    assert not elastic.elastic_event_detected()  # starts the channel
    main = threading.main_thread()
    io_in_loop: list[str] = []
    real_stat, real_open = os.stat, builtins.open

    def stat(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is main:
            io_in_loop.append("stat")
        return real_stat(*args, **kwargs)

    def open_(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is main:
            io_in_loop.append("open")
        return real_open(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(os, "stat", stat)
        patched.setattr(builtins, "open", open_)
        for _ in range(1000):
            assert not elastic.elastic_event_detected()
        control_file.write_text("checkpoint-and-stop")
        deadline = time.monotonic() + 10
        while not elastic.elastic_event_detected():
            assert time.monotonic() < deadline
    assert io_in_loop == []
    assert elastic.elastic_event()["source"] == "control file"
    control_file.unlink()
    time.sleep(0.2)
    assert elastic.elastic_event_detected()


def test_wait_for_gang_holds_the_rank_until_the_generation_is_marked_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    as_rank(monkeypatch, tmp_path, rank=2)
    store = JobStore(f"file://{tmp_path}/store")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(elastic.wait_for_gang, 0.01)
        time.sleep(0.3)
        assert not waiting.done()  # no mark: some pod of the gang is not up yet
        store.mark_started(2, time.time())  # another generation's mark does not count
        time.sleep(0.3)
        assert not waiting.done()
        store.mark_started(3, time.time())  # what the runtime writes once all are up
        assert waiting.result(timeout=5).rank == 2


def test_acks_progress_and_markers_go_to_the_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    as_rank(monkeypatch, tmp_path, rank=1)
    store = JobStore(f"file://{tmp_path}/store")
    elastic.report_progress(5, force=True)
    elastic.mark_checkpoint(5, "/ckpt/5")
    elastic.mark_done(5)
    assert store.progress(3) is None and store.latest_checkpoint() is None  # rank 0's job
    assert [(r.rank, r.step) for r in store.rank_steps(3, time.time())] == [(1, 5)]  # its own
    assert store.done() is None
    elastic.ack_checkpoint(5)
    assert store.acked_ranks(3) == [1]

    elastic.settings.cache_clear()
    as_rank(monkeypatch, tmp_path, rank=0)
    elastic.report_progress(6)
    elastic.report_progress(7)  # within a second of the last: throttled
    assert store.progress(3)["step"] == 6
    elastic.report_progress(8, force=True)
    assert store.progress(3)["step"] == 8
    elastic.mark_checkpoint(8, "/ckpt/8")
    assert elastic.latest_checkpoint() == {"step": 8, "path": "/ckpt/8"}
    elastic.mark_done(10)
    assert store.done()["step"] == 10 and store.progress(3)["step"] == 10


def test_a_section_written_as_stuck_is_rewritten_at_the_next_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Under load a rank's ordinary work can outlast STUCK_AFTER_S, and the stuck watch writes
    it as stuck: its next step rewrites the record at once, not STEP_TIMES_INTERVAL_S later.
    Else a rank that then waits in a collective (a peer hung) still looks stuck in its own
    work, and the lockstep job has no culprit (tests/workflows/test_stragglers.py,
    lockstep-hang)."""
    as_rank(monkeypatch, tmp_path, rank=0)
    store = JobStore(f"file://{tmp_path}/store")
    elastic.report_progress(5, force=True)
    clock = elastic._clock
    clock.begin_busy(time.time() - 2 * STUCK_AFTER_S)  # 20 ms of work that took 2 s
    with clock.lock:
        stuck = clock.stuck_record(time.time())
    assert stuck is not None
    store.write_rank_steps(3, 0, stuck)  # (what the watch thread writes)
    assert store.rank_steps(3, time.time())[0].busy_s is not None
    clock.end_busy(2 * STUCK_AFTER_S)
    elastic.report_progress(6)  # well within STEP_TIMES_INTERVAL_S of the last write
    [record] = store.rank_steps(3, time.time())
    assert (record.step, record.busy_s) == (6, None)
    elastic.report_progress(7)  # and then throttled again
    assert store.rank_steps(3, time.time())[0].step == 6


def test_acks_reach_s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, moto_endpoint: str) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket="lib-acks")
    as_rank(monkeypatch, tmp_path, rank=2, checkpoint="s3://lib-acks/jobs/lib")
    elastic.ack_checkpoint(40)
    assert JobStore("s3://lib-acks/jobs/lib").acked_ranks(3) == [2]


def test_a_rank_that_heard_of_a_notice_only_from_its_peers_still_owes_its_checkpoint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ranks learn of an event a poll apart: one may park on its peers' all-reduced flag before
    its own channel read the control record. Parked on a live notice, it still owes the
    notice's checkpoint in the next generation (when every survivor parks so, none would
    write it: found beside busy loops). Its channel is held unlatched here (poll stood in for)."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from spotrain.elastic import live
    from spotrain.workers.embedded.stack import free_port

    monkeypatch.setattr(control.StoreRecord, "poll", lambda self: None)
    monkeypatch.setattr(live, "_owed", None)
    monkeypatch.setattr(live, "_due", None)

    def one_rank(generation: int) -> dict[str, str]:
        plan = GenerationPlan(
            job="lib",
            generation=generation,
            members=[Member(node_id="i-a", address="127.0.0.1")],
            command=["train"],
            checkpoint=f"file://{tmp_path}/store",
            global_batch_size=10,
            total_steps=100,
        )
        control_file = str(tmp_path / "control")
        return environment.rank_env(plan, 0, 0, master_port=free_port(), control_file=control_file)

    for key, value in one_rank(3).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(environment.RESIZE, "live")  # (the runtime's part of the environment)
    store = JobStore(f"file://{tmp_path}/store")
    notice = time.time() - 5
    store.write_control(
        3,
        {
            "kind": "stop",
            "event_id": "stop-lib-3",
            "time": notice + 1,
            "notice_at": datetime.fromtimestamp(notice, UTC).isoformat(),
            "checkpoint": AFTER_RESIZE,
            "lost": [],
        },
    )
    assert not elastic.elastic_event_detected()  # heard of only from its peers
    store.write_next(3, {"generation": 4, "ranks": {"0": one_rank(4)}})
    store.mark_started(4, time.time())
    s = live.next_generation(12)
    try:
        assert s is not None and s.generation == 4
        assert live.agree(12) == [12]
        assert live.checkpoint_owed() == pytest.approx(notice)
        assert live.checkpoint_owed() is None  # owed once
    finally:
        if dist.is_initialized():  # (else a failed park's assertion would be hidden)
            dist.destroy_process_group()
