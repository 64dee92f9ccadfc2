"""Helpers to run TrainingJob workflows in tests: a spec builder, a worker with the simulated
cloud and runtime, and history recording for the replay tests."""

from __future__ import annotations

import asyncio
import copy
import os
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from temporalio.api.testservice.v1 import SleepRequest
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.local_ranks import job_processes
from spotrain.activities.simulated import SimulatedCloud, SimulatedRuntime
from spotrain.workers.worker import workflow_worker
from spotrain.workflows import history
from spotrain.workflows.capacity.pool import PoolConfig, pool_workflow_id
from spotrain.workflows.job.state import JobResult, JobStatus

HISTORIES = Path(__file__).parent / "replay" / "histories"
M = TypeVar("M", bound=BaseModel)
SKIP_TIMEOUT = timedelta(minutes=5)

BASE_SPEC: dict[str, Any] = {
    "command": ["python", "train.py"],
    "total_steps": 36_000,
    "checkpoint": "file:///tmp/spotrain-tests",
    "elastic": {
        "min_nodes": 2,
        "max_nodes": 4,
        "graceful_shutdown_timeout_s": 60,
        "scaling_timeout_s": 30,
        "faulty_scale_down_timeout_s": 120,
        "capacity_check_interval_s": 120,
        "progress_report_interval_s": 30,
        "stall_timeout_s": 600,
    },
    "spot": {
        "instance_types": [
            {"name": "p3.2xlarge", "gpus": 1, "on_demand_price": 3.06, "spot_price": 0.97}
        ],
        "zones": ["us-east-1a", "us-east-1b"],
    },
}


# Seconds instead of minutes, for scenarios on the dev server in real time.
FAST_ELASTIC: dict[str, Any] = {
    "graceful_shutdown_timeout_s": 5,
    "scaling_timeout_s": 1,
    "faulty_scale_down_timeout_s": 3,
    "capacity_check_interval_s": 1,
    "progress_report_interval_s": 0.25,
    "stall_timeout_s": 4,
}


def fast_runtime(**options: Any) -> SimulatedRuntime:
    """10 steps per second per node, 0.5 s start-up, a checkpoint every 20 steps."""
    defaults: dict[str, Any] = {
        "steps_per_hour": lambda world: 36_000.0 * world,
        "restart_cost_s": 0.5,
        "checkpoint_every": 20,
    }
    return SimulatedRuntime(**(defaults | options))


def fast_spec(**overrides: Any) -> dict[str, Any]:
    """A job of about 15 s at 4 nodes with `fast_runtime`."""
    return merge(job_spec(total_steps=600, elastic=dict(FAST_ELASTIC)), overrides)


def job_spec(**overrides: Any) -> dict[str, Any]:
    """BASE_SPEC with a fresh name; nested dicts in `overrides` merge one level deep."""
    spec = copy.deepcopy(BASE_SPEC)
    spec["name"] = f"job-{uuid.uuid4().hex[:8]}"
    return merge(spec, overrides)


def process_spec(
    name: str, command: list[str], checkpoint: str, elastic: dict[str, Any], **overrides: Any
) -> dict[str, Any]:
    """A job of real rank processes (local or Kubernetes runtime) on the simulated cloud: one
    cheap spot pool in one zone, no on-demand fallback."""
    spec = {
        "name": name,
        "type": "pytorch",
        "command": command,
        "checkpoint": checkpoint,
        "elastic": elastic,
        "spot": {
            "instance_types": [
                {"name": "m5.large", "gpus": 0, "on_demand_price": 0.096, "spot_price": 0.035}
            ],
            "zones": ["us-east-1a"],
        },
        "on_demand": {"fallback": False},
    }
    return merge(spec, overrides)


