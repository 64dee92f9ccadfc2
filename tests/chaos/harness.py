"""The chaos suite's harness: a Temporal dev server it can SIGKILL and restart from its SQLite
file, spotrain workers as real subprocesses (optionally with a crash point), one elastic job
through a reclaim-resize-replace cycle, and the checks every scenario ends with.

What is real: the `temporal` dev server binary, the worker process (the production worker, or
`crash_worker` = the same worker plus a crash point), moto's server on loopback (in the test
process, so the backend can be inspected and faults injected), the local runtime's rank
processes (`train.py`, the real training library) and the file checkpoint store.

One shortcut, on by default: a SIGKILLed worker's activity attempts are only retried once
their heartbeat timeout (20 s) or, for quick calls, their start-to-close timeout (30 s)
expires. To fit CI, `fail_orphaned_attempts` fails those attempts by id at once, which is
what the server itself does at the timeout. CHAOS_REAL_TIMEOUTS=1 waits for the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from moto.core import DEFAULT_ACCOUNT_ID
from moto.ec2 import models
from temporalio.api.enums.v1 import PendingActivityState
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import Replayer

from spotrain.activities.ec2_ownership import LIVE_STATES, TAG_JOB, TAG_SLOT
from spotrain.activities.local_ranks import job_processes
from spotrain.elastic.job_store import JobStore
from spotrain.workers.embedded.binaries import temporal_cli
from spotrain.workers.embedded.stack import free_port
from spotrain.workers.worker import WORKFLOW_RUNNER, WORKFLOWS
from spotrain.workflows.job import attributes
from spotrain.workflows.job.state import JobResult, JobStatus

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(__file__).with_name("train.py")
FULL = os.environ.get("CHAOS_FULL") == "1"
REAL_TIMEOUTS = os.environ.get("CHAOS_REAL_TIMEOUTS") == "1"
TOTAL_STEPS = 400  # 8 s of 20 ms steps
HOLD_AT = 100  # ranks wait there until the scenario says go (see train.py)
# 2 nodes x 2 ranks, one node reclaimed: the job shrinks to the survivor and the replacement
# joins ([4, 2, 4]), or, where the replacement is up before the smaller generation starts (a
# slow or restarted worker), it restarts on the replacement at once ([4, 4]): both are the plan.
CYCLE_PLANS = ([4, 2, 4], [4, 4])
Handle = WorkflowHandle[Any, Any]

_SA_TYPES = {"KEYWORD": "Keyword", "INT": "Int", "DOUBLE": "Double", "KEYWORD_LIST": "KeywordList"}


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself listens on loopback TCP `port`. A connection that opens
    proves only that some process does: after a restart another test's server may hold it."""
    mine: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # (closed since listed, as the listing's own)
                mine.add(os.readlink(fd))
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                ours = f"socket:[{inode}]" in mine
                if ours and state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:
                    return True
    return False


