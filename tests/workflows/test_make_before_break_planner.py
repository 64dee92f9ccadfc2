"""Make-before-break's decisions without a server: plain examples of each rule, and hypothesis
properties for the ones that must hold for every input (never above max_nodes plus the surge
nor a pool's grant; a swap only onto a ready replacement, in time; a late notice shrinks)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spotrain.workflows.contract import Offer, PoolGrant
from spotrain.workflows.job import events, orders
from spotrain.workflows.job.checkpoints import CheckpointStats
from spotrain.workflows.job.planner import grace_for_notice
from spotrain.workflows.job.state import JobState, NodeState, Swap
from spotrain.workflows.policies import make_before_break
from spotrain.workflows.spec import SpecError, parse_spec
from tests.jobs import job_spec
from tests.workflows.test_planner_job import T0, node, running

MBB = {"early_warning": "make_before_break", "reclaim_notice": "make_before_break"}


def state(members: int = 4, **elastic: Any) -> JobState:
    """A job running on `members` ready nodes i-0.. (max_nodes 4 unless given)."""
    s = JobState.new(parse_spec(job_spec(elastic=MBB | elastic)))
    s.nodes = [node(i) for i in range(members)]
    s.target = members
    return running(s, list(range(members)))


def warning(node_id: str) -> events.Reclaim:
    return events.Reclaim(kind="rebalance", node_id=node_id)


def notice(node_id: str, seconds: float) -> events.Reclaim:
    return events.Reclaim(node_id=node_id, deadline=T0 + timedelta(seconds=seconds))


# --- the spec ----------------------------------------------------------------------------------


def test_early_warning_defaults_keep_act_on_rebalance_and_conflicts_are_clear_errors() -> None:
    plain = parse_spec(job_spec())
    assert plain.elastic.warning_policy == "ignore" and plain.elastic.reclaim_notice == "shrink"
    old = parse_spec(job_spec(elastic={"act_on_rebalance": True}))
    assert old.elastic.warning_policy == "shrink"
    with pytest.raises(SpecError, match="act_on_rebalance means early_warning: shrink"):
        parse_spec(job_spec(elastic={"act_on_rebalance": True, "early_warning": "ignore"}))
    with pytest.raises(SpecError, match="needs reclaim_policy: replace"):
        parse_spec(
            job_spec(elastic={"reclaim_policy": "drop", "reclaim_notice": "make_before_break"})
        )
    with pytest.raises(SpecError, match=r"elastic\.early_warning"):
        parse_spec(job_spec(elastic={"early_warning": "swap"}))
    with pytest.raises(SpecError, match=r"elastic\.max_surge_nodes"):
        parse_spec(job_spec(elastic={"max_surge_nodes": -1}))


# --- a warning or notice -----------------------------------------------------------------------


def test_a_warning_orders_one_replacement_ahead_within_the_surge() -> None:
    s = state(max_surge_nodes=1)
    plan = make_before_break.on_notice(s, warning("i-1"), T0)
    assert plan.action == "order" and [w.node_id for w in plan.swaps] == ["i-1"]
    assert plan.swaps[0].deadline is None
    s.swaps = plan.swaps
    assert orders.shortfall(s) == 1  # the replacement, on top of the 4 held
    assert make_before_break.on_notice(s, warning("i-1"), T0).action == "known"
    # a second warned node has no room left: 5 held is max_nodes 4 + 1
    s.nodes.append(node(4, state=NodeState.REQUESTED))
    assert orders.shortfall(s) == 0
    plan = make_before_break.on_notice(s, warning("i-2"), T0)
    assert plan.action == "no room" and [w.node_id for w in plan.swaps] == ["i-1", "i-2"]
    s.swaps = plan.swaps
    assert orders.shortfall(s) == 0  # ordered once the first swap makes room
    s.nodes[1].state = NodeState.RELEASED  # i-1 swapped out for i-4
    s.members = [0, 4, 2, 3]
    assert orders.shortfall(s) == 1


def test_no_room_at_max_nodes_without_surge_but_room_below_it() -> None:
    assert make_before_break.on_notice(state(), warning("i-0"), T0).action == "no room"
    assert make_before_break.on_notice(state(), notice("i-0", 120), T0).action == "pass"
    assert make_before_break.on_notice(state(members=3), warning("i-0"), T0).action == "order"


def test_a_pools_grant_caps_the_overlap() -> None:
    s = state(max_surge_nodes=2)
    s.spec.pool = parse_spec(job_spec(pool={"name": "team"})).pool
    s.grant = PoolGrant(seq=1, nodes=4, on_demand=0)
    assert make_before_break.on_notice(s, warning("i-0"), T0).action == "no room"
    s.grant = PoolGrant(seq=2, nodes=5, on_demand=0)
    assert make_before_break.on_notice(s, warning("i-0"), T0).action == "order"


def test_policies_pass_to_the_usual_reclaim_path() -> None:
    off = state(max_surge_nodes=1, early_warning="ignore", reclaim_notice="shrink")
    assert make_before_break.on_notice(off, warning("i-0"), T0).action == "pass"
    assert make_before_break.on_notice(off, notice("i-0", 120), T0).action == "pass"
    s = state(max_surge_nodes=1)
    assert make_before_break.on_notice(s, warning("i-9"), T0).action == "pass"  # unknown
    s.nodes.append(node(4))  # ready, not a member
    assert make_before_break.on_notice(s, warning("i-4"), T0).action == "pass"
    assert make_before_break.on_notice(s, events.Reclaim(node_id="i-0"), T0).action == "pass"


def test_a_notice_waits_for_its_replacement_only_until_deadline_minus_checkpoint_p99() -> None:
    s = state(max_surge_nodes=1, graceful_shutdown_timeout_s=60)
    # without observed checkpoints, the graceful timeout stands in for the checkpoint time
    assert make_before_break.swap_by(s, T0 + timedelta(seconds=120)) == T0 + timedelta(seconds=55)
    assert make_before_break.on_notice(s, notice("i-1", 120), T0).action == "order"
    assert make_before_break.on_notice(s, notice("i-1", 60), T0).action == "pass"  # too late
    s.checkpoints = CheckpointStats(count=3, p50_s=4.0, p99_s=10.0)
    assert make_before_break.on_notice(s, notice("i-1", 60), T0).action == "order"
    plan = make_before_break.on_notice(s, notice("i-1", 120), T0)
    s.swaps = plan.swaps
    step = make_before_break.next_step(s, T0)
    assert (step.pairs, step.late, step.wake) == ([], [], T0 + timedelta(seconds=105))
    late = make_before_break.next_step(s, T0 + timedelta(seconds=105))
    assert [w.node_id for w in late.late] == ["i-1"] and late.swaps == []
    # ... whereas a ready replacement swaps at once, checkpointing within the notice
    s.nodes.append(node(4))
    step = make_before_break.next_step(s, T0 + timedelta(seconds=100))
    assert [(a.node_id, b.node_id) for a, b in step.pairs] == [("i-1", "i-4")]
    assert step.grace == 15  # 20 s left, less the margin


def test_a_notice_moves_onto_an_open_warning_and_a_late_one_drops_it() -> None:
    s = state(max_surge_nodes=1)
    s.swaps = make_before_break.on_notice(s, warning("i-2"), T0).swaps
    plan = make_before_break.on_notice(s, notice("i-2", 120), T0)
    assert plan.action == "deadline" and plan.swaps[0].deadline == T0 + timedelta(seconds=120)
    assert plan.swaps[0].since == T0
    gone = make_before_break.on_notice(s, notice("i-2", 3), T0)
    assert gone.action == "pass" and gone.swaps == []


def test_a_warning_swaps_spot_spares_first_and_only_while_running() -> None:
    s = state(members=3, max_surge_nodes=1)
    s.swaps = [Swap(node_id="i-0", since=T0)]
    s.nodes += [node(3, "on-demand"), node(4), node(5, state=NodeState.REQUESTED)]
    step = make_before_break.next_step(s, T0)
    assert [(a.slot, b.slot) for a, b in step.pairs] == [(0, 4)]
    assert step.grace == s.spec.elastic.graceful_shutdown_timeout_s
    s.running = False
    assert make_before_break.next_step(s, T0).pairs == []


def test_replacements_avoid_the_warned_nodes_pool_while_another_has_spot() -> None:
    s = state(max_surge_nodes=1)  # every node in us-east-1a
    offers = [Offer(instance_type="p3.2xlarge", zone=z, price=0.9) for z in ("us-east-1a", "b")]
    assert make_before_break.away_from_warned(s, offers) == offers  # no swap open
    s.swaps = [Swap(node_id="i-0", since=T0)]
    assert make_before_break.away_from_warned(s, offers) == offers[1:]
    assert make_before_break.away_from_warned(s, offers[:1]) == offers[:1]  # nowhere else


def test_swaps_wait_for_replacements_still_launching_until_a_notice_cannot_wait() -> None:
    s = state(members=4, max_surge_nodes=2)
    s.swaps = [Swap(node_id="i-0", since=T0), Swap(node_id="i-1", since=T0)]
    s.nodes += [node(4), node(5, state=NodeState.REQUESTED)]
    assert make_before_break.next_step(s, T0).pairs == []  # i-5 is launching: one resize
    s.swaps[1] = s.swaps[1].model_copy(update={"deadline": T0 + timedelta(seconds=120)})
    assert make_before_break.next_step(s, T0).pairs == []  # the notice can wait 55 s more
    step = make_before_break.next_step(s, T0 + timedelta(seconds=55))
    assert [(a.slot, b.slot) for a, b in step.pairs] == [(1, 4)]  # it cannot: swap now
    s.nodes[5].state = NodeState.READY
    step = make_before_break.next_step(s, T0)
    assert [(a.slot, b.slot) for a, b in step.pairs] == [(1, 4), (0, 5)]


def test_one_resize_swapping_several_checkpoints_within_the_shortest_notices_grace() -> None:
    s = state(members=4, max_surge_nodes=2)
    s.swaps = [
        Swap(node_id="i-0", since=T0),  # a warning: no deadline, the whole graceful timeout
        Swap(node_id="i-1", since=T0, deadline=T0 + timedelta(seconds=30)),
    ]
    s.nodes += [node(4), node(5)]
    step = make_before_break.next_step(s, T0)
    assert [(a.slot, b.slot) for a, b in step.pairs] == [(1, 4), (0, 5)]
    timeout = s.spec.elastic.graceful_shutdown_timeout_s
    assert step.grace == grace_for_notice(30, timeout, make_before_break.NOTICE_MARGIN_S) < timeout


# --- properties --------------------------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[JobState, list[events.Reclaim], list[float]]:
    max_nodes = draw(st.integers(1, 6))
    members = draw(st.integers(1, max_nodes))
    s = state(members, max_nodes=max_nodes, min_nodes=1, max_surge_nodes=draw(st.integers(0, 2)))
    if members < max_nodes and draw(st.booleans()):  # a spare waiting for growth
        s.nodes.append(node(members))
        s.target = members + 1
    if draw(st.booleans()):  # a pool's grant, at least what the job holds
        s.spec.pool = parse_spec(job_spec(pool={"name": "team"})).pool
        s.grant = PoolGrant(seq=1, nodes=draw(st.integers(s.target, max_nodes + 2)), on_demand=0)
    s.checkpoints = draw(
        st.none() | st.builds(CheckpointStats, count=st.just(1), p99_s=st.floats(0, 90))
    )
    ids = st.sampled_from([f"i-{i}" for i in range(members + 1)])
    kinds = st.sampled_from(["rebalance", "reclaim"])
    warned = draw(
        st.lists(
            st.builds(
                lambda kind, node_id, left: events.Reclaim(
                    kind=kind,
                    node_id=node_id,
                    deadline=None if kind == "rebalance" else T0 + timedelta(seconds=left),
                ),
                kinds,
                ids,
                st.floats(0, 300),
            ),
            max_size=5,
        )
    )
    ticks = draw(st.lists(st.floats(0, 300), min_size=1, max_size=6))
    return s, warned, sorted(ticks)


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_never_above_max_nodes_plus_surge_nor_the_grant(
    scenario: tuple[JobState, list[events.Reclaim], list[float]],
) -> None:
    s, warned, _ = scenario
    cap = s.spec.elastic.max_nodes + s.spec.elastic.max_surge_nodes
    if s.grant is not None:
        cap = min(cap, s.grant.nodes)
    for event in warned:
        plan = make_before_break.on_notice(s, event, T0)
        s.swaps = plan.swaps
        for _ in range(orders.shortfall(s)):  # the fleet orders what is short
            s.nodes.append(node(len(s.nodes), state=NodeState.REQUESTED))
        held = sum(n.alive for n in s.nodes)
        assert held <= cap
        if s.spec.elastic.max_surge_nodes == 0:
            assert held <= s.spec.elastic.max_nodes


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_a_swap_only_onto_a_ready_spare_in_time_and_a_late_notice_shrinks(
    scenario: tuple[JobState, list[events.Reclaim], list[float]],
) -> None:
    s, warned, ticks = scenario
    for event in warned:
        s.swaps = make_before_break.on_notice(s, event, T0).swaps
    for i, offset in enumerate(ticks):
        now = T0 + timedelta(seconds=offset)
        if i % 2:  # replacements arrive now and then
            for n in s.nodes:
                n.state = NodeState.READY if n.state == NodeState.REQUESTED else n.state
        step = make_before_break.next_step(s, now)
        spares = make_before_break.spares(s)
        for warned_node, spare in step.pairs:
            assert spare in spares and warned_node.slot in s.members
        deadlines = [w.deadline for w in s.swaps if w.deadline is not None]
        if step.pairs and deadlines:
            assert 0 < step.grace <= s.spec.elastic.graceful_shutdown_timeout_s
        for late in step.late:
            assert late.deadline is not None
            assert make_before_break.swap_by(s, late.deadline) <= now
        if step.late:
            assert not step.pairs  # late only when no ready spare could take its place
        assert len(step.pairs) == len({b.slot for _, b in step.pairs})  # one spare per swap
        s.swaps = step.swaps
