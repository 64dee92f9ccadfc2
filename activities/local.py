"""The local rank runtime: each rank of a generation is a process on this machine.

State lives in files under `root`, so a controller that crashes (or a fresh LocalRuntime on
the same root) finds everything again:

    jobs/<job>/gen-<g>/rank-<r>.pid     {"pid", "start", "node_id"}  start: /proc/<pid>/stat
    jobs/<job>/gen-<g>/rank-<r>.exit    {"code", "time"}             written by the launcher
    jobs/<job>/gen-<g>/rank-<r>.log     the rank's stdout and stderr
    jobs/<job>/gen-<g>/master_port      chosen once per generation
    jobs/<job>/gen-<g>/control          non-empty: the elastic event (the fallback of the
                                        control record in the checkpoint store, the same JSON)

Each rank runs under `workers/elastic/launcher.py` in a session of its own (the process group
id is the launcher's pid): it outlives the controller and its exit code is recorded anyway.
A pid alone could be recycled; a pid with its kernel start time cannot. A rank's files and
process (`Rank`, the /proc reads) are in activities/local_ranks.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from temporalio import activity

from spotrain.activities.checkpoint_check import check_checkpoint
from spotrain.activities.command_launch import launch_command
from spotrain.activities.local_ranks import Rank, job_processes, proc_start_time, read_json, tail
from spotrain.activities.notice import raise_elastic_event, rank_notices, reset_control
from spotrain.elastic import environment, launcher
from spotrain.elastic.control import STORE_POLL_ENV
from spotrain.elastic.job_store import JobStore, checked_store
from spotrain.workflows import contract
from spotrain.workflows.contract import (
    CleanupRequest,
    GenerationPlan,
    ReclaimNotice,
    StopRequest,
    StopResult,
    WatchRequest,
    WatchResult,
)

POLL_S = 0.25
HEAD_START = "head_start.json"  # the membership prepare_generation started ranks for
HEAD_START_WAIT_S = 240.0  # for them to be up (the running generation trains meanwhile)
LIVE_POLL_S = 0.02  # a live stop's wait for parked ranks is part of the training pause
STORE_POLL_S = 1.0  # the store's control record, behind the control file (control.py)
START_FAILURE_WAIT_S = 10.0  # for every rank of a generation that failed before its first step


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _heartbeat() -> None:
    """Heartbeat when running as an activity; the spot simulator and CLI call in directly."""
    if activity.in_activity():
        activity.heartbeat()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _places(plan: GenerationPlan) -> Iterator[tuple[int, int, str, int]]:
    """(rank, node index, node id, local rank) of every process of the plan, in rank order."""
    rank = 0
    for node_index, member in enumerate(plan.members):
        for local_rank in range(member.procs):
            yield rank, node_index, member.node_id, local_rank
            rank += 1


class LocalRuntime:
    """Rank-runtime activities (contract names) over local processes, state under `root`."""

    def __init__(self, root: Path, term_grace_s: float = 5.0) -> None:
        self.root = Path(root)
        self.term_grace_s = term_grace_s  # SIGTERM -> SIGKILL

    # --- paths ---------------------------------------------------------------------------

    def job_dir(self, job: str) -> Path:
        return self.root / "jobs" / job

    def gen_dir(self, job: str, generation: int) -> Path:
        return self.job_dir(job) / f"gen-{generation}"

    def control_file(self, job: str, generation: int) -> Path:
        return self.gen_dir(job, generation) / "control"

    def log_path(self, job: str, rank: int = 0, generation: int | None = None) -> Path:
        """The log of `spotrain logs NAME --rank R --generation G` (default: the latest)."""
        if generation is None:
            generation = max(self._generations(job), default=0)
        return Rank(rank, self.gen_dir(job, generation)).log_file

    def _generations(self, job: str) -> list[int]:
        base = self.job_dir(job)
        if not base.is_dir():
            return []
        return sorted(int(p.name.removeprefix("gen-")) for p in base.glob("gen-*"))

    def _ranks(self, job: str, generation: int) -> list[Rank]:
        """Every rank that was started in this generation (has a pid file)."""
        gdir = self.gen_dir(job, generation)
        return sorted(
            (Rank(int(p.stem.removeprefix("rank-")), gdir) for p in gdir.glob("rank-*.pid")),
            key=lambda r: r.rank,
        )

    def _master_port(self, gdir: Path) -> int:
        """Chosen once per generation: the first writer wins (link fails if it exists)."""
        path = gdir / "master_port"
        fd, tmp = tempfile.mkstemp(dir=gdir, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(str(_free_port()))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        os.unlink(tmp)
        return int(path.read_text())

    # --- activities ----------------------------------------------------------------------

    @activity.defn(name=contract.START_GENERATION)
    def start_generation(self, plan: GenerationPlan) -> None:
        """Start every rank not started yet (live: adopt the parked ones first), then mark the
        generation started; a repeat call (a retry) starts nothing new."""
        gdir = self.gen_dir(plan.job, plan.generation)
        gdir.mkdir(parents=True, exist_ok=True)
        port = self._master_port(gdir)
        control = str(self.control_file(plan.job, plan.generation))
        store = checked_store(plan.checkpoint, time.time(), plan.generation)
        reset_control(plan.checkpoint, plan.generation)
        live = plan.resize == "live"
        parked = self._parked(plan, store) if live else {}
        if live:
            self._drop_head_start(plan, parked)  # (before any survivor's pid file is written)
        adopted = self._adopt(plan, parked, port, control, store) if live else set()
        for rank, node_index, node_id, local_rank in _places(plan):
            r = Rank(rank, gdir)
            if r.pid_file.exists():
                continue
            env = self._env(plan, node_index, local_rank, port, control)
            if live:
                env[environment.STATE_FROM] = "peers" if adopted else "checkpoint"
            command = launch_command(plan, node_index, sys.executable, local_rank)
            self._launch(r, command, env, node_id, local_rank)
        if adopted:
            # Survivors meet their new peers at the gang start, within the collective timeout:
            # not before those are up (a rank started now imports torch and builds its model).
            fresh = [Rank(r, gdir) for r, *_ in _places(plan) if r not in adopted]
            self._wait(lambda: self._up(store, plan.generation, fresh), HEAD_START_WAIT_S)
        store.mark_started(plan.generation, time.time())  # one machine: all up

    @activity.defn(name=contract.PREPARE_GENERATION)
    def prepare_generation(self, plan: GenerationPlan) -> None:
        """Live resize: start the next generation's new ranks (places no running rank will
        take) ahead of it; they import torch and build their model, then wait in
        `wait_for_gang` for `start_generation`, while the running generation trains on."""
        gdir = self.gen_dir(plan.job, plan.generation)
        gdir.mkdir(parents=True, exist_ok=True)
        port, control = self._master_port(gdir), str(self.control_file(plan.job, plan.generation))
        reset_control(plan.checkpoint, plan.generation)
        _write_atomic(gdir / HEAD_START, plan.model_dump_json(include={"members"}))
        running = {
            ((rec := r.record() or {}).get("node_id"), rec.get("local_rank", 0))
            for r in self._ranks(plan.job, plan.generation - 1)
            if r.alive()
        }
        for rank, node_index, node_id, local_rank in _places(plan):
            r = Rank(rank, gdir)
            if (node_id, local_rank) in running or r.pid_file.exists():
                continue
            env = self._env(plan, node_index, local_rank, port, control)
            env[environment.STATE_FROM] = "peers"
            command = launch_command(plan, node_index, sys.executable, local_rank)
            self._launch(r, command, env, node_id, local_rank)
        store = JobStore(plan.checkpoint)
        ahead = self._ranks(plan.job, plan.generation)
        self._wait(lambda: self._up(store, plan.generation, ahead), HEAD_START_WAIT_S)

    @staticmethod
    def _up(store: JobStore, generation: int, ranks: list[Rank]) -> bool:
        """Every one of `ranks` waits for the gang start (or is gone: nothing to wait for)."""
        waiting = store.waiting_ranks(generation)
        return all(r.rank in waiting or not r.alive() for r in ranks)

    def _drop_head_start(self, plan: GenerationPlan, parked: dict[int, dict[str, Any]]) -> None:
        """Ranks started ahead (`prepare_generation`) for another membership than the one
        starting now, or to take the state from peers when no survivor parked, are not this
        generation's: gone, so that it starts its own."""
        gdir = self.gen_dir(plan.job, plan.generation)
        head_start = read_json(gdir / HEAD_START)
        if head_start is None:
            return
        if not parked or head_start != plan.model_dump(mode="json", include={"members"}):
            ahead = self._ranks(plan.job, plan.generation)
            self._kill(ahead)
            for r in ahead:
                r.pid_file.unlink(missing_ok=True)
        (gdir / HEAD_START).unlink(missing_ok=True)

    def _parked(self, plan: GenerationPlan, store: JobStore) -> dict[int, dict[str, Any]]:
        """The previous generation's parked ranks (acked, alive): rank -> its pid record."""
        previous = plan.generation - 1
        acked = store.ack_steps(previous)
        return {
            r.rank: r.record() or {}
            for r in self._ranks(plan.job, previous)
            if r.rank in acked and r.alive()
        }

    @staticmethod
    def _env(
        plan: GenerationPlan, node_index: int, local_rank: int, port: int, control: str
    ) -> dict[str, str]:
        env = environment.rank_env(
            plan, node_index, local_rank, master_port=port, control_file=control
        )
        env["MASTER_ADDR"] = "127.0.0.1"  # every "node" of this runtime is this machine
        # The control file, written with the store's record, is polled every 0.05 s: the
        # record is the backup (stop_generation writes both again when retried).
        env[STORE_POLL_ENV] = str(STORE_POLL_S)
        if plan.resize == "live":
            env[environment.RESIZE] = "live"
        return env

    def _adopt(
        self,
        plan: GenerationPlan,
        parked: dict[int, dict[str, Any]],
        port: int,
        control: str,
        store: JobStore,
    ) -> set[int]:
        """Live resize: place the previous generation's parked ranks (alive, acked) on this
        generation's member nodes, keeping their local rank, and tell every parked rank its
        new environment or that it leaves (`gen-<previous>/next.json`). The ranks they took
        in this generation. The placement follows from the files, so a retry writes the
        same."""
        previous = plan.generation - 1
        gdir = self.gen_dir(plan.job, plan.generation)
        places: dict[str, dict[str, str] | None] = {str(old): None for old in parked}
        by_place = {(rec.get("node_id"), rec.get("local_rank", 0)): o for o, rec in parked.items()}
        taken = set()
        for rank, node_index, node_id, local_rank in _places(plan):
            old = by_place.get((node_id, local_rank))
            if old is None:
                continue
            taken.add(rank)
            was, rec = Rank(old, self.gen_dir(plan.job, previous)), parked[old]
            _write_atomic(
                Rank(rank, gdir).pid_file,
                json.dumps({**rec, "exit": rec.get("exit") or str(was.exit_file)}),
            )
            log = Rank(rank, gdir).log_file
            if not log.exists():
                log.symlink_to(was.log_file.resolve())
            env = self._env(plan, node_index, local_rank, port, control)
            places[str(old)] = {k: v for k, v in env.items() if k not in plan.env}
        store.write_next(previous, {"generation": plan.generation, "ranks": places})
        return taken

    def _launch(
        self, r: Rank, command: list[str], env: dict[str, str], node_id: str, local_rank: int
    ) -> None:
        """Start the rank's launcher and record it. A controller crash between the two lines
        (microseconds) would let the retry start the rank twice: DDP then fails the generation.
        Workers inherit the controller's environment (PATH, cloud credentials for S3)."""
        with r.log_file.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, launcher.__file__, str(r.exit_file), "--", *command],
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        start = proc_start_time(proc.pid)
        if start is None:  # exited already (e.g. bad interpreter): still record who it was
            start = -1
        record = {"pid": proc.pid, "start": start, "node_id": node_id, "local_rank": local_rank}
        _write_atomic(r.pid_file, json.dumps(record))

    @activity.defn(name=contract.STOP_GENERATION)
    def stop_generation(self, req: StopRequest) -> StopResult:
        """Lost nodes' ranks die at once; the rest get the elastic event and `grace_s` to
        checkpoint, ack and exit (if graceful), then SIGTERM, then SIGKILL."""
        ranks = self._ranks(req.job, req.generation)
        store = JobStore(req.checkpoint)
        lost = [r for r in ranks if (r.record() or {}).get("node_id") in req.lost_node_ids]
        if (req.graceful or req.live) and ranks:
            # the control record every rank polls; first, so that the lost nodes' peers stop
            # waiting on them even where no kill reaches a lost node (a frozen or cut-off one)
            record = raise_elastic_event(req)
            _write_atomic(self.control_file(req.job, req.generation), json.dumps(record))
        forced = self._kill(lost)
        parked: dict[int, int] = {}
        if req.live:  # ranks ack, then park alive (live.py): wait for every one to do either
            self._wait(
                lambda: all(r.rank in parked or not r.alive() for r in ranks),
                req.grace_s,
                poll_s=LIVE_POLL_S,
                each=lambda: parked.update(store.ack_steps(req.generation)),
            )
            parked = {r.rank: parked[r.rank] for r in ranks if r.rank in parked and r.alive()}
        elif req.graceful and ranks:
            # Ranks ack once checkpointed, then exit 0: waiting for the exits covers both.
            self._wait(lambda: not any(r.alive() for r in ranks), req.grace_s)
        survivors = [r for r in ranks if r.alive() and r.rank not in parked]
        if survivors and req.graceful:
            for r in survivors:
                r.signal(signal.SIGTERM, group=False)
            self._wait(lambda: not any(r.alive() for r in survivors), self.term_grace_s)
        self._kill(survivors)
        forced = forced or bool(survivors)
        acked, checkpoint_step, step, done = store.ended(req.generation)
        return StopResult(
            acked_ranks=acked,
            checkpoint_step=checkpoint_step,
            forced=forced,
            step=step,
            held_step=max(parked.values()) if parked else None,
            done=done,
        )

    @activity.defn(name=contract.WATCH_GENERATION)
    def watch_generation(self, req: WatchRequest) -> WatchResult:
        """Poll until a rank fails, the job completes, or it is time to report progress."""
        ranks = [Rank(r, self.gen_dir(req.job, req.generation)) for r in range(req.world_size)]
        store = JobStore(req.checkpoint)
        control = self.control_file(req.job, req.generation)
        deadline = time.monotonic() + req.report_after_s
        while True:
            _heartbeat()
            alive = {r.rank: r.alive() for r in ranks}  # before exit codes: no false "vanished"
            codes = {r.rank: c for r in ranks if (c := r.exit_code()) is not None}
            done = store.done() is not None
            notices = rank_notices(store, req.generation)
            event = control.exists() or bool(notices)  # a rank that heard EC2 stops itself
            for r in ranks:
                code = codes.get(r.rank)
                why = None
                if code is None and not alive[r.rank]:
                    known = r.pid_file.exists()
                    why = "vanished without an exit code" if known else "was never started"
                elif code is not None and code != 0:
                    why = f"exited with code {code}"
                elif code == 0 and not done and not event:
                    why = "exited 0 without the completion marker or an elastic event"
                if why:
                    return self._failed(r, why, ranks, store, req.generation)
            if not event and (parked := store.ack_steps(req.generation)):
                # Live resize: a rank whose peer was lost parks holding its step; nobody
                # asked it to, so the generation has failed (its survivors keep their state).
                rank, step = min(parked.items())
                why = f"lost a peer and parked holding step {step}"
                return self._failed(ranks[rank], why, ranks, store, req.generation)
            if any(n.event_id not in req.known_events for n in notices):
                return self._result("progress", store, req.generation, codes, notices)
            # A launcher lives a moment past writing its exit code: "completed" means gone.
            if done and len(codes) == len(ranks) and not any(alive.values()):
                return self._result("completed", store, req.generation, codes)
            if time.monotonic() >= deadline:
                return self._result("progress", store, req.generation, codes)
            time.sleep(POLL_S)

    @activity.defn(name=contract.CLEANUP_JOB)
    def cleanup_job(self, req: CleanupRequest) -> None:
        """Kill whatever is left of the job; drop its state unless kept (logs for debugging)."""
        for generation in self._generations(req.job):
            self._kill(self._ranks(req.job, generation))
        if not req.keep:
            shutil.rmtree(self.job_dir(req.job), ignore_errors=True)

    def activities(self) -> list[Callable[..., Any]]:
        return [
            check_checkpoint,
            self.start_generation,
            self.prepare_generation,
            self.stop_generation,
            self.watch_generation,
            self.cleanup_job,
        ]

    def reap(
        self, is_job_running: Callable[[str], bool], apply: bool = False
    ) -> dict[str, list[int]]:
        """Jobs under this state dir whose workflow no longer runs but whose rank processes
        still do (a terminated workflow runs no cleanup): job -> pids. Only with `apply` are
        they killed (their logs stay); the default is a dry run."""
        orphans = {}
        for job_dir in sorted((self.root / "jobs").glob("*")):
            pids = job_processes(job_dir.name)
            if pids and not is_job_running(job_dir.name):
                orphans[job_dir.name] = pids
        if apply:
            for job in orphans:
                self.cleanup_job(CleanupRequest(job=job, keep=True))
        return orphans

    # --- for the spot simulator ----------------------------------------------------------

    def kill_node(self, job: str, node_id: str) -> list[int]:
        """The node's instance is gone, so are its processes (every generation), all at once:
        one of its ranks never outlives another long enough to see it die and park. The ranks
        that were still running."""
        on_node = [
            r
            for generation in self._generations(job)
            for r in self._ranks(job, generation)
            if (r.record() or {}).get("node_id") == node_id
        ]
        # (a rank adopted by a live resize is one process under several generations' ranks:
        # named by the first)
        running: dict[int, int] = {}
        for r in on_node:
            if (pid := r.live_pid()) is not None:
                running.setdefault(pid, r.rank)
        self._kill(on_node)
        return list(running.values())

    # --- helpers -------------------------------------------------------------------------

    @staticmethod
    def _result(
        outcome: Literal["progress", "completed"],
        store: JobStore,
        generation: int,
        codes: dict[int, int],
        notices: list[ReclaimNotice] | None = None,
    ) -> WatchResult:
        progress = store.progress(generation)
        latest = store.latest_checkpoint()
        return WatchResult(
            outcome=outcome,
            step=progress["step"] if progress else None,
            checkpoint_step=latest["step"] if latest else None,
            exit_codes=codes,
            notices=notices or [],
            checkpoints=store.checkpoint_stats(),
            ranks=store.rank_steps(generation, time.time()),
        )

    def _failed(
        self, first: Rank, why: str, ranks: list[Rank], store: JobStore, generation: int
    ) -> WatchResult:
        """A rank failed. Before the generation's first step the others get a moment to fail
        too (a command that cannot start fails on every rank) so the job can tell, and the
        failed ranks' last lines say why."""
        stepped = store.progress(generation) is not None
        if not stepped:
            self._wait(lambda: not any(r.alive() for r in ranks), START_FAILURE_WAIT_S)
        codes = {r.rank: c for r in ranks if (c := r.exit_code()) is not None}
        output = {r.rank: tail(r.log_file) for r in ranks if codes.get(r.rank, 0) != 0}
        last = output.get(first.rank, "").rsplit("\n", 1)[-1]
        return WatchResult(
            outcome="failed",
            exit_codes=codes,
            detail=f"rank {first.rank} {why}" + (f": {last}" if last else ""),
            stepped=stepped,
            output=output,
        )

    @staticmethod
    def _wait(
        until: Callable[[], bool],
        timeout_s: float,
        poll_s: float = POLL_S,
        each: Callable[[], None] = lambda: None,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            each()
            if until() or time.monotonic() >= deadline:
                return
            _heartbeat()
            time.sleep(poll_s)

    def _kill(self, ranks: list[Rank]) -> bool:
        """SIGKILL each live rank's whole process group; True if any was still running."""
        killed = [r for r in ranks if r.signal(signal.SIGKILL, group=True)]
        self._wait(lambda: not any(r.alive() for r in killed), self.term_grace_s)
        return bool(killed)