class TemporalServer:
    """`temporal server start-dev` on fixed ports with an SQLite file: kill -9 and restart."""

    def __init__(self, db: Path, log: Path) -> None:
        self.db, self.log = db, log
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        sa = [
            f"{k.name}={_SA_TYPES[k.indexed_value_type.name.removeprefix('INDEXED_VALUE_TYPE_')]}"
            for k in attributes.ALL
        ]
        args = [temporal_cli(), "server", "start-dev", "--headless", "--ip", "127.0.0.1"]
        args += ["--db-filename", str(self.db), "--port", str(self.port)]
        args += ["--http-port", str(self.http_port), "--metrics-port", str(self.metrics_port)]
        args += ["--dynamic-config-value", "limit.historyCount.suggestContinueAsNew=200"]
        for item in sa:
            args += ["--search-attribute", item]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not listens(self.proc.pid, self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"dev server did not start: see {self.log}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL: no shutdown, whatever was in flight is lost but what SQLite committed."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    async def client(self) -> Client:
        """A client once the server runs workflows in the default namespace: its port opens
        first, then its frontend is healthy, and only later does the frontend know the
        namespace (beside six busy loops a workflow started in between failed with "Namespace
        default is not found", after visibility calls had already succeeded)."""
        deadline = time.monotonic() + 60
        client: Client | None = None
        while True:
            try:
                client = client or await Client.connect(
                    self.address, data_converter=pydantic_data_converter
                )
                await client.get_workflow_handle("readiness-probe").describe()
            except RPCError as err:
                details = err.grpc_status.details
                if (
                    client
                    and err.status == RPCStatusCode.NOT_FOUND
                    and not any(d.type_url.endswith("NamespaceNotFoundFailure") for d in details)
                ):
                    return client  # no such workflow, in a namespace the frontend knows
            except RuntimeError:
                pass  # not healthy yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"dev server not serving the default namespace: {self.log}")
            await asyncio.sleep(0.2)


class WorkerProcess:
    """One spotrain worker (EC2 provider on moto, local runtime) as a subprocess."""

    def __init__(self, env: ChaosEnv, queue: str, crash: str | None = None) -> None:
        self.log = env.worker_log(queue)
        module = "tests.chaos.crash_worker" if crash else "spotrain.workers.worker"
        extra = {}
        if crash:
            extra = {
                "CHAOS_CRASH": crash,
                "CHAOS_ARM": str(env.arm_file(queue)),
                "CHAOS_FIRED": str(env.fired_file(queue)),
            }
        args = ["--provider", "ec2", "--runtime", "local", "--task-queue", queue]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args, "--state-dir", str(env.state_dir)],
                cwd=REPO,
                env={**os.environ, **env.worker_env(), **extra},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        env.workers.append(self)

    def died(self) -> bool:
        return self.proc.poll() is not None

    def stop(self) -> None:
        """SIGTERM (the worker's graceful shutdown), then SIGKILL if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class ChaosEnv:
    """Everything a scenario needs: the server, a client, moto, a scratch directory."""

    server: TemporalServer
    client: Client
    moto: str
    root: Path
    workers: list[WorkerProcess] = field(default_factory=list)  # every one started
    jobs: list[str] = field(default_factory=list)  # every job started

    def mark(self) -> tuple[int, int]:
        """Where a scenario begins, for `clean_up`."""
        return len(self.workers), len(self.jobs)

    async def clean_up(self, since: tuple[int, int] = (0, 0)) -> list[str]:
        """Stop what was started after `since` and still runs, however the scenario ended
        (a failed `until` never reaches `supervise`, which stops its worker): the workers,
        then the jobs' workflows, then their rank processes (they run in sessions of their
        own, so a worker's end leaves them). What had to be stopped, for the log."""
        stopped = []
        for worker in self.workers[since[0] :]:
            if not worker.died():
                worker.stop()
                stopped.append(f"worker {worker.proc.pid}")
        for job in dict.fromkeys(self.jobs[since[1] :]):
            with contextlib.suppress(RPCError):  # (it ended, or the server is down)
                await self.client.get_workflow_handle(job).terminate("the scenario is over")
                stopped.append(f"workflow {job}")
            for pid in self.rank_processes(job):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    stopped.append(f"rank process {pid} of {job}")
        return stopped

    def rank_processes(self, job: str) -> list[int]:
        """The live processes of `job` started by this environment's workers (a job of the
        same name run by another test process elsewhere on the machine is not ours)."""
        ours = f"CHAOS_RECORD_DIR={self.records(job)}\0".encode()
        pids = []
        for pid in job_processes(job):
            with contextlib.suppress(OSError):
                if ours in Path(f"/proc/{pid}/environ").read_bytes():
                    pids.append(pid)
        return pids

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def arm_file(self, queue: str) -> Path:
        return self.root / f"{queue}.arm"

    def fired_file(self, queue: str) -> Path:
        return self.root / f"{queue}.fired"

    def worker_log(self, queue: str) -> Path:
        return self.root / f"worker-{queue}.log"

    def records(self, job: str) -> Path:
        return self.root / "records" / job

    def worker_env(self) -> dict[str, str]:
        return {
            "TEMPORAL_ADDRESS": self.server.address,
            "SPOTRAIN_EC2_ENDPOINT": self.moto,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def spec(self, job: str, **elastic: Any) -> dict[str, Any]:
        """A 2-node x 2-rank job of TOTAL_STEPS steps of `train.py`, second-scale timeouts."""
        self.records(job).mkdir(parents=True, exist_ok=True)
        return {
            "name": job,
            "type": "pytorch",
            "command": [sys.executable, str(TRAIN)],
            "env": {"CHAOS_RECORD_DIR": str(self.records(job)), "CHAOS_HOLD_AT": str(HOLD_AT)},
            "procs_per_node": 2,
            "total_steps": TOTAL_STEPS,
            "checkpoint": f"file://{self.root}/ckpt/{job}",
            "cleanup": "always",
            "elastic": {
                "min_nodes": 1,
                "max_nodes": 2,
                "graceful_shutdown_timeout_s": 15,
                "scaling_timeout_s": 1,
                "faulty_scale_down_timeout_s": 3,
                "capacity_check_interval_s": 1,
                "progress_report_interval_s": 1,
                # (no stall_timeout_s: ranks hold at HOLD_AT, without progress by design, until
                # the scenario played out, which after a crash on CI's loaded machine took over
                # the 60 s this once was; no scenario needs the stall bound)
                **elastic,
            },
            "spot": {
                "instance_types": [
                    {"name": "g5.xlarge", "gpus": 1, "on_demand_price": 1.0, "spot_price": 0.3}
                ],
                "zones": ["us-east-1a", "us-east-1b"],
            },
        }

    async def start(self, spec: dict[str, Any], task_queue: str | None = None) -> Handle:
        """The job, on its own task queue (its name) unless one is given."""
        self.jobs.append(spec["name"])
        return await self.client.start_workflow(
            "TrainingJob",
            spec,
            id=spec["name"],
            task_queue=task_queue or spec["name"],
            result_type=JobResult,
        )


async def status(handle: Handle) -> JobStatus | None:
    """The `status` query, or None while no worker answers."""
    try:
        return await handle.query("status", result_type=JobStatus, rpc_timeout=timedelta(seconds=5))
    except Exception:  # no worker yet, a worker mid-restart, a server mid-restart
        return None


async def until(
    env: ChaosEnv, handle: Handle, check: Callable[[JobStatus], bool], timeout: float = 90
) -> JobStatus:
    """The job's first status that passes `check`; past `timeout`, a failure that says what
    the job was doing (the last status answered, then the post-mortem)."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        if (last := await status(handle)) is not None:
            if check(last):
                return last
            seen = last
        await asyncio.sleep(0.2)
    raise AssertionError(
        f"{handle.id}: timed out after {timeout:.0f}s; last status answered: {seen}\n"
        f"{await post_mortem(env, handle)}"
    )


def running(world: int, min_step: int = 0) -> Callable[[JobStatus], bool]:
    return lambda s: s.phase == "Running" and s.world_size == world and s.step >= min_step


def member(status: JobStatus, node_rank: int) -> str:
    return next(n.node_id or "" for n in status.nodes if n.rank == node_rank)


async def reclaim(handle: Handle, node_id: str, event_id: str, in_s: float = 120) -> None:
    """A notice for `node_id`, due in `in_s`. The job acts on it at once either way; the room
    is for a worker killed right after it arrives: on a loaded machine its replacement took
    over 30 s to take over, the deadline had passed, and the job rightly treated the node as
    lost (no shrink: it waited for the replacement), so the planned cycle never came (CI)."""
    deadline = (datetime.now(UTC) + timedelta(seconds=in_s)).isoformat()
    await handle.signal("reclaim", {"node_id": node_id, "deadline": deadline, "event_id": event_id})


async def fail_orphaned_attempts(client: Client, job: str) -> int:
    """Fail the activity attempts a killed worker held, as their timeouts would (see module)."""
    if REAL_TIMEOUTS:
        return 0
    desc = await client.get_workflow_handle(job).describe()
    failed = 0
    for pa in desc.raw_description.pending_activities:
        if pa.state != PendingActivityState.PENDING_ACTIVITY_STATE_STARTED:
            continue
        handle = client.get_async_activity_handle(
            workflow_id=job, run_id=desc.run_id, activity_id=pa.activity_id
        )
        try:
            await handle.fail(ApplicationError("worker SIGKILLed", type="WorkerKilled"))
            failed += 1
        except RPCError:
            pass  # it completed or timed out meanwhile
    return failed


async def replay_failures(env: ChaosEnv, handle: Handle) -> list[str]:
    """Each of the job's runs replayed against today's code, for a stuck job: a nondeterminism
    seen once under load (TMPRL1100 after a crash, issue 45) then names its event, and the
    history is kept beside the job's records (`<run id>.json`)."""
    replayer = Replayer(
        workflows=WORKFLOWS, workflow_runner=WORKFLOW_RUNNER, data_converter=pydantic_data_converter
    )
    found = []
    async for run in env.client.list_workflows(f"WorkflowId = '{handle.id}'"):
        history = await env.client.get_workflow_handle(handle.id, run_id=run.run_id).fetch_history()
        (env.records(handle.id) / f"{run.run_id}.json").write_text(history.to_json())
        replay = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        if replay.replay_failure is not None:
            found.append(f"run {run.run_id} does not replay: {replay.replay_failure}")
    return found


async def post_mortem(env: ChaosEnv, handle: Handle) -> str:
    """What a stuck job was doing, for the failure message (CI keeps no scratch space): its
    status, its pending activities, its ranks' last records, its ranks' last log lines, and
    any of its runs that does not replay."""
    lines = [f"status: {await status(handle)}"]
    with contextlib.suppress(RPCError):
        desc = await handle.describe()
        for pa in desc.raw_description.pending_activities:
            failure = pa.last_failure.message if pa.HasField("last_failure") else ""
            state = PendingActivityState.Name(pa.state).removeprefix("PENDING_ACTIVITY_STATE_")
            lines.append(
                f"pending {pa.activity_type.name} #{pa.activity_id}: {state},"
                f" attempt {pa.attempt}, last failure {failure!r}"
            )
    for path in sorted(env.records(handle.id).glob("*.steps")):
        lines.append(f"{path.name}: {' | '.join(path.read_text().splitlines()[-2:])}")
    log = env.worker_log(handle.id)
    if log.exists():
        lines += [f"{log.name}:", *log.read_text(errors="replace").splitlines()[-30:]]
    with contextlib.suppress(RPCError):
        lines += await replay_failures(env, handle)
    return "\n".join(lines)


def replaced(victim: str) -> Callable[[JobStatus], bool]:
    """The reclaim cycle played out: the job runs at world 4 without the reclaimed node (the
    replacement joined). Not `generation >= 3`: that held the ranks for ever when the job went
    straight to the replacement (a worker killed after describe_nodes, under load)."""
    return lambda s: running(4)(s) and victim not in (member(s, 0), member(s, 1))


async def supervise(
    env: ChaosEnv,
    handle: Handle,
    worker: WorkerProcess,
    go_when: Callable[[JobStatus], bool],
    timeout: float = 360,
) -> tuple[JobResult | BaseException, int]:
    """Wait for the job's end, replacing a dead worker with a fresh (crash-free) one each time,
    and let the ranks past HOLD_AT once `go_when` holds. Returns the result (or the exception
    it ended with) and how many workers died. The timeout is generous (a cycle takes ~30 s
    here): on a loaded machine a crash's recovery can stack a workflow task's 10 s timeout
    and a heartbeat's 20 s; past it, the failure says what was stuck."""
    job = handle.id
    go = env.records(job) / "go"
    outcome = asyncio.ensure_future(handle.result())
    deaths = 0
    deadline = time.monotonic() + timeout
    try:
        while not outcome.done():
            if not go.exists() and (s := await status(handle)) is not None and go_when(s):
                go.touch()
            if time.monotonic() > deadline:
                outcome.cancel()
                raise AssertionError(
                    f"{job}: no result after {timeout:.0f}s\n{await post_mortem(env, handle)}"
                )
            if worker.died():
                deaths += 1
                await fail_orphaned_attempts(env.client, job)
                worker = WorkerProcess(env, job)
            await asyncio.wait([outcome], timeout=0.3)
    finally:
        worker.stop()
    return (outcome.exception() or outcome.result()), deaths


# --- what every scenario checks ------------------------------------------------------------


def ec2_backend() -> Any:
    return models.ec2_backends[DEFAULT_ACCOUNT_ID]["us-east-1"]


def job_instances(job: str) -> list[tuple[str, int, str]]:
    """(instance id, slot, state) of every instance ever launched for `job` (moto's record)."""
    found = []
    for instance in ec2_backend().all_instances():
        tags = {t["key"]: t["value"] for t in instance.get_tags()}
        if tags.get(TAG_JOB) == job:
            found.append((instance.id, int(tags[TAG_SLOT]), instance.state))
    return found


@dataclass
class Generation:
    """One generation as its ranks recorded it."""

    number: int
    world: int
    nodes: set[str]
    start: int  # rank 0 resumed from this step
    last: int  # rank 0's last step
    contiguous: bool
    ranks: int  # ranks that recorded anything: a rank killed at start-up may not have
    acked: bool
    done: bool


def generations(job: str, records: Path) -> list[Generation]:
    gens: dict[int, list[tuple[int, list[str]]]] = {}
    for path in records.glob("gen-*-rank-*.steps"):
        _, gen, _, rank = path.stem.split("-")
        gens.setdefault(int(gen), []).append((int(rank), path.read_text().splitlines()))
    out = []
    for number, ranks in sorted(gens.items()):
        if 0 not in dict(ranks):
            continue  # stopped before rank 0 (whose steps are the ones counted) ever ran
        nodes = {lines[0].split()[5] for _, lines in ranks}
        lines0 = dict(ranks)[0]
        head = lines0[0].split()
        steps = [int(x) for x in lines0[1:] if x.isdigit()]
        start = int(head[1])
        out.append(
            Generation(
                number=number,
                world=int(head[3]),
                nodes=nodes,
                start=start,
                last=steps[-1] if steps else start,
                contiguous=steps == list(range(start + 1, start + 1 + len(steps))),
                ranks=len(ranks),
                acked="acked" in lines0,
                done="done" in lines0,
            )
        )
    return out


@dataclass
class Figures:
    """What one scenario proves, in the report's columns."""

    scenario: str
    tried: int = 1
    survived: int = 0
    duplicates: int = 0
    leaks: int = 0
    lost_steps: int = 0
    problems: list[str] = field(default_factory=list)

    def write(self) -> None:
        """Append to CHAOS_RESULTS (set by bench/chaos_report.py) for the report's table."""
        path = os.environ.get("CHAOS_RESULTS")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(asdict(self)) + "\n")


