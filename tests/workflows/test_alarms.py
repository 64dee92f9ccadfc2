"""The main loop's timers (workflows/job/alarms.py), on the time-skipping server: one due
within CANCEL_BEYOND_S is left to fire, never cancelled (the server strands a run whose task
cancels a timer that fired meanwhile, sdk-java#3088); one due later is cancelled when the loop
moves on; a wait for the same instant reuses its timer."""

from __future__ import annotations

import uuid
from datetime import timedelta

from temporalio import workflow
from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from spotrain.workflows.job.alarms import CANCEL_BEYOND_S, Alarms


@workflow.defn(sandboxed=False)
class AlarmsProbe:
    @workflow.run
    async def run(self) -> bool:
        alarms, t0 = Alarms(), workflow.now()
        near = alarms.at(t0 + timedelta(seconds=5), "near")
        await workflow.sleep(1, summary="a wake")
        again = alarms.at(t0 + timedelta(seconds=5), "near")
        far = alarms.at(t0 + timedelta(seconds=10 * CANCEL_BEYOND_S), "far")
        await workflow.sleep(1, summary="another wake")
        later = alarms.at(t0 + timedelta(seconds=10), "next")
        await workflow.wait_condition(lambda: near.done() and later.done())
        return again is near and far.cancelled() and not near.cancelled()


async def test_near_timers_fire_far_ones_are_cancelled_and_an_instant_reuses_its_timer(
    ts_env: WorkflowEnvironment,
) -> None:
    queue = f"alarms-{uuid.uuid4().hex[:8]}"
    async with Worker(ts_env.client, task_queue=queue, workflows=[AlarmsProbe]):
        handle = await ts_env.client.start_workflow(AlarmsProbe.run, id=queue, task_queue=queue)
        assert await handle.result()
        history = await handle.fetch_history()
    started, fired, cancelled = {}, [], []
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED:
            started[event.timer_started_event_attributes.timer_id] = event.user_metadata.summary
        elif event.event_type == EventType.EVENT_TYPE_TIMER_FIRED:
            fired.append(event.timer_fired_event_attributes.timer_id)
        elif event.event_type == EventType.EVENT_TYPE_TIMER_CANCELED:
            cancelled.append(event.timer_canceled_event_attributes.timer_id)
    named = {timer: summary.data.decode().strip('"') for timer, summary in started.items()}
    assert sorted(named.values()) == ["a wake", "another wake", "far", "near", "next"]
    assert [named[t] for t in cancelled] == ["far"]
    assert sorted(named[t] for t in fired) == ["a wake", "another wake", "near", "next"]
