"""Where the TrainingJob workflow meets its budget (`budget`): the check at each turn of the
main loop, the timer that wakes a running job when the spend will reach the cap, the resume
refusal and a new cap. Call from workflow code only: a job with a cap asks
`workflow.patched("job-budget")` (one from before budgets never does, so replays unchanged)."""

from __future__ import annotations

from datetime import datetime

from temporalio import workflow

from spotrain.workflows.job.state import JobState, NodeState, Phase
from spotrain.workflows.policies import budget


def active(s: JobState) -> bool:
    """The job has a cap (the patch is asked, and so recorded, only then)."""
    return s.budget is not None and workflow.patched("job-budget")


def spent(s: JobState, now: datetime) -> float:
    """USD spent so far: the job's own accounts, as `status` shows them."""
    return s.spend(now)


def check(s: JobState, now: datetime) -> str | None:
    """The reason to pause (`budget reached: $X of $Y`) once the spend reaches the cap; the
    80% warning goes on the timeline once per cap. None: no budget, paused, or under it."""
    b = s.budget
    if b is None or s.phase == Phase.PAUSED or not active(s):
        return None
    usd = spent(s, now)
    match budget.verdict(b, usd):
        case "reached":
            return f"budget reached: {budget.spent_of(b, usd)}"
        case "warn":
            s.budget = b.model_copy(update={"warned": True})
            s.record(now, "budget 80% spent", budget.spent_of(b, usd))
    return None


def wake(s: JobState, now: datetime) -> datetime | None:
    """When the spend reaches the cap at the rate of the nodes billed now."""
    if s.budget is None or not active(s):
        return None
    rate = sum(n.price for n in s.nodes if n.state == NodeState.READY and n.ready_at)
    return budget.reached_at(s.budget, spent(s, now), rate, now)


def resume_error(s: JobState, now: datetime) -> str | None:
    return budget.resume_error(s.budget, spent(s, now), s.spec.name)


def set_cap(s: JobState, usd: float, now: datetime) -> str:
    """A new cap (its warning given afresh); the answer says where the spend stands."""
    s.budget = budget.BudgetState(cap_usd=usd)
    said = budget.spent_of(s.budget, spent(s, now))
    s.record(now, "budget set", said)
    return f"budget set: {said}"