def check_job(
    env: ChaosEnv,
    job: str,
    *,
    completed: bool = True,
    plans: Sequence[list[int]] | None = None,
    sizes_from: int = 1,
    total_steps: int = TOTAL_STEPS,
) -> Figures:
    """Duplicates, leaks, and (for a completed job) steps and checkpoints, from the record
    each side keeps itself: moto's backend, /proc, the ranks' step files, the store.
    `plans`: the world sizes that may follow from generation `sizes_from` on (before it, a
    slow machine may have gang-started on fewer nodes and grown: that is the plan too)."""
    fig = Figures(job)
    slots = [slot for _, slot, _ in job_instances(job)]
    fig.duplicates = len(slots) - len(set(slots))
    live = [i for i, _, state in job_instances(job) if state in LIVE_STATES]
    procs = env.rank_processes(job)
    fig.leaks = len(live) + len(procs)
    if fig.duplicates:
        fig.problems.append(f"duplicate instances for slots {sorted(slots)}")
    if fig.leaks:
        fig.problems.append(f"left running: instances {live}, processes {procs}")
    if not completed:
        return fig
    gens = generations(job, env.records(job))
    for prev, nxt in itertools.pairwise(gens):
        if nxt.start > prev.last:
            fig.problems.append(f"steps {prev.last + 1}..{nxt.start} never ran")
        fig.lost_steps += max(0, prev.last - nxt.start)
    done = sum(g.last - g.start for g in gens) - fig.lost_steps
    if done != total_steps or not gens or gens[-1].last != total_steps:
        fig.problems.append(f"steps add up to {done}, not {total_steps}")
    for g in gens:
        if not g.contiguous or ((g.acked or g.done) and g.ranks != g.world):
            fig.problems.append(f"generation skipped steps or ranks: {g}")
    worlds = [g.world for g in gens if g.number >= sizes_from]
    if plans is not None and worlds not in plans:
        fig.problems.append(f"world sizes {worlds} from generation {sizes_from}, planned {plans}")
    store = JobStore(f"file://{env.root}/ckpt/{job}")
    latest, finished = store.latest_checkpoint(), store.done()
    if not latest or latest["step"] != total_steps or not finished:
        fig.problems.append(f"checkpoint store: latest {latest}, done {finished}")
    for g in gens[:-1]:
        if g.acked and len(store.acked_ranks(g.number)) != g.world:
            fig.problems.append(f"generation {g.number}: acks {store.acked_ranks(g.number)}")
    return fig


def memberships(env: ChaosEnv, job: str) -> list[set[str]]:
    """Node ids of each generation, from the local runtime's pid files (kept when the spec
    says cleanup: never): the runtime's record, even of ranks killed before they ran."""
    gens = sorted(
        (env.state_dir / "jobs" / job).glob("gen-*"),
        key=lambda p: int(p.name.removeprefix("gen-")),
    )
    return [{json.loads(p.read_text())["node_id"] for p in g.glob("rank-*.pid")} for g in gens]
