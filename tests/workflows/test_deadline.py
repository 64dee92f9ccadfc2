"""The deadline policy: its pure decisions property-tested (never spot when an on-demand
finish would miss the deadline with the margin; monotone in slack; no flapping), the spec's
refusals, and the real workflow switching to on-demand in time on the time-skipping server."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.cli.report import Report
from spotrain.workflows.contract import Offer
from spotrain.workflows.job import job_planner, orders
from spotrain.workflows.job.state import JobState, NodeRecord, NodeState
from spotrain.workflows.policies import deadline, deadline_hooks
from spotrain.workflows.spec import DeadlinePolicy, SpecError, parse_spec
from tests.jobs import job_spec, record_history, simulated, skip

T0 = datetime(2026, 1, 1, tzinfo=UTC)
policies = st.builds(
    DeadlinePolicy,
    max_duration_s=st.just(3600.0),
    margin_s=st.floats(0, 7200),
    hysteresis_s=st.floats(0, 7200),
    switch_s=st.floats(0, 3600),
)
modes = st.sampled_from(["spot", "on-demand"])
hours = st.floats(0, 200)
steps = st.integers(0, 10**7)
rates = st.floats(1, 10**6)


def decide(
    mode: Any, left_h: float, remaining: int, rate: float, p: DeadlinePolicy, check_s: float = 300
):
    return deadline.decide(mode, T0, T0 + timedelta(hours=left_h), remaining, rate, p, check_s)


@given(modes, st.floats(-20_000, 20_000), steps, rates, policies)
def test_never_spot_when_an_on_demand_finish_would_miss(mode, spare_s, remaining, rate, p) -> None:
    """`spare_s`: time left beyond what an on-demand finish needs (near the margin often)."""
    on_demand_finish_s = p.switch_s + 300 + 3600 * remaining / rate
    left_h = max(0.0, on_demand_finish_s + spare_s) / 3600
    d = decide(mode, left_h, remaining, rate, p)
    if d.mode == "spot":
        assert on_demand_finish_s + p.margin_s <= left_h * 3600 + 1e-6
    if on_demand_finish_s + p.margin_s > left_h * 3600 + 1e-6:  # too late for spot
        assert d.mode == "on-demand" and (d.reason or mode == "on-demand")


@given(modes, hours, hours, steps, rates, policies)
def test_monotone_in_slack(mode, a_h, b_h, remaining, rate, p) -> None:
    """More time left never moves the job from spot to on-demand."""
    tight, loose = (
        decide(mode, min(a_h, b_h), remaining, rate, p),
        decide(mode, max(a_h, b_h), remaining, rate, p),
    )
    assert tight.slack_s is not None and loose.slack_s is not None
    assert tight.slack_s <= loose.slack_s
    if tight.mode == "spot":
        assert loose.mode == "spot"


@given(modes, hours, steps, rates, policies)
def test_no_flapping_within_one_check(mode, left_h, remaining, rate, p) -> None:
    """Deciding again at once, from the mode just chosen, keeps it (hysteresis)."""
    first = decide(mode, left_h, remaining, rate, p)
    again = decide(first.mode, left_h, remaining, rate, p)
    assert again.mode == first.mode and again.reason == ""


def test_back_to_spot_only_past_the_hysteresis() -> None:
    p = DeadlinePolicy(max_duration_s=1, margin_s=600, hysteresis_s=3600, switch_s=0)
    rate = 3600.0  # steps/h: remaining steps = seconds needed
    assert decide("on-demand", 2, 3600, rate, p, check_s=0).mode == "on-demand"  # slack 1 h
    back = decide("on-demand", 2.2, 3600, rate, p, check_s=0)  # slack 1.2 h > 10 min + 1 h
    assert back.mode == "spot" and "hysteresis" in back.reason
    assert decide("spot", 1.2, 3600, rate, p, check_s=0).mode == "spot"  # the same slack


@given(st.lists(st.tuples(st.integers(1, 16), st.integers(1, 500), st.floats(1, 600)), max_size=30))
def test_rates_measured_per_size_and_scaled(reports) -> None:
    """Each size's rate is its steps over its seconds, counted from a generation's first
    report that shows training (start-up never counts); a size not measured is scaled
    linearly from the largest measured."""
    d, now, step, expected = deadline.DeadlineState(due=T0), T0, 0, {}
    for generation, (size, done, seconds) in enumerate(reports):
        start = step
        d = deadline.observe(d, generation, size, step, start, now)  # started: not counted
        now, step = now + timedelta(seconds=seconds), step + 1
        d = deadline.observe(d, generation, size, step, start, now)  # start-up: not counted
        now, step = now + timedelta(seconds=seconds), step + done
        d = deadline.observe(d, generation, size, step, start, now)
        s, t = expected.get(size, (0, 0.0))
        expected[size] = (s + done, t + seconds)
    for size, (s, t) in expected.items():
        assert deadline.rate_at(d.rates, size, None) == pytest.approx(3600 * s / t)
    if expected:
        top = max(expected)
        scaled = deadline.rate_at(d.rates, 2 * top, None)
        assert scaled == pytest.approx(7200 * expected[top][0] / expected[top][1])
    else:
        assert deadline.rate_at(d.rates, 4, 123.0) == 123.0


@pytest.mark.parametrize(
    ("deadline_spec", "message"),
    [
        ({}, "give exactly one of at (a time) or max_duration_s"),
        ({"at": "2026-11-24T10:00:00Z", "max_duration_s": 60}, "exactly one of"),
        ({"at": "2026-11-24T10:00:00"}, "needs a time zone"),
        ({"max_duration_s": 0}, "deadline.max_duration_s: Input should be greater than 0"),
        ({"max_duration_s": 60, "margin": 5}, "deadline.margin: Extra inputs are not permitted"),
    ],
)
def test_spec_refuses_bad_deadlines(deadline_spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(job_spec(deadline=deadline_spec))
    assert message in str(err.value)


async def test_job_moves_to_on_demand_when_spot_cannot_make_the_deadline(
    ts_env: WorkflowEnvironment,
) -> None:
    """4 spot nodes for an hour, then none: the job waits on spot while its slack lasts, then
    buys on-demand and finishes by the deadline (2.5 h of work at 4 nodes, due in 4 h)."""
    t0 = await ts_env.get_current_time()
    spot_until = t0 + timedelta(hours=1)
    cloud = SimulatedCloud(
        zones=["us-east-1a"], capacity=lambda _t, _z, when: 4 if when < spot_until else 0
    )
    async with simulated(ts_env.client, cloud=cloud) as sim:
        spec = job_spec(
            spot={"zones": ["us-east-1a"]},
            on_demand={"fallback": False},
            deadline={"max_duration_s": 4 * 3600, "margin_s": 600, "switch_s": 300},
        )
        handle = await sim.start(spec)
        await skip(ts_env, 3600)
        for node in cloud.running(spec["name"]):
            cloud.reclaim(node.node_id)
            await handle.signal("node_lost", {"node_id": node.node_id, "event_id": node.node_id})
        result = await handle.result()
        closed = (await handle.describe()).close_time
        await record_history(handle, "deadline_switch")
    assert closed is not None and closed - t0 <= timedelta(hours=4)  # the deadline held
    assert result.steps_done == 36_000
    (switch,) = result.deadline.switches
    assert switch.to == "on-demand" and "< margin 600 s" in switch.reason
    assert spot_until < switch.time  # it waited on spot while the slack lasted
    waiting = [x.slack_s for x in result.deadline.samples if spot_until < x.time <= switch.time]
    assert len(waiting) > 10 and waiting == sorted(waiting, reverse=True)  # slack ran down
    assert [e.detail for e in result.timeline if e.event == "deadline: to on-demand"] == [
        switch.reason
    ]
    assert result.node_hours["on-demand"] > 4 * 1.4  # the rest of the work on 4 nodes
    assert result.node_hours["spot"] == pytest.approx(4.0, abs=0.1)
    shown = Report.from_result(result).model_dump_json()  # `spotrain report` renders this
    assert deadline.describe(result.deadline).endswith(f"to on-demand: {switch.reason}")
    assert switch.reason in shown and "slack_s" in shown


def test_on_demand_mode_buys_on_demand_and_keeps_it() -> None:
    """In on-demand mode the job planner orders on-demand although spot is offered and the
    spec has no fallback, looks for no spot at capacity checks, and releases no on-demand
    node as "back to spot"; in spot mode all three behave as before."""
    s = JobState.new(parse_spec(job_spec(on_demand={"fallback": False})))
    s.deadline = deadline.DeadlineState(due=T0, mode="on-demand")
    offered = [Offer(instance_type="p3.2xlarge", zone="us-east-1a", price=0.9)]
    plan = orders.spot_orders(s, offered, 2, Counter(), spot_only=False)
    assert [(o.lifecycle, o.fallback) for o in plan.orders] == [("on-demand", True)] * 2
    assert job_planner.capacity_check(s, launching=False) == job_planner.CapacityCheck(False, 0)
    s.members, s.running = [0], True
    s.nodes = [
        NodeRecord(
            slot=i,
            lifecycle=lc,
            instance_type="p3.2xlarge",
            fallback=lc == "on-demand",
            state=NodeState.READY,
            price=1.0,
            on_demand_price=3.06,
        )
        for i, lc in enumerate(["spot", "on-demand"])
    ]
    assert job_planner.swap_back(s) == ([], s.target)
    s.deadline = s.deadline.model_copy(update={"mode": "spot"})
    assert [n.slot for n in job_planner.swap_back(s)[0]] == [1]
    assert (
        orders.spot_orders(s, offered, 1, Counter(), spot_only=False).orders[0].lifecycle == "spot"
    )


def test_a_move_to_on_demand_asks_for_every_node_the_job_may_hold() -> None:
    """Short of spot (2 of its 4 nodes), the job moves to on-demand and its target is the
    ceiling again: the rest of the work on as many nodes as it may hold."""
    spec = job_spec(deadline={"max_duration_s": 3600, "steps_per_hour": 36_000 / 2})
    s = JobState.new(parse_spec(spec))
    s.submitted_at, s.target = T0, 2
    deadline_hooks.check(s, T0)
    assert s.deadline is not None and s.deadline.mode == "on-demand"
    assert s.target == s.ceiling == 4
