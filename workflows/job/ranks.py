"""A TrainingJob's training processes (ranks), as its workflow starts, watches and stops them
one generation at a time through the rank runtime's activities (`calls`).

Sequencing only: the membership and settings of a generation come from `job_planner`; this
books each step in the job's state. Call from workflow code only.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.contract import (
        CONFIG_ERROR,
        StopRequest,
        StopResult,
        WatchRequest,
        WatchResult,
    )
    from spotrain.workflows.job import calls, job_planner
    from spotrain.workflows.job.state import JobFailed, JobState, Phase
    from spotrain.workflows.policies.locality import grouped_by_zone


class Ranks:
    def __init__(self, state: JobState, set_phase: Callable[[Phase], None]) -> None:
        self.s = state
        self.set_phase = set_phase
        self.watching: workflow.ActivityHandle[WatchResult] | None = None
        self.next_watch: datetime | None = None  # when to poll a runtime that answered early

    async def check_location(self) -> None:
        """Before the first node is bought: a location the job cannot train from (refused,
        or holding a finished job) fails the job now, not once its nodes are up."""
        try:
            await calls.check_checkpoint(self.s.spec.checkpoint)
        except ActivityError as err:
            if calls.error_type(err) == CONFIG_ERROR:
                raise JobFailed(str(err.cause)) from None
            raise

    async def start(self, members: list[int]) -> None:
        """Start the next generation on `members` (rank order); an ActivityError means it did
        not start (or only in part: the caller stops it as a fault)."""
        s = self.s
        previous = sum(n.procs for n in s.member_nodes)
        s.generation += 1
        s.members, s.prepared = self._ring_order(members), []
        s.generation_checkpoint = s.checkpoint_step
        await calls.start_generation(
            job_planner.generation_plan(s),
            f"start generation {s.generation} on {len(members)} node(s)",
        )
        s.running = True
        s.progress_at = workflow.now()
        self.next_watch = None
        s.record(
            workflow.now(),
            "generation started",
            f"{len(members)} node(s), world size {s.world_size} (was {previous})",
        )
        self.set_phase(Phase.RUNNING)

    async def prepare(self, members: list[int]) -> None:
        """Live resize: the next generation's new ranks (growth, a replacement) start now,
        importing and building their model while this generation trains on, so the resize
        itself waits for none of that."""
        s = self.s
        if s.spec.elastic.resize == "live" and s.running:
            members = self._ring_order(members)
            plan = job_planner.generation_plan(s, next_members=members)
            s.prepared = members
            await calls.prepare_generation(
                plan, f"head start of generation {plan.generation}'s new ranks"
            )

    def _ring_order(self, members: list[int]) -> list[int]:
        """A job that may span zones ranks its nodes zone by zone, so its ring crosses each
        zone boundary once (the same order for a generation's head start and its start)."""
        s = self.s
        if s.spec.placement == "zone" or not workflow.patched("zone-grouped-ranks"):
            return members
        return grouped_by_zone(members, {m: s.node(m).zone or "" for m in members})

    def watch(self) -> workflow.ActivityHandle[WatchResult] | None:
        """The watch on the running generation, started anew once the report interval is up
        (a runtime that answers early is not polled again before then)."""
        s = self.s
        if self.watching is None and (self.next_watch is None or workflow.now() >= self.next_watch):
            interval = s.spec.elastic.progress_report_interval_s
            self.next_watch = workflow.now() + timedelta(seconds=interval)
            self.watching = calls.watch_generation(
                WatchRequest(
                    **self._generation(),
                    report_after_s=interval,
                    known_events=s.seen_events[-100:],
                ),
                f"watch generation {s.generation} ({s.world_size} ranks)",
            )
        return self.watching

    def outcome(self) -> WatchResult | None:
        """The watch's answer, once it has one (a watch that failed reads as a failed
        generation); the next `watch()` starts another."""
        watch = self.watching
        if watch is None or not watch.done():
            return None
        self.watching = None
        try:
            return watch.result()
        except ActivityError as err:
            return WatchResult(outcome="failed", detail=f"watch failed: {err.cause}")

    def _generation(self) -> dict[str, Any]:
        """What names the running generation to the runtime."""
        s = self.s
        return {
            "job": s.spec.name,
            "generation": s.generation,
            "world_size": s.world_size,
            "checkpoint": s.spec.checkpoint,
        }

    def cancel_watch(self) -> None:
        if self.watching is not None:
            self.watching.cancel()
            # Abandoned, so its outcome (a cancellation) is of no interest: retrieve it.
            self.watching.add_done_callback(lambda h: h.cancelled() or h.exception())
            self.watching = None

    async def stop(
        self,
        *,
        graceful: bool,
        grace: float,
        lost: list[str],
        reason: str,
        notice_at: datetime | None = None,
        resize: bool = False,
    ) -> StopResult:
        """End the running generation (`graceful`: checkpoint first, within `grace` seconds);
        afterwards the job resumes from the latest checkpoint. `resize`: the job goes on with
        some of these ranks, so with `elastic.resize: live` they park instead of exiting and
        the next generation resumes from their memory."""
        s = self.s
        self.cancel_watch()
        self.set_phase(Phase.RESIZING)
        live = resize and s.spec.elastic.resize == "live"
        result = await calls.stop_generation(
            StopRequest(
                **self._generation(),
                graceful=graceful,
                # (live: a rank in a collective with a lost peer, or forming the new group
                # with one, parks once that times out)
                grace_s=grace + 2 * s.spec.elastic.collective_timeout_s if live else grace,
                lost_node_ids=lost,
                notice_at=notice_at,
                live=live,
            ),
            f"{'checkpoint, ' if graceful else ''}stop generation {s.generation}: {reason}",
        )
        if result.done and not workflow.patched("complete-when-finished-in-stop"):
            # (a history from before: that job started another generation; replay does too)
            result = result.model_copy(update={"done": False})
        s.note_stopped(result)
        if result.held_step is not None:
            how = "parked (live resize)"
        else:
            how = "checkpointed" if graceful and not result.forced else "stopped"
        s.record(workflow.now(), f"generation {how}", f"{reason}; resume from step {s.step}")
        if s.finished:
            s.record(workflow.now(), "completed", f"step {s.step}, as the generation stopped")
        return result
