"""A job's total-spend cap, as pure functions: under it the job runs; at 80% it warns once;
at the cap it pauses (checkpoint, every node released) and will not resume until the cap is
raised. Spend is what the job's accounts say (`JobState.costs`: node-hours times each node's
price), so the cap and `status`'s cost so far always agree.
No I/O, no clocks (the caller passes `now`), no mutation of what is given.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field

WARN_FRACTION = 0.8
SOONEST = timedelta(milliseconds=1)
LONGEST_WAIT_H = 24.0  # a cap further away is looked at again then (and at every turn)

Verdict = Literal["under", "warn", "reached"]


class BudgetState(BaseModel):
    """The cap (the spec's `budget_usd`, or as set since) and whether its warning was given."""

    cap_usd: float = Field(gt=0)
    warned: bool = Field(False, description="the 80% warning is on the timeline")


def verdict(b: BudgetState, spent: float) -> Verdict:
    """`reached` at or past the cap; `warn` past 80% of it the first time; else `under`."""
    if spent >= b.cap_usd:
        return "reached"
    if spent >= WARN_FRACTION * b.cap_usd and not b.warned:
        return "warn"
    return "under"


def reached_at(b: BudgetState, spent: float, usd_per_hour: float, now: datetime) -> datetime | None:
    """When the spend reaches the cap at this rate, or in a day if later (None: nothing is
    billed, it never does). Never `now` itself: a cap already reached pauses the job before
    this is asked, and a wake due at once (the spend a float's rounding short of the cap)
    would spin the loop."""
    if usd_per_hour <= 0:
        return None
    hours = max(0.0, b.cap_usd - spent) / usd_per_hour
    return now + max(timedelta(hours=min(hours, LONGEST_WAIT_H)), SOONEST)


def spent_of(b: BudgetState, spent: float) -> str:
    """`$1.23 of $2.00`: how the timeline, `status` and refusals say it."""
    return f"${spent:,.2f} of ${b.cap_usd:,.2f}"


def resume_error(b: BudgetState | None, spent: float, job: str) -> str | None:
    """Why a resume is refused: the budget is spent (raising it is the way on)."""
    if b is None or spent < b.cap_usd:
        return None
    return (
        f"budget spent: {spent_of(b, spent)}; raise it first "
        f"(`spotrain budget {job} --usd N`, the `set_budget` update)"
    )


def set_error(usd: float) -> str | None:
    """Why a new cap is refused: it must be a positive, finite number of USD."""
    if not 0 < usd < float("inf"):
        return f"budget must be a positive number of USD, got {usd}"
    return None
