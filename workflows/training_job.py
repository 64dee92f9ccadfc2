"""The `TrainingJob` workflow: one elastic training job from submission to teardown.

A job runs as a sequence of generations, each a fixed membership of nodes in rank order. The
main loop alternates between two states: no generation running (order nodes, wait for enough
of them, gang-start the next generation) and a generation running (watch it, react to
events). Every resize ends generation g and starts g+1 from the latest complete checkpoint.

Signals and updates (`training_job_handlers.py`) only queue events (`events`); the main loop
is the one place that acts on them, so decisions are sequential and easy to follow. All state
lives in `JobState`, which continue-as-new carries whole. This module only sequences, on top
of `job/`, `capacity/` and `policies/`: every decision is a pure function of `job_planner`
(state in, plan out), and every side effect an activity called through `calls`: by `fleet`
for the job's nodes, by `ranks` for its training processes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.capacity.fleet import Fleet, unless_cancelled
    from spotrain.workflows.capacity.pool_member import PoolMember
    from spotrain.workflows.contract import (
        CONFIG_ERROR,
        CleanupRequest,
        WatchResult,
    )
    from spotrain.workflows.history import history_is_long
    from spotrain.workflows.job import attributes, calls, events, job_planner, start_failure
    from spotrain.workflows.job.alarms import SHORTEST_WAIT_S, Alarms
    from spotrain.workflows.job.departures import Departures
    from spotrain.workflows.job.ranks import Ranks
    from spotrain.workflows.job.state import (
        JobFailed,
        JobResult,
        JobState,
        NodeRecord,
        NodeState,
        Phase,
    )
    from spotrain.workflows.policies import budget_hooks, deadline_hooks, timed_scale_out
    from spotrain.workflows.policies.make_before_break_hooks import Swapper
    from spotrain.workflows.policies.stragglers_hooks import StragglerWatch
    from spotrain.workflows.policies.timed_scale_out_hooks import ScaleOutWaits
    from spotrain.workflows.spec import SpecError, parse_spec
    from spotrain.workflows.training_job_handlers import TrainingJobHandlers

INVALID_SPEC = "InvalidSpec"
JOB_FAILED = "JobFailed"


@workflow.defn(name="TrainingJob")
class TrainingJob(TrainingJobHandlers):
    @workflow.init
    def __init__(self, spec: Any, carried: JobState | None = None) -> None:
        self.s: JobState | None = carried
        self.invalid: str | None = None
        if carried is None:
            try:
                self.s = JobState.new(parse_spec(spec))
            except SpecError as err:
                self.invalid = str(err)
        self._changes = 0
        self._published: tuple[Any, ...] | None = None
        if self.s is not None:
            self.scale_out_waits = ScaleOutWaits(self.s, self._now)

    # --- the public interface ----------------------------------------------------------------

    @workflow.run
    async def run(self, spec: Any, carried: JobState | None = None) -> JobResult:
        if self.s is None:
            raise ApplicationError(
                self.invalid or "invalid job spec", type=INVALID_SPEC, non_retryable=True
            )
        s = self.s
        self.fleet = Fleet(s, self._on_nodes_changed)
        self.ranks = Ranks(s, self._set_phase)
        self.pool = PoolMember(
            s, self.fleet, self._set_phase, self._release_everything, self._remove
        )
        self.stragglers = StragglerWatch(s, self.fleet, self._remove)
        self.swapper = Swapper(
            s,
            self.fleet,
            self.ranks,
            lambda node_id, deadline: s.inbox.insert(
                0, events.Reclaim(node_id=node_id, deadline=deadline, shrink=True)
            ),
        )
        self.departures = Departures(s, self.fleet, self.ranks, self.swapper)
        self.alarms = Alarms()
        first = s.submitted_at is None
        if first:
            s.submitted_at = self._now()
            s.next_check = self._now() + timedelta(seconds=s.spec.elastic.capacity_check_interval_s)
            s.record(self._now(), "submitted", f"target {s.target} nodes")
            if s.spec.pool is not None:
                self._set_phase(Phase.QUEUED)
        try:
            if first and workflow.patched("checkpoint-checked-first"):
                await self.ranks.check_location()
            if await self._drive():
                await workflow.wait_condition(workflow.all_handlers_finished)
                s.runs += 1
                s.prune(self._now())
                # The state holds the spec: carried once, not twice (issue 46: a 1 MB command
                # made a 2 MB payload, and every task after failed).
                workflow.continue_as_new(args=[None, s])
            await self._teardown(Phase.SUCCEEDED, keep=s.spec.cleanup == "never")
        except (asyncio.CancelledError, ActivityError) as err:
            if not is_cancelled_exception(err):
                raise
            await self._teardown(Phase.CANCELLED, keep=s.spec.cleanup == "never")
            raise asyncio.CancelledError() from err
        except JobFailed as err:
            s.failure = str(err)
            await self._teardown(Phase.FAILED, keep=s.spec.cleanup != "always")
            raise ApplicationError(
                str(err), self.result().model_dump(mode="json"), type=JOB_FAILED, non_retryable=True
            ) from None
        return self.result()

    # --- the main loop -----------------------------------------------------------------------

    async def _drive(self) -> bool:
        """Run until the job completes (False) or should continue as new (True)."""
        s = self._active_state()
        if not s.nodes:
            await self.fleet.reconcile()
        while True:
            if self.fleet.fatal:
                raise JobFailed(self.fleet.fatal)
            await self._handle_inbox()
            if s.finished:  # (its last generation finished as it was being stopped)
                return False
            if why := budget_hooks.check(s, self._now()):
                await self._pause(why)
            await self.pool.report()
            if s.phase in (Phase.PAUSED, Phase.QUEUED):
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
                and not self.fleet.launches
                # (before the patch, only a running job continued as new: one short of
                # nodes for long kept growing its history)
                and (s.running or workflow.patched("continue-as-new-when-not-running"))
                and not self.scale_out_waits.waiting  # (their answers are this run's)
            ):
                self.ranks.cancel_watch()
                return True

    async def _wait(
        self, until: datetime | None, why: str, ready: Callable[[], bool] = lambda: False
    ) -> None:
        """Wait until an event is queued, nodes change, `ready()` holds, or `until` (None:
        no timer); `why` names the timer in the Web UI."""
        s = self._active_state()
        changes = self._changes
        seconds = None if until is None else (until - self._now()).total_seconds()
        if seconds is not None and seconds <= 0:
            # Already due. (Only then: workflow time stands still within an activation, so
            # returning early for anything due later would spin the loop without yielding.)
            return
        if workflow.patched("kept-timers"):  # (alarms.py says why)
            timer = None if until is None else self.alarms.at(until, why)
            await workflow.wait_condition(
                lambda: (
                    bool(s.inbox)
                    or self._changes != changes
                    or ready()
                    or (timer is not None and timer.done())
                )
            )
            return
        with contextlib.suppress(TimeoutError):
            await workflow.wait_condition(
                lambda: bool(s.inbox) or self._changes != changes or ready(),
                timeout=None if seconds is None else max(seconds, SHORTEST_WAIT_S),
                timeout_summary=why,
            )

    # --- running a generation ----------------------------------------------------------------

    async def _watch_generation(self) -> bool:
        """Watch the running generation until something needs a decision. True: completed."""
        s = self._active_state()
        watch = self.ranks.watch()
        wake = {
            "next capacity check": s.next_check,
            "grow once the scaling timeout has passed": self._growth_at(),
            "next progress report": None if watch else self.ranks.next_watch,
            "a warned node's replacement is late: shrink": self.swapper.wake(),
            "budget reached at this spend rate": budget_hooks.wake(s, self._now()),
        }
        soonest = min(((w, why) for why, w in wake.items() if w is not None), default=None)
        await self._wait(
            soonest[0] if soonest else None,
            soonest[1] if soonest else "",
            watch.done if watch else lambda: False,
        )
        if await self.swapper.step():
            return False
        growth_at = self._growth_at()
        if growth_at is not None and self._now() >= growth_at:
            plan = job_planner.growth_plan(s) or []
            await self.ranks.prepare(plan)
            await self._resize(reason="grow", detail=f"{len(s.members)} -> {len(plan)} node(s)")
            return False
        outcome = self.ranks.outcome()
        return outcome is not None and await self._on_watch(outcome)

    async def _on_watch(self, w: WatchResult) -> bool:
        s = self._active_state()
        for notice in w.notices:  # found by ranks themselves: queued like the webhook's
            self.reclaim(notice)
        s.note_progress(w, self._now())
        deadline_hooks.observe(s, self._now())
        if w.checkpoints is not None and (warn := s.note_checkpoints(w.checkpoints, self._now())):
            workflow.logger.warning(f"{s.spec.name}: {warn}")
        if await self.stragglers.on_watch(w):  # (a node replaced: not a stall fault)
            return False
        verdict, detail = job_planner.watch_verdict(s, w, self._now())
        if verdict == "completed":
            s.step = max(s.step, w.step or s.spec.total_steps)
            s.running = False
            s.record(self._now(), "completed", f"step {s.step}")
            return True
        if verdict == "fault":
            fatal = start_failure.cannot_start(s, w)
            await self._fault(fatal or detail, resize=not fatal)
            if fatal and workflow.patched("cannot-start-fails-at-once"):
                raise JobFailed(fatal)
        return False

    async def _resize(self, *, reason: str, detail: str, resize: bool = True) -> None:
        """Checkpoint and stop the running generation, so the next one starts resized
        (`resize` False: nothing runs next, as on a pause)."""
        s = self._active_state()
        if s.running:
            s.resizes += 1
            await self.ranks.stop(
                graceful=True,
                grace=s.spec.elastic.graceful_shutdown_timeout_s,
                lost=[],
                reason=f"{reason}: {detail}",
                resize=resize,
            )
        s.grow_since = None

    async def _fault(self, detail: str, resize: bool = False) -> None:
        """A rank failed or stalled: nodes that are gone are replaced; the rest restart (or,
        `resize` in live mode, keep what they hold: a rank lost costs the step in flight)."""
        s = self._active_state()
        s.faults += 1
        s.restarts += 1
        s.record(self._now(), "fault", detail)
        gone = [info for info in await self.fleet.describe(s.member_nodes) if info.state == "gone"]
        await self.ranks.stop(
            graceful=False,
            grace=0,
            lost=[i.node_id for i in gone],
            reason=f"fault: {detail}",
            resize=resize,
        )
        if gone:
            s.hold_until = job_planner.replacement_hold(s, self._now())
        for info in gone:
            node = s.node_by_id(info.node_id)
            if node is not None:
                await self.departures.gone(node, info.reason or "lost")
        if failure := job_planner.restarts_exhausted(s, detail):
            raise JobFailed(failure)

    # --- starting a generation ---------------------------------------------------------------

    async def _start_generation_when_ready(self) -> None:
        s = self._active_state()
        survivors_first = (
            s.held and s.spec.elastic.resize == "live" and workflow.patched("live-survivors-first")
        )
        plan = job_planner.next_generation(
            s, self._now(), launching=bool(self.fleet.launches), survivors_first=survivors_first
        )
        s.hold_until = plan.hold_until
        if plan.members is None:
            if plan.too_few:
                self._set_phase(Phase.PENDING if s.generation == 0 else Phase.RESIZING)
            await self._wait(plan.wake, plan.why)
            return
        await self._start(plan.members)

    async def _start(self, members: list[int]) -> None:
        s = self._active_state()
        try:
            await self.ranks.start(members)
        except ActivityError as err:
            unless_cancelled(err)
            s.running = True  # started in part: stop what is there as a fault
            detail = f"generation {s.generation} failed to start: {err.cause}"
            await self._fault(detail)
            if calls.error_type(err) == CONFIG_ERROR:  # no image, no permission: won't heal
                raise JobFailed(detail) from None
            return
        spare, target = job_planner.swap_back(s)
        if spare:  # back on spot: the on-demand fallback nodes left out go
            await self.fleet.release(spare, "swapped back to spot")
            s.target = target
        self._on_nodes_changed()

    # --- events ------------------------------------------------------------------------------

    async def _handle_inbox(self) -> None:
        s = self._active_state()
        while s.inbox:
            match s.inbox.pop(0):
                case events.Reclaim() as event:
                    await self.departures.on_reclaim(event)
                case events.Lost(node_id=node_id):
                    node = s.node_by_id(node_id)
                    if node is not None and node.alive:
                        await self.departures.on_lost(node, "lost")
                case events.ScaleOut(count=count, timeout_s=timeout_s) as event:
                    if timeout_s is not None:
                        self.scale_out_waits.begin(event)
                    s.target += count
                    s.ceiling = max(s.ceiling, s.target)
                    s.owed += count
                    s.record(self._now(), "scale out", f"target {s.target} nodes")
                    await self.fleet.reconcile()
                    self.scale_out_waits.settle()  # (enough nodes ready already)
                case events.ScaleOutDue(seq=seq):
                    await self.scale_out_waits.due(seq, self.fleet)
                case events.ScaleIn(count=count, node_ids=node_ids):
                    down = job_planner.scale_in_plan(s, count, node_ids)
                    s.target = s.ceiling = down.target
                    s.record(
                        self._now(),
                        "scale in",
                        f"removing {', '.join(down.names)}; target {s.target} nodes",
                    )
                    await self._remove(down.victims, "scale in", "scaled in")
                case events.Pause():
                    await self._pause("requested by user")
                case events.Resume() if s.phase == Phase.PAUSED:
                    await self._on_resume()
                case events.Grant(grant=grant) if s.phase != Phase.PAUSED:
                    await self.pool.on_grant(grant)

    async def _remove(self, victims: list[NodeRecord], why: str, released: str) -> None:
        """Checkpoint and restart without `victims` if they train, then release them."""
        s = self._active_state()
        if any(v.slot in s.members for v in victims):
            names = ", ".join(v.node_id or f"slot-{v.slot}" for v in victims)
            await self._resize(reason=why, detail=names)
        await self.fleet.release(victims, released)

    async def _release_everything(self, why: str, detail: str, released: str) -> None:
        """Checkpoint, stop, and give every node back (pause, preemption by the pool)."""
        s = self._active_state()
        if s.running:
            await self._resize(reason=why, detail=detail, resize=False)
        await self.fleet.settle()
        await self.fleet.release([n for n in s.nodes if n.alive], released)

    async def _pause(self, why: str) -> None:
        """Checkpoint, stop and give every node back until resumed (the user's or budget's)."""
        s = self._active_state()
        timed_scale_out.answer(s, f"paused; the target stays {s.target} nodes")
        await self._release_everything("pause", why, "paused")
        self._set_phase(Phase.PAUSED)
        s.paused_reason = why
        s.record(self._now(), "paused", why)

    async def _on_resume(self) -> None:
        s = self._active_state()
        s.record(self._now(), "resumed")
        s.owed = s.target - s.spec.on_demand.base_nodes
        if s.spec.pool is None:
            self._set_phase(Phase.PENDING)
            await self.fleet.reconcile()
        else:  # claim again: the pool admits it when its turn comes
            s.grant = None
            self._set_phase(Phase.QUEUED)

    def _on_nodes_changed(self) -> None:
        s = self._active_state()
        self._changes += 1
        s.grow_since = job_planner.growth_since(s, self._now())
        self.scale_out_waits.settle()
        self._publish()

    # --- growth and periodic checks ----------------------------------------------------------

    def _growth_at(self) -> datetime | None:
        s = self._active_state()
        s.grow_since, due = job_planner.growth_timer(
            s,
            self._now() if workflow.patched("growth-debounce-starts-when-possible") else None,
            restore_at_once=workflow.patched("growth-to-target-at-once"),
        )
        return due

    async def _periodic_checks(self) -> None:
        """Catch losses no webhook reported, grow onto spare spot, swap fallback nodes back."""
        s = self._active_state()
        s.next_check = self._now() + timedelta(seconds=s.spec.elastic.capacity_check_interval_s)
        for info in await self.fleet.describe([n for n in s.nodes if n.state == NodeState.READY]):
            if info.state == "gone":
                s.inbox.append(events.Lost(node_id=info.node_id))
        if s.spec.deadline is not None and workflow.patched("deadline-policy"):
            deadline_hooks.check(s, self._now())
        # (before the patch only a job short of min hopped, and a check could ask for the
        # offers three times; now once)
        once = workflow.patched("hops-that-pay")
        offers = None
        if once:
            offers = await self.fleet.hop_if_it_pays(
                lambda why: self._resize(reason="zone hop", detail=why, resize=False)
            )
        check = job_planner.capacity_check(s, launching=bool(self.fleet.launches))
        if check is None:
            return
        if offers is None and check.wants_spot:
            offers = await self.fleet.find_offers()
        looked_up = offers if once else None
        if check.wants_spot and offers:
            s.target = job_planner.target_with_spot(s, check)
            await self.fleet.reconcile(spot_only=True, offers=looked_up)
        else:
            await self.fleet.reconcile(offers=looked_up)

    # --- teardown and visibility -------------------------------------------------------------

    async def _teardown(self, phase: Phase, keep: bool) -> None:
        """Release every node and worker the job owns; runs on success, failure and cancel."""
        s = self._active_state()
        timed_scale_out.answer(s, f"job {phase.lower()} before the nodes came")
        self.ranks.cancel_watch()
        if s.running:
            await self.ranks.stop(graceful=False, grace=0, lost=[], reason=f"job {phase.lower()}")
        await self.fleet.settle()
        await self.fleet.release([n for n in s.nodes if n.alive], "job ended")
        # A launch whose result was lost (cancelled mid-call) left a node only its tags know.
        strays = [i.node_id for i in await self.fleet.describe(None) if i.state != "gone"]
        await self.fleet.release_ids(strays, "job ended (found by tag)")
        await calls.cleanup_job(
            CleanupRequest(job=s.spec.name, keep=keep),
            "remove the job's workers" + (" (keeping logs)" if keep else ""),
        )
        s.record(self._now(), phase.lower(), s.failure or "")
        self._set_phase(phase)
        await self.pool.report()  # leaves the pool: its share goes to the next job
        await workflow.wait_condition(workflow.all_handlers_finished)

    def _set_phase(self, phase: Phase) -> None:
        s = self._active_state()
        if s.phase != phase:
            s.phase = phase
            self._publish()

    def _publish(self) -> None:
        """Keep search attributes current for the UI, `spotrain list` and the webhook."""
        s = self._active_state()
        if attributes.shown(s) != self._published:
            self._published = attributes.shown(s)
            workflow.upsert_search_attributes(attributes.updates(s, self._now()))
