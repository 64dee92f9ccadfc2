"""The deadline policy, as pure functions: run on spot while an on-demand finish by the
deadline is still safely possible, move to on-demand when it no longer is, and back to spot
once the slack has returned (the greedy policy of "Can't Be Late", NSDI 2024, with hysteresis).

Slack is the time left to the deadline minus what an all-on-demand finish from here would
take: the steps left at the rate measured at `max_nodes` (or extrapolated from the largest
world size measured, or the spec's expected rate), plus the switch itself and one capacity
check interval (the policy looks again only then). The job keeps `margin_s` of slack in hand.
No I/O, no clocks (the caller passes `now`), no mutation of what is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from pydantic import BaseModel, Field

from spotrain.workflows.spec import DeadlinePolicy

Mode = Literal["spot", "on-demand"]
SAMPLES_KEPT = 200


class Rate(BaseModel):
    """Steps done over seconds spent training at one size (start-up excluded)."""

    steps: float = 0.0
    seconds: float = 0.0

    @property
    def per_hour(self) -> float | None:
        return 3600 * self.steps / self.seconds if self.seconds > 0 else None


class Sample(BaseModel):
    """The slack at one check (None: no rate known yet) and the mode the job was in."""

    time: datetime
    slack_s: float | None
    mode: Mode


class Switch(BaseModel):
    time: datetime
    to: Mode
    reason: str


class DeadlineState(BaseModel):
    """The policy's memory: the deadline, the mode, the rates measured, what it saw."""

    due: datetime
    mode: Mode = "spot"
    rates: dict[int, Rate] = Field(default_factory=dict, description="nodes -> rate")
    seen: tuple[int, int, datetime] | None = Field(
        None, description="(generation, step, time) of the last progress report"
    )
    samples: list[Sample] = Field(default_factory=list, description="slack at each check")
    switches: list[Switch] = Field(default_factory=list)


def start(policy: DeadlinePolicy, submitted_at: datetime) -> DeadlineState:
    due = policy.at or submitted_at + timedelta(seconds=policy.max_duration_s or 0)
    return DeadlineState(due=due)


def observe(
    d: DeadlineState, generation: int, size: int, step: int, start_step: int, now: datetime
) -> DeadlineState:
    """Book a progress report of a generation of `size` nodes that resumed at `start_step`:
    the interval since the previous report counts toward that size's rate once the previous
    report already showed training (so start-up time is never counted as a slow rate)."""
    rates = dict(d.rates)
    seen = d.seen
    if seen is not None and seen[0] == generation and seen[1] > start_step and now > seen[2]:
        r = rates.get(size, Rate())
        rates[size] = Rate(
            steps=r.steps + max(0, step - seen[1]),
            seconds=r.seconds + (now - seen[2]).total_seconds(),
        )
    return d.model_copy(update={"rates": rates, "seen": (generation, step, now)})


def rate_at(rates: dict[int, Rate], world: int, expected: float | None) -> float | None:
    """Steps/hour at `world`: measured there, else scaled linearly from the largest world
    measured, else `expected` (the spec's hint); None when nothing is known."""
    measured = {w: r.per_hour for w, r in rates.items() if r.per_hour is not None}
    if world in measured:
        return measured[world]
    if measured:
        largest = max(measured)
        return measured[largest] * world / largest
    return expected


@dataclass(frozen=True)
class Decision:
    mode: Mode
    slack_s: float | None
    reason: str  # why the mode changed ("" when it did not)


def slack_s(
    now: datetime,
    due: datetime,
    remaining_steps: int,
    rate: float,
    policy: DeadlinePolicy,
    check_s: float,
) -> float:
    """Seconds to spare if the job moved to on-demand now (negative: it would be late)."""
    need = policy.switch_s + check_s + 3600 * max(0, remaining_steps) / rate
    return (due - now).total_seconds() - need


def decide(
    mode: Mode,
    now: datetime,
    due: datetime,
    remaining_steps: int,
    rate: float | None,
    policy: DeadlinePolicy,
    check_s: float,
) -> Decision:
    """Spot while the slack stays at or above the margin; on-demand below it; back to spot
    only with `hysteresis_s` more than the margin (so a noisy rate does not flap)."""
    if rate is None or rate <= 0:
        return Decision(mode, None, "")
    slack = slack_s(now, due, remaining_steps, rate, policy, check_s)
    finish = f"an on-demand finish needs {(due - now).total_seconds() - slack:.0f} s"
    if mode == "spot" and slack < policy.margin_s:
        why = f"slack {slack:.0f} s < margin {policy.margin_s:.0f} s ({finish})"
        return Decision("on-demand", slack, why)
    if mode == "on-demand" and slack > policy.margin_s + policy.hysteresis_s:
        why = (
            f"slack {slack:.0f} s > margin {policy.margin_s:.0f} s + hysteresis "
            f"{policy.hysteresis_s:.0f} s ({finish})"
        )
        return Decision("spot", slack, why)
    return Decision(mode, slack, "")


def apply(d: DeadlineState, decision: Decision, now: datetime) -> DeadlineState:
    """The state after a check: its slack sample, and the switch if the mode changed."""
    samples = [
        *d.samples[-(SAMPLES_KEPT - 1) :],
        Sample(time=now, slack_s=decision.slack_s, mode=d.mode),
    ]
    switches = d.switches
    if decision.mode != d.mode:
        switches = [*switches, Switch(time=now, to=decision.mode, reason=decision.reason)]
    return d.model_copy(update={"mode": decision.mode, "samples": samples, "switches": switches})


def on_demand(d: DeadlineState | None) -> bool:
    """The policy has moved the job to on-demand: new nodes are bought on-demand."""
    return d is not None and d.mode == "on-demand"


def describe(d: DeadlineState) -> str:
    """One paragraph for `spotrain status` and `report`: the deadline, the mode, the slack
    now and over the checks kept, and each switch with its reason."""
    slacks = [x.slack_s for x in d.samples if x.slack_s is not None]
    text = f"deadline {d.due:%Y-%m-%d %H:%M:%S %Z}: on {d.mode}"
    if slacks:
        text += (
            f", slack now {slacks[-1]:.0f} s (over {len(slacks)} checks: min "
            f"{min(slacks):.0f} s, max {max(slacks):.0f} s)"
        )
    else:
        text += ", no progress rate measured yet"
    return "\n".join([text] + [f"  {s.time:%H:%M:%S} to {s.to}: {s.reason}" for s in d.switches])
