"""make-before-break's rule for rebalance recommendations
(`workflows/policies/warning_rule.py`): act only when the expected gain beats the surge cost.
Exact figures for plain cases, hypothesis properties for every input, its inputs read from the
spec and state, and one run on the time-skipping server: a warning the rule declines orders
nothing, one it accepts swaps."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from temporalio.testing import WorkflowEnvironment

from spotrain.workflows.job.checkpoints import CheckpointStats
from spotrain.workflows.job.state import JobState
from spotrain.workflows.policies.warning_rule import Case, case_for, weigh, worth_acting
from spotrain.workflows.spec import SpecError, parse_spec
from tests.jobs import job_spec, simulated, skip
from tests.workflows.test_make_before_break import MBB, SURGE, events, ranked, warn
from tests.workflows.test_planner_job import node, running

HOUR = 3600


def case(p: float, pause_s: float, notice_swaps: bool = False, members: float = 4.0) -> Case:
    """Four $1/h members, a $0.97/h replacement booting 60 s."""
    return Case(p, members, 0.97, pause_s, 60.0, notice_swaps)


def test_restart_mode_with_reliable_warnings_acts_live_mode_does_not() -> None:
    # restart: gain 0.9 x 4 x 120 s = $0.12 against 0.1 x (0.97 x 60 s + 4 x 120 s) = $0.0150
    restart = weigh(case(0.9, 120))
    assert restart.act
    assert restart.gain_usd == pytest.approx(0.12)
    assert restart.cost_usd == pytest.approx(0.1 * (0.97 * 60 + 480) / HOUR)
    # live: a resize costs 4 node-seconds, the replacement's boot 58: $0.0010 < $0.0017
    live = weigh(case(0.9, 1.0))
    assert not live.act
    assert live.gain_usd == pytest.approx(0.9 * 4 / HOUR)
    assert live.cost_usd == pytest.approx(0.1 * (0.97 * 60 + 4) / HOUR)
    assert live.describe() == "expected gain $0.0010 <= surge cost $0.0017"


def test_the_published_sample_never_acts_and_a_notice_that_swaps_leaves_nothing_to_gain() -> None:
    assert not weigh(case(0.5, 120)).act  # 15 of 30: gain $0.067, cost $0.075
    assert weigh(case(0.5, 120)).gain_usd == pytest.approx(0.5 * 480 / HOUR)
    assert not weigh(case(1.0, 120, notice_swaps=True)).act  # the notice's swap does it later
    assert weigh(case(1.0, 120, notice_swaps=True)).gain_usd == 0


cases = st.builds(
    Case,
    p=st.floats(0, 1),
    members_price_h=st.floats(0.01, 10_000),
    surge_price_h=st.floats(0.01, 10_000),
    pause_s=st.floats(0, 3600),
    boot_s=st.floats(0, 3600),
    notice_swaps=st.booleans(),
)


@given(cases)
def test_acts_exactly_above_the_break_even_probability(c: Case) -> None:
    """Act iff p > (boot + pause) / (boot + 2 pause) in dollars, when the notice would shrink
    (at least one half: a warning right half the time or less is never worth a replacement);
    never when the notice would swap in time."""
    pause = c.members_price_h * c.pause_s / HOUR
    boot = c.surge_price_h * c.boot_s / HOUR
    verdict = weigh(c)
    if c.notice_swaps or pause == 0:
        assert not verdict.act
        return
    even = (boot + pause) / (boot + 2 * pause)
    assert even >= 0.5
    if abs(c.p - even) > 1e-9:
        assert verdict.act == (c.p > even)


@given(cases, st.floats(0, 1))
def test_more_likely_reclaims_never_turn_acting_into_declining(c: Case, q: float) -> None:
    lo, hi = sorted((c.p, q))
    if weigh(replace(c, p=lo)).act:
        assert weigh(replace(c, p=hi)).act


def state(**elastic: Any) -> JobState:
    s = JobState.new(parse_spec(job_spec(elastic=MBB | SURGE | elastic)))
    s.nodes = [node(i) for i in range(4)]
    s.target = 4
    return running(s, [0, 1, 2, 3])


def test_inputs_come_from_the_spec_prices_and_the_prior() -> None:
    s = state(warning_reclaim_probability=0.8)
    c = case_for(s, s.nodes[1])
    # members at $1/h each (their billed price), the spec's spot price for the replacement
    assert (c.p, c.members_price_h, c.surge_price_h) == (0.8, 4.0, 0.97)
    assert (c.pause_s, c.boot_s) == (120.0, 60.0)  # restart mode's prior, the boot's
    # No checkpoint observed yet: the notice's swap must fit 60 s of checkpoint, 5 s of margin
    # and a 60 s boot in 120 s: it does not, so the notice would shrink.
    assert not c.notice_swaps
    s.checkpoints = CheckpointStats(count=3, p99_s=11.2)
    assert case_for(s, s.nodes[1]).notice_swaps
    assert not case_for(state(reclaim_notice="shrink"), s.nodes[1]).notice_swaps
    assert case_for(state(resize="live"), s.nodes[1]).pause_s == 1.0
    s.spec.spot.instance_types[0].spot_price = None
    s.spot_prices = {"p3.2xlarge@us-east-1a": 0.5}  # the market's, as the node is billed
    assert case_for(s, s.nodes[1]).surge_price_h == 0.5


def test_always_acts_and_the_probability_is_bounded() -> None:
    s = state(warning_rule="always")
    verdict = worth_acting(s, s.nodes[0])
    assert verdict.act and verdict.gain_usd < verdict.cost_usd
    assert not worth_acting(state(), s.nodes[0]).act
    with pytest.raises(SpecError, match="warning_reclaim_probability"):
        parse_spec(job_spec(elastic={"warning_reclaim_probability": 1.5}))


@pytest.mark.parametrize(
    ("elastic", "acts"),
    [
        ({}, False),  # the published prior: 15 of 30
        ({"warning_reclaim_probability": 0.9, "reclaim_notice": "shrink"}, True),
    ],
)
async def test_a_warning_gets_a_replacement_only_when_the_rule_says_so(
    ts_env: WorkflowEnvironment, elastic: dict[str, Any], acts: bool
) -> None:
    async with simulated(ts_env.client) as sim:
        handle = await sim.start(job_spec(elastic=MBB | SURGE | elastic))
        await skip(ts_env, timedelta(minutes=20))
        victim = ranked(await sim.status(handle))[1]
        await warn(ts_env, handle, victim, "rebalance", None)
        await skip(ts_env, timedelta(minutes=5))
        status = await sim.status(handle)
        await handle.cancel()
    declined = events(status, "rebalance recommendation not worth a replacement")
    if acts:
        assert declined == [] and (status.swapped, status.resizes) == (1, 1)
        assert len(sim.cloud.launches) == 5 and victim not in ranked(status)
    else:
        # 4 members at $0.97/h, restart mode: a resize $0.129, the boot $0.016; the notice
        # would shrink (60 s grace, no checkpoint measured): gain 0.5 x 0.129 < 0.5 x 0.145
        assert declined == [f"{victim}: expected gain $0.0647 <= surge cost $0.0727"]
        assert (status.swapped, status.resizes) == (0, 0)
        assert len(sim.cloud.launches) == 4 and victim in ranked(status)
