"""Where the TrainingJob workflow meets its deadline policy (`deadline`): booking progress
reports and, at each capacity check, the policy's decision. Call from workflow code only; the
check itself is guarded by `workflow.patched("deadline-policy")` at its call site."""

from __future__ import annotations

from datetime import datetime

from spotrain.workflows.job.state import JobState
from spotrain.workflows.policies import deadline


def observe(s: JobState, now: datetime) -> None:
    """A progress report: count it toward the rate at the running size (in nodes)."""
    if s.spec.deadline is None or not s.running:
        return
    d = s.deadline or deadline.start(s.spec.deadline, s.submitted_at or now)
    s.deadline = deadline.observe(
        d, s.generation, len(s.members), s.step, s.generation_checkpoint, now
    )


def check(s: JobState, now: datetime) -> None:
    """Decide spot or on-demand from the slack; a switch goes on the timeline with its
    reason, and a move to on-demand asks for every node the job may hold (bought on-demand:
    `orders.spot_orders`; spot comes back through the capacity check's swap)."""
    policy = s.spec.deadline
    if policy is None:
        return
    d = s.deadline or deadline.start(policy, s.submitted_at or now)
    e = s.spec.elastic
    decision = deadline.decide(
        d.mode,
        now,
        d.due,
        s.spec.total_steps - s.step,
        deadline.rate_at(d.rates, e.max_nodes, policy.steps_per_hour),
        policy,
        e.capacity_check_interval_s,
    )
    s.deadline = deadline.apply(d, decision, now)
    if decision.mode != d.mode:
        s.record(now, f"deadline: to {decision.mode}", decision.reason)
        if decision.mode == "on-demand":
            s.target = s.ceiling