def merge(spec: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Nested dicts in `overrides` merge one level deep; other values replace."""
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key].update(value)
        else:
            spec[key] = value
    return spec


@dataclass
class Sim:
    client: Client
    cloud: SimulatedCloud
    runtime: SimulatedRuntime
    task_queue: str

    async def start(self, spec: dict[str, Any]) -> WorkflowHandle[Any, Any]:
        return await self.client.start_workflow(
            "TrainingJob", spec, id=spec["name"], task_queue=self.task_queue, result_type=JobResult
        )

    async def status(self, handle: WorkflowHandle[Any, Any]) -> JobStatus:
        return await handle.query("status", result_type=JobStatus)

    async def start_pool(self, **config: Any) -> WorkflowHandle[Any, Any]:
        """A CapacityPool served by this worker (`config`: PoolConfig's fields)."""
        pool = PoolConfig(**config)
        return await self.client.start_workflow(
            "CapacityPool", pool, id=pool_workflow_id(pool.name), task_queue=self.task_queue
        )


@asynccontextmanager
async def simulated(
    client: Client,
    cloud: SimulatedCloud | None = None,
    runtime: SimulatedRuntime | None = None,
    **worker_options: Any,
) -> AsyncIterator[Sim]:
    """A worker running TrainingJob with the simulated cloud and runtime on its own queue."""
    sim = Sim(client, cloud or SimulatedCloud(), runtime or SimulatedRuntime(), uuid.uuid4().hex)
    with ThreadPoolExecutor(max_workers=16) as pool:
        async with workflow_worker(
            client,
            sim.task_queue,
            sim.cloud.activities() + sim.runtime.activities(),
            activity_executor=pool,
            **worker_options,
        ):
            yield sim


async def polled(
    fetch: Callable[[], Awaitable[M]], check: Callable[[M], bool], timeout: float = 60
) -> M:
    """Poll a query (`fetch`) until `check` holds on its answer."""
    deadline = time.monotonic() + timeout
    while True:
        answer = await fetch()
        if check(answer):
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; last: {answer.model_dump_json(indent=1)[:3000]}")
        await asyncio.sleep(0.1)


async def until(
    sim: Sim,
    handle: WorkflowHandle[Any, Any],
    check: Callable[[JobStatus], bool],
    timeout: float = 60,
) -> JobStatus:
    """Poll the job's `status` query until `check` holds."""
    return await polled(lambda: sim.status(handle), check, timeout)


async def skip(env: WorkflowEnvironment, duration: timedelta | float) -> None:
    """`env.sleep` on the time-skipping server, with room for a loaded machine: the SDK's call
    has the client's default 30 s deadline, and beside two busy loops skipping 86 minutes of
    a busy job took longer ('Timeout expired' in CI). The call is silent while it lasts, so it
    goes through a client that sends no HTTP/2 keep-alive pings: the test server (grpc-java)
    takes a ping within 5 minutes of the last, during a call, as a strike, and closes the
    connection at the third; the SDK pings every 30 s, so any call silent for 90 s failed
    ('transport error' here, 'h2 protocol error' in CI: test_a_week_with_120_reclaims...)."""
    req = SleepRequest()
    req.duration.FromTimedelta(
        duration if isinstance(duration, timedelta) else timedelta(seconds=duration)
    )
    await (await unpinged_client(env)).test_service.unlock_time_skipping_with_sleep(
        req, timeout=SKIP_TIMEOUT
    )


_UNPINGED: weakref.WeakKeyDictionary[WorkflowEnvironment, Client] = weakref.WeakKeyDictionary()


async def unpinged_client(env: WorkflowEnvironment) -> Client:
    """A client of `env`'s server without keep-alive pings (`skip` says why), one per env."""
    if env not in _UNPINGED:
        target = env.client.service_client.config.target_host
        _UNPINGED[env] = await Client.connect(target, keep_alive_config=None)
    return _UNPINGED[env]


def running_at(size: int, generation: int | None = None) -> Callable[[JobStatus], bool]:
    def check(s: JobStatus) -> bool:
        at_generation = generation is None or s.generation >= generation
        return s.phase == "Running" and s.world_size == size and at_generation

    return check


def sizes(result_or_status: Any) -> list[int]:
    return [e.world_size for e in result_or_status.timeline if e.event == "generation started"]


def left_before_the_shrink(result_or_status: Any, node_id: str) -> bool:
    """Whether `node_id` went between the last three generations' starts: it left, the job ran
    one smaller, then grew back. Read from the timeline, because a replacement joins as soon
    as it is ready, so the smaller generation may last less than a poll."""
    events = [(e.event, e.detail) for e in result_or_status.timeline]
    starts = [i for i, (event, _) in enumerate(events) if event == "generation started"]
    gone = [i for i, (event, detail) in enumerate(events) if event == "node gone"]
    return len(starts) >= 3 and any(
        node_id in events[i][1] and starts[-3] < i < starts[-2] for i in gone
    )


async def record_history(handle: WorkflowHandle[Any, Any], name: str) -> None:
    """With SPOTRAIN_RECORD=1, save every run of the job (continue-as-new makes several) for
    the replay tests. Re-recording is deliberate: see tests/replay/test_replay.py."""
    if os.environ.get("SPOTRAIN_RECORD") != "1":
        return
    HISTORIES.mkdir(exist_ok=True)
    for old in HISTORIES.glob(f"{name}-run*.json"):
        old.unlink()
    client = handle._client
    try:
        runs = [r async for r in client.list_workflows(f"WorkflowId = '{handle.id}'")]
    except RPCError as err:  # the time-skipping server lists nothing: its one run
        if err.status != RPCStatusCode.UNIMPLEMENTED:
            raise
        (HISTORIES / f"{name}-run1.json").write_text((await handle.fetch_history()).to_json())
        return
    for i, run in enumerate(sorted(runs, key=lambda r: r.start_time)):
        history = await client.get_workflow_handle(handle.id, run_id=run.run_id).fetch_history()
        (HISTORIES / f"{name}-run{i + 1}.json").write_text(history.to_json())


async def continue_as_new_now(handle: WorkflowHandle[Any, Any], timeout: float = 60) -> str:
    """Make the job's run continue as new at its next turn (as a long history does) and
    return the new run's id. The worker must run in this process: its workflows read the
    bound from the very module this lowers (spotrain's modules pass through the sandbox).
    The bound becomes the history's length now, not 0: a replay of the run's earlier tasks
    (a sticky cache evicted under load) must decide as they did, or the worker fails its task
    as nondeterministic (seen beside two busy loops)."""
    latest = handle._client.get_workflow_handle(handle.id)
    described = await latest.describe()
    before = described.run_id
    length = described.raw_description.workflow_execution_info.history_length
    saved = history.HISTORY_EVENTS_BEFORE_CONTINUE
    history.HISTORY_EVENTS_BEFORE_CONTINUE = length
    try:
        deadline = time.monotonic() + timeout
        while (now := (await latest.describe()).run_id) == before:
            assert time.monotonic() < deadline, "the run did not continue as new"
            await asyncio.sleep(0.05)
    finally:
        history.HISTORY_EVENTS_BEFORE_CONTINUE = saved
    assert now is not None
    return now


def leftover_processes(job: str, within_s: float = 5.0) -> list[str]:
    """The job's processes (`job_processes`: SPOTRAIN_JOB in their environment) still alive
    after `within_s`, as 'pid state command' for the failure message. The wait is for exit
    latency only: the runtime waits for each rank it SIGKILLs, not for the rest of the rank's
    process group, which the kernel tears down a moment later on a loaded machine."""
    deadline = time.monotonic() + within_s
    while (alive := job_processes(job)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [_describe(pid) for pid in alive]


def _describe(pid: int) -> str:
    proc = Path("/proc") / str(pid)
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} {state} {command[:200]}"
