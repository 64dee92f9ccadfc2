"""The `TrainingJob` workflow: one elastic training job from submission to teardown.

A job runs as a sequence of generations, each a fixed membership of nodes in rank order. The
main loop alternates between two states: no generation running (order nodes, wait for enough
of them, gang-start the next generation) and a generation running (watch it, react to
events). Every resize ends generation g and starts g+1 from the latest complete checkpoint.

Signals and updates only queue `Event`s; the main loop is the one place that acts on them,
so decisions are sequential and easy to follow. All state lives in `JobState`, which
continue-as-new carries whole. Decisions come from the pure `planner`; side effects happen in
activities, which the worker registers under the names in `contract`.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows import attributes, planner
    from spotrain.workflows.checkpoints import CheckpointStats
    from spotrain.workflows.contract import (
        CAPACITY_ERROR,
        CLEANUP_JOB,
        CONFIG_ERROR,
        DESCRIBE_NODES,
        FIND_OFFERS,
        LAUNCH_NODE,
        RELEASE_NODES,
        START_GENERATION,
        STOP_GENERATION,
        WATCH_GENERATION,
        CleanupRequest,
        DescribeRequest,
        Empty,
        GenerationPlan,
        LaunchRequest,
        Member,
        NodeInfo,
        NodeLost,
        Offer,
        PoolGrant,
        PoolReport,
        ReclaimNotice,
        ReleaseRequest,
        ScaleIn,
        ScaleOut,
        StopRequest,
        StopResult,
        WatchRequest,
        WatchResult,
    )
    from spotrain.workflows.history import history_is_long
    from spotrain.workflows.pool import pool_workflow_id
    from spotrain.workflows.spec import SpecError, parse_spec
    from spotrain.workflows.state import (
        Event,
        JobResult,
        JobState,
        JobStatus,
        NodeRecord,
        NodeView,
        TimelineEntry,
    )

INVALID_SPEC = "InvalidSpec"
JOB_FAILED = "JobFailed"
# A dead worker's attempt is retried when its heartbeat (or a quick call's deadline) lapses:
# these bound how long a controller crash can stall a job. Activities heartbeat every <= 5 s.
HEARTBEAT = timedelta(seconds=20)
# The shortest timer the main loop sets. Finer timing buys nothing (a workflow task takes
# about that long), and a timer that fires within a task's round trip races its own
# cancellation (which the time-skipping test server mishandles: sdk-java#3088).
SHORTEST_WAIT_S = 0.1
QUICK_CALL = timedelta(seconds=30)
QUICK = RetryPolicy(maximum_attempts=5, maximum_interval=timedelta(seconds=10))
PERSISTENT = RetryPolicy(maximum_interval=timedelta(seconds=30))
LAUNCH_RETRY = RetryPolicy(
    maximum_attempts=20,
    maximum_interval=timedelta(seconds=30),
    non_retryable_error_types=[CAPACITY_ERROR, CONFIG_ERROR],
)


class JobFailed(Exception):
    """The job cannot go on (max restarts, no way to get nodes); the message says why."""


def _error_type(err: ActivityError) -> str | None:
    cause = err.cause
    return cause.type if isinstance(cause, ApplicationError) else None


def _cancellation(err: BaseException) -> bool:
    """The job itself is being cancelled. A workflow cancelled while it awaits an activity
    sees that activity fail as cancelled (an ActivityError), not a CancelledError."""
    return isinstance(err, asyncio.CancelledError) or (
        isinstance(err, ActivityError) and isinstance(err.cause, CancelledError)
    )


def _unless_cancelled(err: ActivityError) -> None:
    """For code that shrugs off an activity's failure: never shrug off the job's cancellation."""
    if _cancellation(err):
        raise asyncio.CancelledError() from err


@workflow.defn(name="TrainingJob")
class TrainingJob:
    @workflow.init
    def __init__(self, spec: Any, carried: JobState | None = None) -> None:
        self.s: JobState | None = carried
        self.invalid: str | None = None
        if carried is None:
            try:
                self.s = JobState.new(parse_spec(spec))
            except SpecError as err:
                self.invalid = str(err)
        self._launches: dict[int, asyncio.Task[None]] = {}
        self._watch: workflow.ActivityHandle[WatchResult] | None = None
        self._next_watch: datetime | None = None
        self._changes = 0
        self._published: tuple[Any, ...] | None = None
        self._reported: dict[str, Any] | None = None
        self._fatal: str | None = None  # a launch failed for good (credentials, bad type)

    # --- the public interface ----------------------------------------------------------------

    @workflow.run
    async def run(self, spec: Any, carried: JobState | None = None) -> JobResult:
        if self.s is None:
            raise ApplicationError(
                self.invalid or "invalid job spec", type=INVALID_SPEC, non_retryable=True
            )
        s = self.s
        if s.submitted_at is None:
            s.submitted_at = self._now()
            s.next_check = self._now() + timedelta(seconds=s.spec.elastic.capacity_check_interval_s)
            s.record(self._now(), "submitted", f"target {s.target} nodes")
            if s.spec.pool is not None:
                self._set_phase("Queued")
        try:
            if await self._drive():
                await workflow.wait_condition(workflow.all_handlers_finished)
                s.runs += 1
                s.prune(self._now())
                workflow.continue_as_new(args=[s.spec.model_dump(mode="json"), s])
            await self._teardown("Succeeded", keep=s.spec.cleanup == "never")
        except (asyncio.CancelledError, ActivityError) as err:
            if not _cancellation(err):
                raise
            await self._teardown("Cancelled", keep=s.spec.cleanup == "never")
            raise asyncio.CancelledError() from err
        except JobFailed as err:
            s.failure = str(err)
            await self._teardown("Failed", keep=s.spec.cleanup != "always")
            raise ApplicationError(
                str(err), self.result().model_dump(mode="json"), type=JOB_FAILED, non_retryable=True
            ) from None
        return self.result()

    @workflow.signal(name="reclaim")
    def reclaim(self, notice: ReclaimNotice) -> None:
        if self.s and self.s.remember(notice.event_id):
            kind = "rebalance" if notice.kind == "rebalance" else "reclaim"
            self.s.inbox.append(Event(kind=kind, node_id=notice.node_id, deadline=notice.deadline))

    @workflow.signal(name="node_lost")
    def node_lost(self, lost: NodeLost) -> None:
        if self.s and self.s.remember(lost.event_id):
            self.s.inbox.append(Event(kind="lost", node_id=lost.node_id))

    @workflow.signal(name="grant")
    def grant(self, grant: PoolGrant) -> None:
        if self.s and grant.seq > self.s.grant_seen:
            self.s.grant_seen = grant.seq
            self.s.inbox.append(Event(kind="grant", grant=grant))

    @workflow.update(name="scale_out")
    def scale_out(self, req: ScaleOut) -> str:
        self._queue(Event(kind="scale_out", count=req.count))
        return f"scaling out by {req.count} node(s)"

    @scale_out.validator
    def _check_scale_out(self, req: ScaleOut) -> None:
        s = self._active_state()
        limit = s.spec.elastic.max_nodes
        if s.target + req.count > limit:
            raise ValueError(
                f"cannot scale out to {s.target + req.count} nodes: max_nodes is {limit}"
            )

    @workflow.update(name="scale_in")
    def scale_in(self, req: ScaleIn) -> str:
        self._queue(Event(kind="scale_in", count=req.count, node_ids=req.node_ids))
        return f"scaling in by {req.count or len(req.node_ids or [])} node(s)"

    @scale_in.validator
    def _check_scale_in(self, req: ScaleIn) -> None:
        s = self._active_state()
        if (req.count is None) == (req.node_ids is None):
            raise ValueError("give either count or node_ids")
        alive = {n.node_id for n in s.nodes if n.alive and n.node_id}
        unknown = sorted(set(req.node_ids or []) - alive)
        if unknown:
            raise ValueError(f"unknown or gone node(s): {', '.join(unknown)}")
        removing = req.count or len(req.node_ids or [])
        if s.target - removing < s.spec.elastic.min_nodes:
            raise ValueError(
                f"cannot scale in to {s.target - removing} nodes: "
                f"min_nodes is {s.spec.elastic.min_nodes}"
            )

    @workflow.update(name="pause")
    def pause(self, _: Empty) -> str:
        self._queue(Event(kind="pause"))
        return "pausing: workers checkpoint, then every node is released"

    @pause.validator
    def _check_pause(self, _: Empty) -> None:
        if self._active_state().phase == "Paused":
            raise ValueError("already paused")

    @workflow.update(name="resume")
    def resume(self, _: Empty) -> str:
        self._queue(Event(kind="resume"))
        return "resuming"

    @resume.validator
    def _check_resume(self, _: Empty) -> None:
        s = self._active_state()
        if s.phase != "Paused" and not any(e.kind == "pause" for e in s.inbox):
            raise ValueError("not paused")

    @workflow.query(name="status")
    def status(self) -> JobStatus:
        s = self._active_state()
        rank = {slot: i for i, slot in enumerate(s.members)} if s.running else {}
        accounts = s.accounts(self._now())
        return JobStatus(
            **accounts,
            generation=s.generation,
            world_size=s.world_size,
            target_nodes=s.target,
            step=s.step,
            total_steps=s.spec.total_steps,
            checkpoint_step=s.checkpoint_step,
            cost_so_far=round(accounts["total_cost"], 4),
            pool=s.spec.pool.name if s.spec.pool else None,
            pool_grant=s.grant.nodes if s.grant else None,
            nodes=[
                NodeView(
                    node_id=n.node_id,
                    slot=n.slot,
                    lifecycle=n.lifecycle,
                    instance_type=n.instance_type,
                    zone=n.zone,
                    state=n.state,
                    reason=n.reason,
                    price=n.price,
                    rank=rank.get(n.slot),
                )
                for n in s.nodes
                if n.alive or n.ended_at is None or n.ended_at > self._now() - timedelta(hours=1)
            ],
            timeline=s.timeline[-20:],
        )

    @workflow.query(name="timeline")
    def timeline(self) -> list[TimelineEntry]:
        """The whole timeline kept (the last 400 events; `status` has the last 20)."""
        return self._active_state().timeline

    def result(self) -> JobResult:
        s = self._active_state()
        return JobResult(
            **s.accounts(self._now()),
            generations=s.generation,
            steps_done=s.step,
            continued_as_new=s.runs - 1,
            timeline=s.timeline,
        )

    def _active_state(self) -> JobState:
        if self.s is None:
            raise ValueError(self.invalid or "job not started")
        return self.s

    def _queue(self, event: Event) -> None:
        self._active_state().inbox.append(event)

    # --- the main loop -----------------------------------------------------------------------

    async def _drive(self) -> bool:
        """Run until the job completes (False) or should continue as new (True)."""
        s = self._active_state()
        if not s.nodes:
            await self._reconcile_orders()
        while True:
            if self._fatal:
                raise JobFailed(self._fatal)
            await self._handle_inbox()
            await self._report_to_pool()
            if s.phase in ("Paused", "Queued"):
                await workflow.wait_condition(lambda: bool(s.inbox))
                continue
            if s.running:
                if await self._watch_generation():
                    return False
            else:
                await self._start_generation_when_ready()
            if s.next_check is None or self._now() >= s.next_check:
                await self._periodic_checks()
            if (
                history_is_long()
                and not self._launches
                # (before the patch, only a running job continued as new: one short of
                # nodes for long kept growing its history)
                and (s.running or workflow.patched("continue-as-new-when-not-running"))
            ):
                self._cancel_watch()
                return True

    async def _wait(
        self, seconds: float | None, why: str, ready: Callable[[], bool] = lambda: False
    ) -> None:
        """Wait until an event is queued, nodes change, `ready()` holds, or `seconds` pass;
        `why` names the timer in the Web UI."""
        s = self._active_state()
        changes = self._changes
        if seconds is not None and seconds <= 0:
            # Already due. (Only then: workflow time stands still within an activation, so
            # returning early for anything due later would spin the loop without yielding.)
            return
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: bool(s.inbox) or self._changes != changes or ready(),
                timeout=None if seconds is None else max(seconds, SHORTEST_WAIT_S),
                timeout_summary=why,
            )

    def _seconds_until(self, when: datetime | None) -> float | None:
        return None if when is None else (when - self._now()).total_seconds()

    # --- running a generation ----------------------------------------------------------------

    async def _watch_generation(self) -> bool:
        """Watch the running generation until something needs a decision. True: completed."""
        s = self._active_state()
        now = self._now()
        if self._watch is None and (self._next_watch is None or now >= self._next_watch):
            self._start_watch()
        watch = self._watch
        # A runtime that answers early is not polled again before the report interval is up.
        wake = {
            "next capacity check": s.next_check,
            "grow once the scaling timeout has passed": self._growth_at(),
            "next progress report": None if watch else self._next_watch,
        }
        soonest = min(((w, why) for why, w in wake.items() if w is not None), default=None)
        await self._wait(
            self._seconds_until(soonest[0]) if soonest else None,
            soonest[1] if soonest else "",
            watch.done if watch else lambda: False,
        )
        growth_at = self._growth_at()
        if growth_at is not None and self._now() >= growth_at:
            await self._resize(graceful=True, reason="grow", detail=self._growth_detail())
            return False
        if watch is None or not watch.done():
            return False
        self._watch = None
        try:
            outcome = watch.result()
        except ActivityError as err:
            outcome = WatchResult(outcome="failed", detail=f"watch failed: {err.cause}")
        return await self._on_watch(outcome)

    def _start_watch(self) -> None:
        s = self._active_state()
        interval = s.spec.elastic.progress_report_interval_s
        self._next_watch = self._now() + timedelta(seconds=interval)
        self._watch = workflow.start_activity(
            WATCH_GENERATION,
            WatchRequest(
                job=s.spec.name,
                generation=s.generation,
                world_size=s.world_size,
                checkpoint=s.spec.checkpoint,
                report_after_s=interval,
            ),
            result_type=WatchResult,
            start_to_close_timeout=timedelta(seconds=interval + 300),
            heartbeat_timeout=HEARTBEAT,
            retry_policy=PERSISTENT,
            # Read-only: when the generation is stopped the watch is simply left to end.
            cancellation_type=ActivityCancellationType.ABANDON,
            summary=f"watch generation {s.generation} ({s.world_size} ranks)",
        )

    def _on_checkpoints(self, stats: CheckpointStats) -> None:
        """New checkpoint stats: say (timeline, log) when one was skipped as unloadable, and
        when checkpoints first stop fitting in a reclaim notice."""
        s = self._active_state()
        known = set(s.checkpoints.skipped) if s.checkpoints else set()
        warned = s.checkpoint_report(self._now())
        s.checkpoints = stats
        for step in sorted(set(stats.skipped) - known):
            s.record(self._now(), "checkpoint skipped", f"step {step} did not load")
        warning = s.checkpoint_report(self._now()).warning
        if warning and not (warned and warned.warning):
            s.record(self._now(), "checkpoints too slow", warning)
            workflow.logger.warning(f"{s.spec.name}: {warning}")

    async def _on_watch(self, w: WatchResult) -> bool:
        s = self._active_state()
        now = self._now()
        if w.checkpoint_step is not None and w.checkpoint_step > s.checkpoint_step:
            s.checkpoint_step = w.checkpoint_step
            if s.checkpoint_step > s.generation_checkpoint:
                s.restarts = 0  # this generation made durable progress
        if w.step is not None and w.step > s.step:
            s.step = w.step
            s.progress_at = now
        if w.checkpoints is not None:
            self._on_checkpoints(w.checkpoints)
        if w.outcome == "completed":
            s.step = max(s.step, w.step or s.spec.total_steps)
            s.running = False
            s.record(now, "completed", f"step {s.step}")
            return True
        if w.outcome == "failed":
            await self._fault(w.detail or f"exit codes {w.exit_codes}")
        elif (
            s.progress_at and (now - s.progress_at).total_seconds() > s.spec.elastic.stall_timeout_s
        ):
            await self._fault(
                f"stalled: no progress for {s.spec.elastic.stall_timeout_s:.0f}s at step {s.step}"
            )
        return False

    def _cancel_watch(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            # Abandoned, so its outcome (a cancellation) is of no interest: retrieve it.
            self._watch.add_done_callback(lambda h: h.cancelled() or h.exception())
            self._watch = None

    async def _stop(
        self,
        *,
        graceful: bool,
        grace: float,
        lost: list[str],
        reason: str,
        notice_at: datetime | None = None,
    ) -> StopResult:
        """End the running generation; afterwards the job resumes from the latest checkpoint."""
        s = self._active_state()
        self._cancel_watch()
        self._set_phase("Resizing")
        result = await workflow.execute_activity(
            STOP_GENERATION,
            StopRequest(
                job=s.spec.name,
                generation=s.generation,
                world_size=s.world_size,
                checkpoint=s.spec.checkpoint,
                graceful=graceful,
                grace_s=grace,
                lost_node_ids=lost,
                notice_at=notice_at,
            ),
            result_type=StopResult,
            start_to_close_timeout=timedelta(seconds=grace + 120),
            heartbeat_timeout=HEARTBEAT,
            retry_policy=PERSISTENT,
            summary=f"{'checkpoint, ' if graceful else ''}stop generation {s.generation}: {reason}",
        )
        s.running = False
        if result.checkpoint_step is not None:
            s.checkpoint_step = max(s.checkpoint_step, result.checkpoint_step)
        if s.step > s.checkpoint_step:
            s.steps_lost += s.step - s.checkpoint_step
        s.step = s.checkpoint_step
        how = "checkpointed" if graceful and not result.forced else "stopped"
        s.record(
            self._now(), f"generation {how}", f"{reason}; resume from step {s.checkpoint_step}"
        )
        return result

    async def _resize(
        self, *, graceful: bool, reason: str, detail: str, grace: float | None = None
    ) -> None:
        s = self._active_state()
        if s.running:
            s.resizes += 1
            await self._stop(
                graceful=graceful,
                grace=s.spec.elastic.graceful_shutdown_timeout_s if grace is None else grace,
                lost=[],
                reason=f"{reason}: {detail}",
            )
        s.grow_since = None

    async def _fault(self, detail: str) -> None:
        """A rank failed or stalled: nodes that are gone are replaced; the rest restart."""
        s = self._active_state()
        s.faults += 1
        s.restarts += 1
        s.record(self._now(), "fault", detail)
        gone = [info for info in await self._describe(s.member_nodes) if info.state == "gone"]
        await self._stop(
            graceful=False, grace=0, lost=[i.node_id for i in gone], reason=f"fault: {detail}"
        )
        if gone:
            self._hold_for_replacement()
        for info in gone:
            node = s.node_by_id(info.node_id)
            if node is not None:
                await self._node_gone(node, info.reason or "lost")
        if s.restarts > s.spec.elastic.max_restarts:
            raise JobFailed(
                f"{s.restarts} failed generations in a row "
                f"(max_restarts={s.spec.elastic.max_restarts}); last fault: {detail}"
            )

    # --- starting a generation ---------------------------------------------------------------

    async def _start_generation_when_ready(self) -> None:
        s = self._active_state()
        elastic = s.spec.elastic
        sizes = planner.allowed_sizes(
            elastic.min_nodes, elastic.max_nodes, elastic.increment_step, elastic.discrete_sizes
        )
        ready = [n for n in s.nodes if n.state == "ready"]
        size = planner.best_size(len(ready), sizes, cap=min(s.allowed, s.ceiling))
        now = self._now()
        if size is not None and size < s.allowed:
            if s.hold_until is None and s.generation == 0 and self._launches:
                # gang start: give the rest of the nodes ordered a moment to arrive
                s.hold_until = now + timedelta(seconds=elastic.scaling_timeout_s)
            # (after a fault, `_on_lost` set the hold: wait that long for a replacement)
            if s.hold_until is not None and now < s.hold_until:
                await self._wait(
                    self._seconds_until(min(s.hold_until, s.next_check or s.hold_until)),
                    "gang start: the other nodes ordered may still arrive"
                    if s.generation == 0
                    else "a replacement may still arrive (faulty_scale_down_timeout_s)",
                )
                return
        if size is None:
            self._set_phase("Pending" if s.generation == 0 else "Resizing")
            await self._wait(
                self._seconds_until(s.next_check), "too few nodes ready: next capacity check"
            )
            return
        s.hold_until = None
        candidates = [planner.Candidate(n.slot, n.lifecycle, n.base) for n in ready]
        members = planner.choose_members(s.members, candidates, size)
        await self._start(members)

    async def _start(self, members: list[int]) -> None:
        s = self._active_state()
        previous = sum(n.procs for n in s.member_nodes)
        s.generation += 1
        s.members = members
        s.generation_checkpoint = s.checkpoint_step
        world = sum(n.procs for n in s.member_nodes)
        plan = GenerationPlan(
            job=s.spec.name,
            generation=s.generation,
            members=[
                Member(node_id=n.node_id or "", address=n.address, procs=n.procs)
                for n in s.member_nodes
            ],
            command=s.spec.command,
            env=s.spec.env,
            image=s.spec.image,
            job_type=s.spec.type,
            checkpoint=s.spec.checkpoint,
            checkpoint_keep=s.spec.checkpoint_keep,
            scale_config={str(k): v for k, v in s.spec.scale_config.get(world, {}).items()},
            global_batch_size=s.spec.global_batch_size,
            total_steps=s.spec.total_steps,
            gpus_per_proc=1 if (s.spec.gpus_per_node or s.spec.total_gpus) else 0,
        )
        try:
            await workflow.execute_activity(
                START_GENERATION,
                plan,
                start_to_close_timeout=timedelta(minutes=15),
                heartbeat_timeout=HEARTBEAT,
                retry_policy=QUICK,
                summary=f"start generation {s.generation} on {len(members)} node(s)",
            )
        except ActivityError as err:
            _unless_cancelled(err)
            s.running = True  # started in part: stop what is there as a fault
            detail = f"generation {s.generation} failed to start: {err.cause}"
            await self._fault(detail)
            if _error_type(err) == CONFIG_ERROR:  # no image, no permission: retrying won't help
                raise JobFailed(detail) from None
            return
        s.running = True
        s.progress_at = self._now()
        self._next_watch = None
        s.record(
            self._now(),
            "generation started",
            f"{len(members)} node(s), world size {s.world_size} (was {previous})",
        )
        self._set_phase("Running")
        await self._release_unneeded()
        self._on_nodes_changed()

    async def _release_unneeded(self) -> None:
        """After a swap back to spot, the on-demand fallback nodes left out are released."""
        s = self._active_state()
        spare = [
            n for n in s.nodes if n.state == "ready" and n.fallback and n.slot not in s.members
        ]
        if spare and s.spec.on_demand.return_to_spot:
            await self._release(spare, "swapped back to spot")
            s.target = max(s.spec.elastic.min_nodes, s.target - len(spare))

    # --- events ------------------------------------------------------------------------------

    async def _handle_inbox(self) -> None:
        s = self._active_state()
        while s.inbox:
            event = s.inbox.pop(0)
            if event.kind in ("reclaim", "rebalance"):
                await self._on_reclaim(event)
            elif event.kind == "lost":
                node = s.node_by_id(event.node_id or "")
                if node is not None and node.alive:
                    await self._on_lost(node, "lost")
            elif event.kind == "scale_out":
                s.target += event.count or 0
                s.ceiling = max(s.ceiling, s.target)
                s.owed += event.count or 0
                s.record(self._now(), "scale out", f"target {s.target} nodes")
                await self._reconcile_orders()
            elif event.kind == "scale_in":
                await self._on_scale_in(event)
            elif event.kind == "pause":
                await self._on_pause()
            elif event.kind == "resume" and s.phase == "Paused":
                s.record(self._now(), "resumed")
                s.owed = s.target - s.spec.on_demand.base_nodes
                if s.spec.pool is None:
                    self._set_phase("Pending")
                    await self._reconcile_orders()
                else:  # claim again: the pool admits it when its turn comes
                    s.grant = None
                    self._set_phase("Queued")
            elif event.kind == "grant" and event.grant and s.phase != "Paused":
                await self._on_grant(event.grant)

    async def _on_reclaim(self, event: Event) -> None:
        """A notice with time left: checkpoint, shrink onto the survivors, replace per policy."""
        s = self._active_state()
        node = s.node_by_id(event.node_id or "")
        if node is None or not node.alive:
            return  # unknown or already gone: nothing to do, never a crash
        if event.kind == "rebalance" and not s.spec.elastic.act_on_rebalance:
            s.record(self._now(), "rebalance recommendation ignored", node.node_id or "")
            return
        seconds_left = self._seconds_until(event.deadline)
        grace = planner.grace_for_notice(
            s.spec.elastic.graceful_shutdown_timeout_s if seconds_left is None else seconds_left,
            s.spec.elastic.graceful_shutdown_timeout_s,
            margin=0 if seconds_left is None else 5,
        )
        if node.slot not in s.members or not s.running:
            await self._node_gone(node, "reclaimed")
            return
        if grace <= 0:
            await self._on_lost(node, "reclaimed")
            return
        # Every member reclaimed by now leaves in the same resize: one membership change.
        leaving = [node]
        for other in list(s.inbox):
            n = s.node_by_id(other.node_id or "") if other.kind in ("reclaim", "lost") else None
            if n is not None and n.alive and n.slot in s.members and n not in leaving:
                leaving.append(n)
                s.inbox.remove(other)
        s.resizes += 1
        names = ", ".join(n.node_id or "" for n in leaving)
        await self._stop(
            graceful=True,
            grace=grace,
            lost=[],
            reason=f"reclaim notice for {names}",
            notice_at=self._now(),
        )
        for n in leaving:
            await self._node_gone(n, "reclaimed")

    async def _on_lost(self, node: NodeRecord, reason: str) -> None:
        """A node already gone: stop at once, resume from the last periodic checkpoint."""
        s = self._active_state()
        if node.slot in s.members and s.running:
            s.resizes += 1
            s.losses += 1
            await self._stop(
                graceful=False,
                grace=0,
                lost=[node.node_id or ""],
                reason=f"{node.node_id} {reason}",
            )
            self._hold_for_replacement()
        await self._node_gone(node, reason)

    def _hold_for_replacement(self) -> None:
        """After a loss, wait up to `faulty_scale_down_timeout_s` for a replacement before
        restarting smaller (with `replace`; with `drop` the job shrinks at once)."""
        s = self._active_state()
        if s.spec.elastic.reclaim_policy == "replace":
            s.hold_until = self._now() + timedelta(
                seconds=s.spec.elastic.faulty_scale_down_timeout_s
            )

    async def _node_gone(self, node: NodeRecord, reason: str) -> None:
        """Book a lost node and order its replacement per the reclaim policy."""
        s = self._active_state()
        if not node.alive:
            return
        if reason == "reclaimed" or node.lifecycle == "spot":
            s.reclaims += 1
        await self._release([node], reason, state="gone")
        if s.spec.elastic.reclaim_policy == "replace" or node.base:
            s.owed += 1
        else:
            s.target = max(s.spec.elastic.min_nodes, s.target - 1)
        await self._reconcile_orders()

    async def _on_scale_in(self, event: Event) -> None:
        s = self._active_state()
        order = self._removal_order()
        names = {n.node_id or f"slot-{n.slot}": n for n in reversed(order)}
        victims_ids = planner.scale_in_victims(list(names), event.count, event.node_ids)
        victims = [names[v] for v in victims_ids]
        s.target = max(s.spec.elastic.min_nodes, s.target - len(victims))
        s.ceiling = s.target
        s.record(
            self._now(), "scale in", f"removing {', '.join(victims_ids)}; target {s.target} nodes"
        )
        await self._remove(victims, "scale in", "scaled in")

    def _removal_order(self) -> list[NodeRecord]:
        """Live nodes, the first to remove first: nodes outside the generation, then the
        highest ranks."""
        s = self._active_state()
        in_rank_order = [n for n in s.member_nodes if n.alive] + [
            n for n in s.nodes if n.alive and n.slot not in s.members
        ]
        return list(reversed(in_rank_order))

    async def _remove(self, victims: list[NodeRecord], why: str, released: str) -> None:
        """Checkpoint and restart without `victims` if they train, then release them."""
        s = self._active_state()
        if any(v.slot in s.members for v in victims):
            names = ", ".join(v.node_id or f"slot-{v.slot}" for v in victims)
            await self._resize(graceful=True, reason=why, detail=names)
        await self._release(victims, released)

    async def _on_pause(self) -> None:
        await self._release_everything("pause", "requested by user", "paused")
        self._set_phase("Paused")
        self._active_state().record(self._now(), "paused")

    async def _release_everything(self, why: str, detail: str, released: str) -> None:
        """Checkpoint, stop, and give every node back (pause, preemption by the pool)."""
        s = self._active_state()
        if s.running:
            await self._resize(graceful=True, reason=why, detail=detail)
        await self._settle_launches()
        await self._release([n for n in s.nodes if n.alive], released)

    # --- capacity pool -----------------------------------------------------------------------

    async def _on_grant(self, grant: PoolGrant) -> None:
        """The pool says how many nodes the job may hold: shrink gracefully (highest ranks
        first, never the on-demand base), pause whole, or order more."""
        s = self._active_state()
        pool = s.spec.pool.name if s.spec.pool else ""
        if grant.refused:
            raise JobFailed(f"capacity pool {pool!r} cannot run this job: {grant.refused}")
        s.grant = grant
        s.target = max(s.target, min(s.ceiling, grant.nodes))
        alive = [n for n in s.nodes if n.alive]
        if grant.nodes < s.spec.elastic.min_nodes:
            if alive:
                s.record(self._now(), "preempted", f"by pool {pool}: queued until it has room")
                await self._release_everything(
                    "preempted", f"pool {pool} needs the nodes", "preempted by the pool"
                )
            self._set_phase("Queued")
            return
        if s.phase == "Queued":
            s.record(self._now(), "admitted", f"by pool {pool}: {grant.nodes} node(s)")
            s.owed = s.allowed - s.spec.on_demand.base_nodes
            self._set_phase("Pending")
        on_demand = [n for n in alive if n.lifecycle == "on-demand"]
        extra_on_demand = max(0, len(on_demand) - grant.on_demand)
        removable = [n for n in self._removal_order() if not n.base]
        victims = [n for n in removable if n.lifecycle == "on-demand"][:extra_on_demand]
        victims += [n for n in removable if n not in victims][
            : max(0, len(alive) - grant.nodes - len(victims))
        ]
        if victims:
            s.record(
                self._now(),
                "pool shrinks the job",
                f"to {grant.nodes} node(s) ({grant.on_demand} on-demand) for pool {pool}",
            )
            await self._remove(victims, f"pool {pool} shrinks the job", "given back to the pool")
        await self._reconcile_orders()

    async def _report_to_pool(self) -> None:
        """Tell the pool what the job claims and holds, whenever that changed."""
        s = self._active_state()
        if s.spec.pool is None:
            return
        report = self._pool_report()
        figures = report.model_dump(exclude={"seq"})
        if figures == self._reported:
            return
        s.pool_reports += 1
        report.seq = s.pool_reports
        pool = s.spec.pool.name
        try:
            await workflow.get_external_workflow_handle(pool_workflow_id(pool)).signal(
                "report", report
            )
        except ApplicationError as err:
            if report.claiming:
                raise JobFailed(
                    f"capacity pool {pool!r} cannot be reached ({err.message}): "
                    f"create it with `spotrain pool create {pool}`"
                ) from None
        self._reported = figures

    def _pool_report(self) -> PoolReport:
        s = self._active_state()
        spec, pool = s.spec, s.spec.pool
        assert pool is not None
        types = spec.spot.instance_types
        alive = [n for n in s.nodes if n.alive]
        on_demand_cap = spec.elastic.max_nodes if spec.on_demand.fallback else 0
        if spec.on_demand.max_nodes is not None:
            on_demand_cap = min(on_demand_cap, spec.on_demand.max_nodes)
        return PoolReport(
            job=spec.name,
            seq=0,
            claiming=s.phase not in ("Paused", "Succeeded", "Failed", "Cancelled"),
            priority=spec.priority,
            team=pool.team,
            preemptible=pool.preemptible,
            min_nodes=max(spec.elastic.min_nodes, spec.on_demand.base_nodes),
            max_nodes=s.ceiling,
            gpus_per_node=self._need()[0]
            if spec.total_gpus is None
            else max(t.gpus for t in types),
            spot_price=max(t.spot_price or t.on_demand_price for t in types),
            on_demand_price=max(t.on_demand_price for t in types),
            min_on_demand=spec.on_demand.base_nodes,
            max_on_demand=max(spec.on_demand.base_nodes, on_demand_cap),
            all_on_demand=not spec.spot.enabled,
            progress=math.floor(20 * s.step / spec.total_steps) / 20,
            holding=len(alive),
            holding_on_demand=sum(n.lifecycle == "on-demand" for n in alive),
            allowance=s.grant.nodes if s.grant else 0,
            allowance_on_demand=s.grant.on_demand if s.grant else 0,
            grant_seq=s.grant.seq if s.grant else 0,
        )

    # --- nodes -------------------------------------------------------------------------------

    async def _reconcile_orders(self, *, spot_only: bool = False) -> None:
        """Order nodes until the job holds `target` (base on-demand first, then spot, then
        on-demand fallback for the nodes it is owed)."""
        s = self._active_state()
        if s.phase == "Paused":
            return
        alive = [n for n in s.nodes if n.alive]
        short = s.allowed - len(alive)
        if short <= 0:
            return
        base_missing = max(0, s.spec.on_demand.base_nodes - sum(n.base for n in alive))
        for _ in range(min(base_missing, short)):
            self._order(lifecycle="on-demand", base=True, pools=[])
        short -= min(base_missing, short)
        if short <= 0:
            return
        offers = await self._find_offers()
        gpus = {t.name: t.gpus for t in s.spec.spot.instance_types}
        held = Counter((n.instance_type, n.zone or "") for n in alive if n.lifecycle == "spot")
        on_demand_room = self._on_demand_room()
        pools = [(o.instance_type, o.zone) for o in offers]
        for i in range(short):
            od_ok = not spot_only and s.owed > 0 and on_demand_room > 0
            ranked = planner.spot_pools(pools, gpus, self._need()[0], held)
            if ranked:
                held[ranked[0]] += 1
                self._order(lifecycle="spot", pools=ranked, on_demand_ok=od_ok)
            elif od_ok:
                self._order(lifecycle="on-demand", fallback=True, pools=[])
                on_demand_room -= 1
            else:
                s.record(self._now(), "waiting for capacity", f"{short - i} node(s) short")
                break
            s.owed = max(0, s.owed - 1)

    def _on_demand_room(self) -> int:
        s = self._active_state()
        if not s.spec.on_demand.fallback:
            return 0
        cap = s.spec.on_demand.max_nodes
        used = sum(1 for n in s.nodes if n.alive and n.lifecycle == "on-demand" and not n.base)
        room = 10**6 if cap is None else max(0, cap - s.spec.on_demand.base_nodes - used)
        if s.spec.pool is not None:  # the pool's on-demand allowance counts the base too
            used_all = sum(1 for n in s.nodes if n.alive and n.lifecycle == "on-demand")
            room = min(room, max(0, (s.grant.on_demand if s.grant else 0) - used_all))
        return room

    def _need(self) -> tuple[int, int]:
        """(GPUs, processes) of the next node ordered. With `total_gpus`, the first share of
        the packing that no live node holds yet (15 over {10, 8}: 10, then 5)."""
        s = self._active_state()
        if s.spec.total_gpus is None:
            return s.spec.gpus_per_node or 0, s.spec.gpus_per_node or s.spec.procs_per_node
        shapes = [t.gpus for t in s.spec.spot.instance_types]
        held = Counter(n.procs for n in s.nodes if n.alive)
        for _, used in planner.pack_gpus(s.spec.total_gpus, shapes):
            if held[used]:
                held[used] -= 1
            else:
                return used, used
        return max(shapes), max(shapes)  # a node beyond the packing (user scale-out)

    def _on_demand_type(self) -> str:
        """The cheapest type that fits the next node: a fallback node sized to its share."""
        s = self._active_state()
        fits = [t for t in s.spec.spot.instance_types if t.gpus >= self._need()[0]]
        return min(fits, key=lambda t: t.on_demand_price).name

    def _order(
        self,
        *,
        lifecycle: str,
        pools: list[tuple[str, str]],
        base: bool = False,
        fallback: bool = False,
        on_demand_ok: bool = False,
    ) -> None:
        s = self._active_state()
        itype = pools[0][0] if pools else self._on_demand_type()
        s.next_slot = max(s.next_slot, len(s.nodes))  # (states carried from before next_slot)
        node = NodeRecord(
            slot=s.next_slot,
            lifecycle=lifecycle,  # type: ignore[arg-type]
            instance_type=itype,
            zone=pools[0][1] if pools else None,
            base=base,
            fallback=fallback,
            procs=self._need()[1],
            price=0.0,
            on_demand_price=s.spec.instance_type(itype).on_demand_price,
        )
        s.nodes.append(node)
        s.next_slot += 1

        task = asyncio.create_task(self._launch(node, pools, on_demand_ok))
        self._launches[node.slot] = task
        task.add_done_callback(lambda _: self._launches.pop(node.slot, None))

    async def _launch(
        self, node: NodeRecord, pools: list[tuple[str, str]], on_demand_ok: bool
    ) -> None:
        """Try each spot pool in turn, then on-demand if allowed; capacity errors move on."""
        s = self._active_state()
        tries: list[tuple[str, str | None, str]] = [(t, z, "spot") for t, z in pools]
        if node.lifecycle == "on-demand":
            tries = [(node.instance_type, None, "on-demand")]
        elif on_demand_ok:
            tries.append((self._on_demand_type(), None, "on-demand"))
        for i, (itype, zone, lifecycle) in enumerate(tries):
            node.instance_type, node.zone, node.lifecycle = itype, zone, lifecycle  # type: ignore[assignment]
            node.fallback = node.fallback or (lifecycle == "on-demand" and not node.base)
            try:
                info = await workflow.execute_activity(
                    LAUNCH_NODE,
                    LaunchRequest(
                        job=s.spec.name,
                        slot=node.slot,
                        attempt=node.attempt,
                        generation=s.generation,
                        lifecycle=lifecycle,  # type: ignore[arg-type]
                        instance_type=itype,
                        zone=zone,
                        max_price=s.spec.spot.max_price if lifecycle == "spot" else None,
                        **self._regions(),
                        fallback_pools=[(t, z) for t, z, lc in tries[i + 1 :] if lc == "spot" and z]
                        if lifecycle == "spot"
                        else [],
                    ),
                    result_type=NodeInfo,
                    start_to_close_timeout=timedelta(minutes=15),
                    heartbeat_timeout=HEARTBEAT,
                    retry_policy=LAUNCH_RETRY,
                    summary=f"launch {lifecycle} {itype} in {zone or 'any zone'}, slot {node.slot}",
                )
            except ActivityError as err:
                node.attempt += 1
                if _error_type(err) == CAPACITY_ERROR:
                    continue
                s.record(self._now(), "launch failed", f"slot {node.slot}: {err.cause}")
                if _error_type(err) == CONFIG_ERROR:  # will not heal by retrying: say so
                    self._fatal = f"cannot launch {lifecycle} {itype}: {err.cause}"
                break
            if not node.alive:  # released while launching (cancel, pause, scale in)
                await self._release_ids([info.node_id], "no longer needed")
                return
            itype = info.instance_type  # an EC2 Fleet may have chosen another pool
            spec_type = s.spec.instance_type(itype)
            node.node_id, node.address, node.zone = info.node_id, info.address, info.zone
            node.instance_type = itype
            node.state = "ready"
            node.ready_at = self._now()
            node.price = (
                spec_type.spot_price
                or s.spot_prices.get(f"{itype}@{info.zone}")
                or spec_type.on_demand_price
                if lifecycle == "spot"
                else spec_type.on_demand_price
            )
            s.record(self._now(), "node ready", f"{lifecycle} {itype} {info.zone} {info.node_id}")
            self._on_nodes_changed()
            return
        node.state, node.reason, node.ended_at = "gone", "no capacity", self._now()
        self._on_nodes_changed()

    async def _settle_launches(self) -> None:
        """Let in-flight launches finish so that every node they made is known (and released)."""
        await workflow.wait_condition(lambda: not self._launches)

    async def _release(self, nodes: list[NodeRecord], reason: str, state: str = "released") -> None:
        s = self._active_state()
        now = self._now()
        for n in nodes:
            n.state, n.reason = state, reason  # type: ignore[assignment]
            n.ended_at = n.ended_at or now
            s.record(
                now, f"node {state}", f"{n.lifecycle} {n.node_id or f'slot {n.slot}'}: {reason}"
            )
        await self._release_ids([n.node_id for n in nodes if n.node_id], reason)
        self._on_nodes_changed()

    async def _release_ids(self, ids: list[str], reason: str) -> None:
        if not ids:
            return
        s = self._active_state()
        await workflow.execute_activity(
            RELEASE_NODES,
            ReleaseRequest(job=s.spec.name, node_ids=ids, **self._regions()),
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=HEARTBEAT,
            retry_policy=PERSISTENT,
            summary=f"release {', '.join(ids)}: {reason}",
        )

    def _regions(self) -> dict[str, Any]:
        """Where the provider looks for the job's nodes: its home region and more_regions."""
        spot = self._active_state().spec.spot
        return {"region": spot.region, "more_regions": spot.more_regions}

    async def _find_offers(self) -> list[Offer]:
        s = self._active_state()
        if not s.spec.spot.enabled:
            return []
        try:
            offers = await workflow.execute_activity(
                FIND_OFFERS,
                s.spec.spot,
                result_type=list[Offer],
                start_to_close_timeout=QUICK_CALL,
                retry_policy=QUICK,
                summary="find spot pools that can serve now",
            )
        except ActivityError as err:
            _unless_cancelled(err)
            return []  # a flapping cloud API means no new orders this round, nothing more
        s.spot_prices |= {f"{o.instance_type}@{o.zone}": o.price for o in offers}
        return offers

    async def _describe(self, nodes: list[NodeRecord] | None) -> list[NodeInfo]:
        """The provider's view of `nodes`, or of every node tagged with the job (None)."""
        s = self._active_state()
        ids = [] if nodes is None else [n.node_id for n in nodes if n.node_id]
        if nodes is not None and not ids:
            return []
        try:
            return await workflow.execute_activity(
                DESCRIBE_NODES,
                DescribeRequest(job=s.spec.name, node_ids=ids, **self._regions()),
                result_type=list[NodeInfo],
                start_to_close_timeout=QUICK_CALL,
                retry_policy=QUICK,
                summary=f"check {len(ids)} node(s)" if ids else "find every node of the job",
            )
        except ActivityError as err:
            _unless_cancelled(err)
            return []  # only a node that is really gone changes membership, not an API error

    def _on_nodes_changed(self) -> None:
        s = self._active_state()
        self._changes += 1
        if s.grow_since is None and self._growth_plan() is not None:
            s.grow_since = self._now()
        self._publish()

    # --- growth and periodic checks ----------------------------------------------------------

    def _growth_plan(self) -> list[int] | None:
        """The bigger (or all-spot) membership ready nodes allow now, if any."""
        s = self._active_state()
        if not s.running:
            return None
        elastic = s.spec.elastic
        sizes = planner.allowed_sizes(
            elastic.min_nodes, elastic.max_nodes, elastic.increment_step, elastic.discrete_sizes
        )
        ready = [n for n in s.nodes if n.state == "ready"]
        size = planner.best_size(len(ready), sizes, cap=s.ceiling)
        if size is None or size < len(s.members):
            return None
        plan = planner.choose_members(
            s.members, [planner.Candidate(n.slot, n.lifecycle, n.base) for n in ready], size
        )
        swaps_back = s.spec.on_demand.return_to_spot and set(plan) != set(s.members)
        return plan if size > len(s.members) or swaps_back else None

    def _growth_at(self) -> datetime | None:
        s = self._active_state()
        if s.grow_since is None:
            return None
        if self._growth_plan() is None:
            s.grow_since = None
            return None
        return s.grow_since + timedelta(seconds=s.spec.elastic.scaling_timeout_s)

    def _growth_detail(self) -> str:
        plan = self._growth_plan() or []
        return f"{len(self._active_state().members)} -> {len(plan)} node(s)"

    async def _periodic_checks(self) -> None:
        """Catch losses no webhook reported, grow onto spare spot, swap fallback nodes back."""
        s = self._active_state()
        elastic = s.spec.elastic
        s.next_check = self._now() + timedelta(seconds=elastic.capacity_check_interval_s)
        for info in await self._describe([n for n in s.nodes if n.state == "ready"]):
            if info.state == "gone":
                s.inbox.append(Event(kind="lost", node_id=info.node_id))
        if s.phase == "Paused" or not s.spec.spot.enabled:
            return
        fallbacks = [n for n in s.nodes if n.alive and n.fallback]
        spare_spot = any(
            n.state == "ready" and n.lifecycle == "spot" and n.slot not in s.members
            for n in s.nodes
        )
        wants_growth = elastic.opportunistic and s.target < s.ceiling
        wants_swap = (
            s.spec.on_demand.return_to_spot and fallbacks and not self._launches and not spare_spot
        )
        if (wants_growth or wants_swap) and await self._find_offers():
            if wants_growth:
                s.target = s.ceiling
            if wants_swap:
                s.target = min(s.ceiling + len(fallbacks), s.target + len(fallbacks))
            await self._reconcile_orders(spot_only=True)
        else:
            await self._reconcile_orders()

    # --- teardown and visibility -------------------------------------------------------------

    async def _teardown(self, phase: str, keep: bool) -> None:
        """Release every node and worker the job owns; runs on success, failure and cancel."""
        s = self._active_state()
        self._cancel_watch()
        if s.running:
            await self._stop(graceful=False, grace=0, lost=[], reason=f"job {phase.lower()}")
        await self._settle_launches()
        await self._release([n for n in s.nodes if n.alive], "job ended")
        # A launch whose result was lost (cancelled mid-call) left a node only its tags know.
        strays = [i.node_id for i in await self._describe(None) if i.state != "gone"]
        await self._release_ids(strays, "job ended (found by tag)")
        await workflow.execute_activity(
            CLEANUP_JOB,
            CleanupRequest(job=s.spec.name, keep=keep),
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=HEARTBEAT,
            retry_policy=PERSISTENT,
            summary="remove the job's workers" + (" (keeping logs)" if keep else ""),
        )
        s.record(self._now(), phase.lower(), s.failure or "")
        self._set_phase(phase)
        await self._report_to_pool()  # leaves the pool: its share goes to the next job
        await workflow.wait_condition(workflow.all_handlers_finished)

    def _set_phase(self, phase: str) -> None:
        s = self._active_state()
        if s.phase != phase:
            s.phase = phase  # type: ignore[assignment]
            self._publish()

    def _publish(self) -> None:
        """Keep search attributes current for the UI, `spotrain list` and the webhook."""
        s = self._active_state()
        alive = [n for n in s.nodes if n.alive]
        values = (
            s.phase,
            s.world_size,
            sum(n.lifecycle == "spot" for n in alive),
            sum(n.lifecycle == "on-demand" for n in alive),
            tuple(sorted(n.node_id for n in alive if n.node_id)),
        )
        if values == self._published:
            return
        self._published = values
        _, cost, _ = s.costs(self._now())
        workflow.upsert_search_attributes(
            [
                attributes.JOB.value_set(s.spec.name),
                attributes.PHASE.value_set(values[0]),
                attributes.WORLD_SIZE.value_set(values[1]),
                attributes.SPOT_NODES.value_set(values[2]),
                attributes.ON_DEMAND_NODES.value_set(values[3]),
                attributes.NODE_IDS.value_set(list(values[4])),
                attributes.COST.value_set(round(sum(cost.values()), 4)),
            ]
        )

    def _now(self) -> datetime:
        return workflow.now()
