"""The `TrainingJob` workflow's public interface: the signals, updates and queries that
users, the webhook, the operator and the capacity pool send it.

Each handler only checks its input and queues an event in the job's inbox; the main loop
(`training_job.py`) is the one place that acts on them, so decisions stay sequential. A
class of its own so the main loop reads without them; `TrainingJob` inherits it.
"""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow
from temporalio.common import RawValue

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.contract import Empty, ReclaimNotice, ScaleIn, ScaleOut, SetBudget
    from spotrain.workflows.job import events, job_planner
    from spotrain.workflows.job.signal_input import GRANT, NODE_LOST, RECLAIM
    from spotrain.workflows.job.state import JobResult, JobState, JobStatus, Phase, TimelineEntry
    from spotrain.workflows.policies import budget, budget_hooks, timed_scale_out
    from spotrain.workflows.policies.timed_scale_out_hooks import ScaleOutWaits


class TrainingJobHandlers:
    """What a job answers from outside; the state is None only for an invalid spec."""

    s: JobState | None
    invalid: str | None
    scale_out_waits: ScaleOutWaits

    @workflow.signal(name=RECLAIM.name)
    def _reclaim_signal(self, raw: RawValue) -> None:
        if notice := RECLAIM.read(raw, self.s):
            self.reclaim(notice)

    def reclaim(self, notice: ReclaimNotice) -> None:
        """A notice (the signal's, or one the ranks found), queued once per event id."""
        if self.s and self.s.remember(notice.event_id):
            self.s.inbox.append(
                events.Reclaim(
                    kind="reclaim" if notice.kind == "interruption" else notice.kind,
                    node_id=notice.node_id,
                    deadline=notice.deadline,
                )
            )

    @workflow.signal(name=NODE_LOST.name)
    def node_lost(self, raw: RawValue) -> None:
        lost = NODE_LOST.read(raw, self.s)
        if lost and self.s and self.s.remember(lost.event_id):
            self.s.inbox.append(events.Lost(node_id=lost.node_id))

    @workflow.signal(name=GRANT.name)
    def grant(self, raw: RawValue) -> None:
        grant = GRANT.read(raw, self.s)
        if grant and self.s and grant.seq > self.s.grant_seen:
            self.s.grant_seen = grant.seq
            self.s.inbox.append(events.Grant(grant=grant))

    @workflow.update(name="scale_out")
    async def scale_out(self, req: ScaleOut) -> str:
        s = self._active_state()
        update_id = _update_id()
        if update_id in s.update_answers:  # a repeat from before continue-as-new
            return s.update_answers[update_id]
        if req.timeout_s is None:
            s.inbox.append(events.ScaleOut(count=req.count))
            return s.remember_answer(update_id, f"scaling out by {req.count} node(s)")
        return s.remember_answer(
            update_id, await self.scale_out_waits.ask(req.count, req.timeout_s)
        )

    @scale_out.validator
    def _check_scale_out(self, req: ScaleOut) -> None:
        s = self._active_state()
        if _update_id() in s.update_answers:
            return  # answered before: the repeat gets that answer, whatever holds now
        if error := job_planner.scale_out_error(s, req.count) or (
            req.timeout_s is not None and timed_scale_out.busy(s)
        ):
            raise ValueError(error)

    @workflow.update(name="scale_in")
    def scale_in(self, req: ScaleIn) -> str:
        s = self._active_state()
        update_id = _update_id()
        if update_id in s.update_answers:  # a repeat from before continue-as-new
            return s.update_answers[update_id]
        s.inbox.append(events.ScaleIn(count=req.count, node_ids=req.node_ids))
        count = req.count or len(req.node_ids or [])
        return s.remember_answer(update_id, f"scaling in by {count} node(s)")

    @scale_in.validator
    def _check_scale_in(self, req: ScaleIn) -> None:
        s = self._active_state()
        if _update_id() in s.update_answers:
            return  # answered before (a named worker may be gone by now: that was this)
        if error := job_planner.scale_in_error(s, req):
            raise ValueError(error)

    @workflow.update(name="pause")
    def pause(self, _: Empty) -> str:
        self._active_state().inbox.append(events.Pause())
        return "pausing: workers checkpoint, then every node is released"

    @pause.validator
    def _check_pause(self, _: Empty) -> None:
        if self._active_state().phase == Phase.PAUSED:
            raise ValueError("already paused")

    @workflow.update(name="resume")
    def resume(self, _: Empty) -> str:
        self._active_state().inbox.append(events.Resume())
        return "resuming"

    @resume.validator
    def _check_resume(self, _: Empty) -> None:
        s = self._active_state()
        if s.phase != Phase.PAUSED and not any(isinstance(e, events.Pause) for e in s.inbox):
            raise ValueError("not paused")
        if error := budget_hooks.resume_error(s, self._now()):
            raise ValueError(error)

    @workflow.update(name="set_budget")
    def set_budget(self, req: SetBudget) -> str:
        return budget_hooks.set_cap(self._active_state(), req.usd, self._now())

    @set_budget.validator
    def _check_set_budget(self, req: SetBudget) -> None:
        if error := budget.set_error(req.usd):
            raise ValueError(error)

    @workflow.query(name="status")
    def status(self) -> JobStatus:
        return self._active_state().status(self._now())

    @workflow.query(name="timeline")
    def timeline(self) -> list[TimelineEntry]:
        """The whole timeline kept (the last 400 events; `status` has the last 20)."""
        return self._active_state().timeline

    def result(self) -> JobResult:
        return self._active_state().result(self._now())

    def _active_state(self) -> JobState:
        if self.s is None:
            raise ValueError(self.invalid or "job not started")
        return self.s

    def _now(self) -> datetime:
        return workflow.now()


def _update_id() -> str:
    """The running update's id. Temporal answers a repeated id with the first outcome only
    within one run, so the scale updates also keep their answers in JobState (carried by
    continue-as-new): the operator repeats them under the same id after a crash."""
    info = workflow.current_update_info()
    assert info is not None, "called outside an update"
    return info.id
