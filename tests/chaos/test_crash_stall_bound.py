"""How long a SIGKILLed worker can stall a job: Temporal retries a dead worker's activity
attempt only when its heartbeat timeout (or, without one, its start-to-close timeout) expires.
The crash sweep shortcuts that wait (harness.fail_orphaned_attempts); this test reads the
timeouts the workflow really schedules, from a job that uses every activity."""

from __future__ import annotations

from datetime import timedelta

from temporalio.testing import WorkflowEnvironment

from tests.jobs import job_spec, simulated, skip

STALL_BOUND_S = 30  # every activity heartbeats at least every 5 s: 30 s is ample


async def test_a_dead_worker_stalls_no_activity_long(ts_env: WorkflowEnvironment) -> None:
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(job_spec(total_steps=7_200))
        await skip(ts_env, timedelta(minutes=10))
        sim.runtime.fail(handle.id)  # a fault: describe, stop, start again
        await handle.result()
        history = await handle.fetch_history()
    stall: dict[str, float] = {}
    for event in history.events:
        if event.HasField("activity_task_scheduled_event_attributes"):
            attrs = event.activity_task_scheduled_event_attributes
            wait = (
                attrs.heartbeat_timeout.ToTimedelta() or attrs.start_to_close_timeout.ToTimedelta()
            )
            name = attrs.activity_type.name
            stall[name] = max(stall.get(name, 0.0), wait.total_seconds())
    every = {"find_offers", "launch_node", "describe_nodes", "release_nodes", "check_checkpoint"}
    every |= {"start_generation", "stop_generation", "watch_generation", "cleanup_job"}
    assert set(stall) == every
    slow = {name: s for name, s in stall.items() if s > STALL_BOUND_S}
    assert not slow, f"a crashed attempt is retried only after (s): {slow}"
