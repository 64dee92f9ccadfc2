"""The background checkpoint's writer process (spotrain.elastic.checkpoint_writer): real DCP
saves of real tensors, a real spawned writer process, real shared memory."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402

from spotrain.elastic import checkpoint, checkpoint_writer  # noqa: E402


@pytest.fixture
def writer(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The writer process asked for, and a fresh decision, stager and process for each test,
    for states of any size; the process killed after."""
    for name in ("_use_process", "_stager", "_writer"):
        monkeypatch.setattr(checkpoint_writer, name, None)
    monkeypatch.setattr(checkpoint_writer, "PROCESS_FROM_BYTES", 0)
    monkeypatch.setenv(checkpoint_writer.WRITER_ENV, "process")
    yield
    if (pid := checkpoint_writer.pid()) is not None:
        os.kill(pid, signal.SIGKILL)
        checkpoint_writer._writer[0].join(10)  # type: ignore[index]


def save_in_background(state: dict, path: Path) -> dcp.Metadata:
    """Checkpointer.save_async's save, on one process (no process group)."""
    future = checkpoint.save_in_background(state, str(path))
    for tensor in state.values():  # training goes on at once: the save has its own copy
        tensor.add_(1000)
    return future.result()


def loaded(path: Path, like: dict) -> dict:
    state = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def test_a_background_save_writes_in_a_process_of_its_own_at_nice_19(
    writer: None, tmp_path: Path
) -> None:
    """Its serialization never holds the training process's GIL nor its threads' CPU: the
    files come from another process, at nice 19, and hold the state as it was when the save
    began, though training changed it at once."""
    state = {"w": torch.arange(1000, dtype=torch.float32), "m": torch.ones(3, 7)}
    expected = {k: v.clone() for k, v in state.items()}
    save_in_background(state, tmp_path / "ckpt")
    pid = checkpoint_writer.pid()
    assert pid is not None and pid != os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, pid) == 19
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0
    got = loaded(tmp_path / "ckpt", expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_staging_reuses_its_shared_memory_copy_across_saves(writer: None) -> None:
    """After the first save, staging is a copy into the same shared buffers: no allocation,
    no page faults, and handles the writer process already holds."""
    state = {"w": torch.randn(4096)}
    first = checkpoint_writer.stager(state).stage(state)["w"]  # type: ignore[union-attr]
    state["w"].mul_(2)
    second = checkpoint_writer.stager(state).stage(state)["w"]  # type: ignore[union-attr]
    assert first.is_shared() and second.data_ptr() == first.data_ptr()
    assert torch.equal(second, state["w"])


def test_a_writer_process_that_died_is_replaced_at_the_next_save(
    writer: None, tmp_path: Path
) -> None:
    save_in_background({"w": torch.ones(8)}, tmp_path / "one")
    first = checkpoint_writer.pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    checkpoint_writer._writer[0].join(10)  # type: ignore[index]
    save_in_background({"w": torch.full((8,), 2.0)}, tmp_path / "two")
    assert checkpoint_writer.pid() not in (None, first)
    assert torch.equal(loaded(tmp_path / "two", {"w": torch.ones(8)})["w"], torch.full((8,), 2.0))


def test_the_writer_process_s_error_fails_the_save_here(writer: None, tmp_path: Path) -> None:
    """A write that fails there fails the save here with its reason, and the writer serves
    the next one. (The failure: planned here for one directory, written there under a file.)"""
    (tmp_path / "taken").write_text("a file, not a directory")
    state = {"w": torch.ones(8)}
    stager = checkpoint_writer.stager(state)
    blocked = checkpoint.storage_writer(str(tmp_path / "planned"), background="process")
    blocked.location = str(tmp_path / "taken" / "ckpt")  # type: ignore[attr-defined]
    with pytest.raises(checkpoint.FAILED, match="Not a directory"):
        dcp.async_save(state, storage_writer=blocked, async_stager=stager, no_dist=True).result()
    save_in_background(state, tmp_path / "ok")
    assert torch.equal(loaded(tmp_path / "ok", {"w": torch.ones(8)})["w"], torch.ones(8))


def test_a_small_state_is_written_from_a_thread(
    writer: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Starting a Python with torch costs more than writing a few megabytes beside training."""
    monkeypatch.setattr(checkpoint_writer, "PROCESS_FROM_BYTES", 64 * 2**20)
    save_in_background({"w": torch.ones(1000)}, tmp_path / "ckpt")
    assert checkpoint_writer.pid() is None
    assert torch.equal(loaded(tmp_path / "ckpt", {"w": torch.ones(1000)})["w"], torch.ones(1000))


@pytest.mark.parametrize("asked", [None, "thread", "proces"])
def test_unless_the_process_is_asked_for_the_save_writes_from_a_thread(
    writer: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
    asked: str | None,
) -> None:
    """The thread is the default (it measured better where ranks train on the CPU); a value
    the rank does not know is said once, not taken for either."""
    if asked is None:
        monkeypatch.delenv(checkpoint_writer.WRITER_ENV)
    else:
        monkeypatch.setenv(checkpoint_writer.WRITER_ENV, asked)
    state = {"w": torch.ones(1000)}
    save_in_background(state, tmp_path / "ckpt")
    save_in_background(state, tmp_path / "again")
    assert checkpoint_writer.pid() is None
    err = capfd.readouterr().err
    told = "background checkpoints write from a thread: SPOTRAIN_CHECKPOINT_WRITER='proces'"
    assert err.count(told) == (asked == "proces"), err
    assert torch.equal(loaded(tmp_path / "again", state)["w"], torch.full((1000,), 1001.0))


def test_without_room_in_dev_shm_the_save_writes_from_a_yielding_thread(
    writer: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    """A container's default 64 MB /dev/shm cannot hold a real state: touching shared memory
    beyond it would kill the rank (SIGBUS). The rank writes from a thread instead, says why
    once, and starts no writer process."""
    monkeypatch.setattr(checkpoint_writer, "shm_free", lambda: 64 * 2**20)
    state = {"w": torch.zeros(20 * 2**20)}  # 80 MB
    save_in_background(state, tmp_path / "ckpt")
    save_in_background(state, tmp_path / "again")
    assert checkpoint_writer.pid() is None
    err = capfd.readouterr().err
    assert err.count("background checkpoints write from a thread") == 1
    assert "/dev/shm has 64 MiB free, the state needs 80 MiB" in err
    assert torch.equal(loaded(tmp_path / "again", state)["w"], torch.full((20 * 2**20,), 1000.0))
