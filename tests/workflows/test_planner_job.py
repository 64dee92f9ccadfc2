"""The job planner's decisions, without a server: each documented spec field's effect is
pinned by a plain example and, where a rule holds for every input, a hypothesis property."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from spotrain.workflows.contract import Lifecycle, Offer, PoolGrant, ScaleIn, WatchResult
from spotrain.workflows.job import events, job_planner, orders
from spotrain.workflows.job.state import JobState, NodeRecord, NodeState, Phase
from spotrain.workflows.spec import parse_spec
from tests.jobs import job_spec

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = T0 + timedelta(seconds=5)  # a later look: a started debounce keeps its start
GPU_TYPES = [
    {"name": "g10", "gpus": 10, "on_demand_price": 10.0, "spot_price": 3.0},
    {"name": "g8", "gpus": 8, "on_demand_price": 8.0, "spot_price": 2.5},
    {"name": "g1", "gpus": 1, "on_demand_price": 1.0, "spot_price": 0.3},
]


def state(**overrides: Any) -> JobState:
    return JobState.new(parse_spec(job_spec(**overrides)))


def node(
    slot: int,
    lifecycle: Lifecycle = "spot",
    state: NodeState = NodeState.READY,
    *,
    base: bool = False,
    fallback: bool = False,
    procs: int = 1,
    itype: str = "p3.2xlarge",
    zone: str | None = "us-east-1a",
) -> NodeRecord:
    return NodeRecord(
        slot=slot,
        lifecycle=lifecycle,
        instance_type=itype,
        zone=zone,
        node_id=f"i-{slot}",
        state=state,
        base=base,
        fallback=fallback,
        procs=procs,
        price=1.0,
        on_demand_price=3.06,
    )


def running(s: JobState, members: list[int]) -> JobState:
    s.members, s.running, s.generation = members, True, 1
    return s


# --- the next node's shape: GPU share, on-demand type, room, price ----------------------------


def test_total_gpus_packs_shares_and_the_fallback_is_sized_to_the_lost_share() -> None:
    s = state(
        total_gpus=15, elastic={"min_nodes": 1, "max_nodes": 2}, spot={"instance_types": GPU_TYPES}
    )
    assert orders.next_need(s) == (10, 10)
    s.nodes = [node(0, procs=10, itype="g10")]
    assert orders.next_need(s) == (5, 5)  # the 10-GPU share is held: the 5 is next
    # the 5-GPU share lost is replaced on demand by the cheapest type that holds 5: g8, not g10
    assert orders.on_demand_type(s.spec, orders.next_need(s)[0]) == "g8"
    s.nodes.append(node(1, procs=5, itype="g8"))
    assert orders.next_need(s) == (10, 10)  # beyond the packing: the largest shape


def test_gpus_per_node_and_procs_per_node_set_the_share() -> None:
    assert orders.next_need(state(procs_per_node=3)) == (0, 3)
    s = state(gpus_per_node=8, spot={"instance_types": GPU_TYPES})
    assert orders.next_need(s) == (8, 8)
    assert orders.on_demand_type(s.spec, 8) == "g8"


@given(gpus=st.integers(0, 10))
def test_on_demand_type_is_the_cheapest_that_fits(gpus: int) -> None:
    spec = state(spot={"instance_types": GPU_TYPES}).spec
    chosen = spec.instance_type(orders.on_demand_type(spec, gpus))
    fitting = [t for t in spec.spot.instance_types if t.gpus >= gpus]
    assert chosen.gpus >= gpus
    assert chosen.on_demand_price == min(t.on_demand_price for t in fitting)


def test_on_demand_room_follows_fallback_max_nodes_base_and_the_pool() -> None:
    assert orders.on_demand_room(state(on_demand={"fallback": False})) == 0
    s = state(on_demand={"max_nodes": 3, "base_nodes": 1})
    s.nodes = [node(0, "on-demand", base=True), node(1, "on-demand", fallback=True)]
    assert orders.on_demand_room(s) == 1  # 3 - 1 base - 1 fallback in use
    s.nodes[1].state = NodeState.GONE
    assert orders.on_demand_room(s) == 2
    pooled = state(pool={"name": "gpus"})
    assert orders.on_demand_room(pooled) == 0  # no grant yet
    pooled.grant = PoolGrant(seq=1, nodes=4, on_demand=2)
    pooled.nodes = [node(0, "on-demand", fallback=True)]
    assert orders.on_demand_room(pooled) == 1


def test_node_price_spec_then_market_then_on_demand() -> None:
    s = state()
    s.spot_prices["p3.2xlarge@us-east-1a"] = 0.5  # the spec's spot_price wins over the market's
    assert orders.node_price(s, "spot", "p3.2xlarge", "us-east-1a") == 0.97
    assert orders.node_price(s, "on-demand", "p3.2xlarge", "us-east-1a") == 3.06
    types = [{"name": "m5", "on_demand_price": 0.1}]
    market = state(spot={"instance_types": types})
    assert orders.node_price(market, "spot", "m5", "us-east-1a") == 0.1
    market.spot_prices["m5@us-east-1a"] = 0.04
    assert orders.node_price(market, "spot", "m5", "us-east-1a") == 0.04


# --- ordering nodes ----------------------------------------------------------------------------


def offers(*pools: tuple[str, str]) -> list[Offer]:
    return [Offer(instance_type=t, zone=z, price=1.0) for t, z in pools]


def test_base_nodes_are_ordered_first_on_demand() -> None:
    s = state(on_demand={"base_nodes": 2})
    short = orders.shortfall(s)
    assert short == 4
    base = orders.base_orders(s, short)
    assert [(o.lifecycle, o.base) for o in base] == [("on-demand", True)] * 2
    s.phase = Phase.PAUSED
    assert orders.shortfall(s) == 0


def test_spot_orders_spread_over_zones_then_fall_back_for_what_is_owed() -> None:
    s = state(on_demand={"max_nodes": 1})
    s.owed = 2
    pools = offers(("p3.2xlarge", "us-east-1a"), ("p3.2xlarge", "us-east-1b"))
    plan = orders.spot_orders(s, pools, 4, Counter(), spot_only=False)
    assert [o.zone for o in plan.orders] == ["us-east-1a", "us-east-1b"] * 2
    assert plan.owed == 0 and plan.waiting == 0
    assert [o.on_demand_ok for o in plan.orders] == [True, True, False, False]
    dry = orders.spot_orders(s, [], 3, Counter(), spot_only=False)
    assert [(o.lifecycle, o.fallback) for o in dry.orders] == [("on-demand", True)]  # max 1
    assert dry.waiting == 2 and dry.owed == 1
    grow = orders.spot_orders(s, [], 3, Counter(), spot_only=True)
    assert grow.orders == [] and grow.waiting == 3  # growth never buys on-demand


@settings(max_examples=200)
@given(
    short=st.integers(0, 8),
    owed=st.integers(0, 8),
    cap=st.none() | st.integers(0, 4),
    spot_only=st.booleans(),
    zones=st.lists(st.sampled_from(["us-east-1a", "us-east-1b"]), unique=True),
)
def test_spot_orders_never_exceed_the_shortfall_the_debt_or_the_room(
    short: int, owed: int, cap: int | None, spot_only: bool, zones: list[str]
) -> None:
    s = state(on_demand={"max_nodes": cap})
    s.owed = owed
    room = orders.on_demand_room(s)
    plan = orders.spot_orders(
        s, offers(*(("p3.2xlarge", z) for z in zones)), short, Counter(), spot_only=spot_only
    )
    on_demand = [o for o in plan.orders if o.lifecycle == "on-demand"]
    assert len(plan.orders) + plan.waiting == short
    assert len(on_demand) <= (0 if spot_only else min(owed, room))
    assert plan.owed == max(0, owed - len(plan.orders))
    assert all(o.fallback and not o.pools for o in on_demand)
    if zones:
        assert not on_demand and plan.waiting == 0  # spot first whenever a pool serves


def test_launch_tries_every_pool_then_the_sized_on_demand_type_in_the_home_zone() -> None:
    pools = [("g8", "a"), ("g10", "b")]
    spot = orders.Order("spot", "g8", 1, pools=pools)
    assert orders.launch_tries(spot, "g8") == [
        ("g8", "a", "spot"),
        ("g10", "b", "spot"),
        ("g8", None, "on-demand"),
    ]
    assert orders.launch_tries(spot, None)[-1] == ("g10", "b", "spot")
    on_demand = orders.Order("on-demand", "g1", 1, pools=pools)
    assert orders.launch_tries(on_demand, "g8") == [("g1", None, "on-demand")]
    homed = orders.Order("spot", "g8", 1, pools=[("g8", "a")], home="a")
    assert orders.launch_tries(homed, "g8")[-1] == ("g8", "a", "on-demand")
    assert orders.Order("on-demand", "g1", 1, home="a").zone == "a"


# --- starting a generation ---------------------------------------------------------------------


def test_gang_start_waits_scaling_timeout_for_the_nodes_ordered() -> None:
    s = state(elastic={"scaling_timeout_s": 45})
    s.nodes = [node(i) for i in range(3)] + [node(3, state=NodeState.REQUESTED)]
    plan = job_planner.next_generation(s, T0, launching=True)
    assert plan.members is None and plan.hold_until == T0 + timedelta(seconds=45)
    later = T0 + timedelta(seconds=46)
    s.hold_until = plan.hold_until
    assert job_planner.next_generation(s, later, launching=True).members == [0, 1, 2]
    s.nodes[3].state = NodeState.READY
    assert job_planner.next_generation(s, T0, launching=False).members == [0, 1, 2, 3]


def test_after_a_loss_the_hold_is_faulty_scale_down_timeout() -> None:
    s = state(elastic={"faulty_scale_down_timeout_s": 200})
    assert job_planner.replacement_hold(s, T0) == T0 + timedelta(seconds=200)
    s.generation, s.hold_until = 1, T0 + timedelta(seconds=200)
    s.nodes = [node(i) for i in range(3)]
    plan = job_planner.next_generation(s, T0 + timedelta(seconds=199), launching=True)
    assert plan.members is None and "faulty_scale_down_timeout_s" in plan.why
    drop = state(elastic={"reclaim_policy": "drop"})
    assert job_planner.replacement_hold(drop, T0) is None  # drop: shrink at once


def test_parked_survivors_re_form_at_once_and_a_fresh_node_joins_later() -> None:
    """Live resize after a loss, a replacement already ready: the survivors holding the state
    re-form on their own at once (no hold, no waiting on the new node's process start);
    without held state, or when the survivors fill no allowed size, the usual rule."""
    s = state(elastic={"faulty_scale_down_timeout_s": 200, "min_nodes": 2})
    s.generation, s.members, s.held = 1, [0, 1, 2], True
    s.hold_until = T0 + timedelta(seconds=200)
    s.nodes = [node(0), node(1), node(2, state=NodeState.GONE), node(3)]  # 3: the replacement
    plan = job_planner.next_generation(s, T0, launching=False, survivors_first=True)
    assert plan.members == [0, 1] and plan.hold_until is None
    s.prepared = [0, 1, 3]  # a growth: the joiner's ranks got a head start
    assert job_planner.next_generation(s, T0, launching=False, survivors_first=True).members == [
        0,
        1,
        3,
    ]
    s.prepared = []
    # (before: the survivors sat parked through the hold, then waited on the new process)
    assert job_planner.next_generation(s, T0, launching=False).members is None
    s.hold_until = None
    s.held = False  # (a restart: every rank starts anew anyway)
    assert job_planner.next_generation(s, T0, launching=False, survivors_first=True).members == [
        0,
        1,
        3,
    ]
    s.held, s.nodes[1].state = True, NodeState.GONE  # one survivor: short of min_nodes
    assert job_planner.next_generation(s, T0, launching=False, survivors_first=True).members == [
        0,
        3,
    ]


def test_too_few_ready_nodes_wait_for_the_next_check() -> None:
    s = state()
    s.next_check = T0 + timedelta(seconds=120)
    s.nodes = [node(0)]
    plan = job_planner.next_generation(s, T0, launching=False)
    assert plan.too_few and plan.members is None and plan.wake == s.next_check


@settings(max_examples=200)
@given(
    ready=st.integers(0, 8),
    discrete=st.none() | st.lists(st.sampled_from([2, 3, 4, 6, 8]), min_size=1, unique=True),
)
def test_a_generation_starts_at_the_largest_allowed_size_ready(
    ready: int, discrete: list[int] | None
) -> None:
    s = state(elastic={"min_nodes": 2, "max_nodes": 8, "discrete_sizes": discrete})
    s.nodes = [node(i) for i in range(ready)]
    plan = job_planner.next_generation(s, T0, launching=False)
    sizes = discrete or list(range(2, 9))
    fitting = [z for z in sizes if z <= ready]
    if fitting:
        assert plan.members is not None and len(plan.members) == max(fitting)
    else:
        assert plan.members is None and plan.too_few


def test_scale_config_is_the_entry_for_the_world_size_in_processes() -> None:
    s = state(
        procs_per_node=2,
        global_batch_size=48,
        scale_config={2: {"lr": 0.1}, 4: {"lr": 0.2}, 6: {"lr": 0.3}},
    )
    s.nodes = [node(i, procs=2) for i in range(3)]
    s.members = [0, 1]
    assert job_planner.generation_plan(s).scale_config == {"lr": 0.2}  # 2 nodes x 2 = 4
    s.members = [2, 0, 1]
    plan = job_planner.generation_plan(s)
    assert plan.scale_config == {"lr": 0.3} and [m.node_id for m in plan.members] == [
        "i-2",
        "i-0",
        "i-1",
    ]
    assert (plan.global_batch_size, plan.total_steps, plan.generation) == (48, 36_000, 0)
    s.members = [0]
    assert job_planner.generation_plan(s).scale_config == {"lr": 0.1}
    assert job_planner.generation_plan(state()).scale_config == {}


def test_return_to_spot_releases_fallback_nodes_left_out() -> None:
    s = running(state(), [0, 1])
    s.nodes = [node(0), node(1), node(2, "on-demand", fallback=True), node(3, "on-demand")]
    spare, target = job_planner.swap_back(s)
    assert [n.slot for n in spare] == [2] and target == 3
    off = running(state(on_demand={"return_to_spot": False}), [0, 1])
    off.nodes = s.nodes
    assert job_planner.swap_back(off) == ([], 4)


# --- a running generation ----------------------------------------------------------------------


def test_watch_verdicts_and_stall_timeout() -> None:
    s = state(elastic={"stall_timeout_s": 100})
    s.progress_at = T0
    progress = WatchResult(outcome="progress", step=5)
    assert job_planner.watch_verdict(s, progress, T0 + timedelta(seconds=100)) == ("carry on", "")
    verdict, why = job_planner.watch_verdict(s, progress, T0 + timedelta(seconds=101))
    assert verdict == "fault" and "no progress for 100s" in why
    failed = WatchResult(outcome="failed", exit_codes={1: 3})
    assert job_planner.watch_verdict(s, failed, T0) == ("fault", "exit codes {1: 3}")
    assert job_planner.watch_verdict(s, WatchResult(outcome="completed"), T0)[0] == "completed"


def test_max_restarts_fails_the_job_one_past_the_limit() -> None:
    s = state(elastic={"max_restarts": 2})
    s.restarts = 2
    assert job_planner.restarts_exhausted(s, "boom") is None
    s.restarts = 3
    assert "max_restarts=2" in (job_planner.restarts_exhausted(s, "boom") or "")


def test_growth_waits_scaling_timeout_after_nodes_arrive() -> None:
    s = running(state(elastic={"scaling_timeout_s": 17}), [0, 1])
    s.nodes = [node(0), node(1)]
    assert job_planner.growth_plan(s) is None
    assert job_planner.growth_since(s, T0) is None
    s.nodes.append(node(2))
    assert job_planner.growth_plan(s) == [0, 1, 2]
    s.grow_since = job_planner.growth_since(s, T0)
    assert s.grow_since == T0
    assert job_planner.growth_since(s, T0 + timedelta(seconds=5)) == T0  # the clock keeps
    assert job_planner.growth_timer(s, T1) == (T0, T0 + timedelta(seconds=17))
    s.nodes[2].state = NodeState.GONE
    assert job_planner.growth_timer(s, T1) == (None, None)  # no growth left: the clock resets


def test_growth_back_to_the_target_is_due_at_once() -> None:
    """A replacement that restores the nodes the job wants joins at once: it bills while it
    waits, and no further node is coming to batch it with (the newcomer's 47-80 s idle)."""
    s = running(state(elastic={"scaling_timeout_s": 30, "max_nodes": 4}), [0, 1])
    s.target = 3
    s.nodes = [node(0), node(1), node(2)]
    s.grow_since = job_planner.growth_since(s, T0)
    assert job_planner.growth_timer(s, T1) == (T0, T0)
    debounced = (T0, T0 + timedelta(seconds=30))
    assert job_planner.growth_timer(s, T1, restore_at_once=False) == debounced
    s.target = 4  # still one short: wait for it, to join both in one resize
    assert job_planner.growth_timer(s, T1) == (T0, T0 + timedelta(seconds=30))
    s.target, s.members = 2, [0, 1]  # beyond the target (spare spot): debounced as before
    assert job_planner.growth_timer(s, T1) == (T0, T0 + timedelta(seconds=30))


def test_growth_that_became_possible_while_no_generation_ran_is_not_forgotten() -> None:
    """A replacement ready during the gang start changes no node afterwards: the debounce
    starts at the first look once the generation runs (it never started: the job stayed
    short of its node for good, seen in the crash sweep at after:describe_nodes)."""
    s = state(elastic={"scaling_timeout_s": 30})
    s.nodes = [node(0), node(1), node(2)]
    s.grow_since = job_planner.growth_since(s, T0)  # (the node came: nothing runs yet)
    assert s.grow_since is None
    running(s, [0, 1])
    s.target = 4
    assert job_planner.growth_timer(s, T1) == (T1, T1 + timedelta(seconds=30))
    assert job_planner.growth_timer(s, None) == (None, None)  # the rule before: stuck
    s.target = 3
    assert job_planner.growth_timer(s, T1) == (T1, T1)


@given(
    timeout=st.floats(0, 10_000),
    members=st.integers(2, 3),
    ready=st.integers(2, 4),
    target=st.integers(2, 4),
)
def test_growth_is_due_scaling_timeout_after_it_became_possible_unless_it_restores_the_target(
    timeout: float, members: int, ready: int, target: int
) -> None:
    s = running(state(elastic={"scaling_timeout_s": timeout}), list(range(members)))
    s.target = target
    s.nodes = [node(i) for i in range(max(members, ready))]
    s.grow_since = job_planner.growth_since(s, T0)
    since, due = job_planner.growth_timer(s, T1)
    if ready <= members:
        assert since is None and due is None
    elif members < target <= ready:
        assert since == T0 and due == T0
    else:
        assert since == T0 and due == T0 + timedelta(seconds=timeout)


def test_growth_swaps_fallback_nodes_for_spot_at_the_same_size() -> None:
    s = running(state(elastic={"max_nodes": 2}), [0, 1])
    s.nodes = [node(0), node(1, "on-demand", fallback=True), node(2)]
    assert job_planner.growth_plan(s) == [0, 2]
    s.spec.on_demand.return_to_spot = False
    assert job_planner.growth_plan(s) is None


# --- events ------------------------------------------------------------------------------------


def test_reclaim_plan_per_case() -> None:
    s = running(state(elastic={"graceful_shutdown_timeout_s": 45}), [0, 1, 2])
    s.nodes = [node(i) for i in range(4)]
    soon = T0 + timedelta(seconds=30)
    assert job_planner.reclaim_plan(s, events.Reclaim(node_id="i-9"), T0).action == "ignore"
    rebalance = events.Reclaim(kind="rebalance", node_id="i-1")
    assert job_planner.reclaim_plan(s, rebalance, T0).action == "ignore rebalance"
    s.spec.elastic.act_on_rebalance = True
    assert job_planner.reclaim_plan(s, rebalance, T0).action == "resize"
    assert job_planner.reclaim_plan(s, events.Reclaim(node_id="i-3"), T0).action == "gone"
    late = events.Reclaim(node_id="i-1", deadline=T0 + timedelta(seconds=4))
    assert job_planner.reclaim_plan(s, late, T0).action == "lost"
    plan = job_planner.reclaim_plan(s, events.Reclaim(node_id="i-1", deadline=soon), T0)
    assert plan.action == "resize" and plan.grace == 25  # the notice's 30 s less a margin
    no_deadline = job_planner.reclaim_plan(s, events.Reclaim(node_id="i-1"), T0)
    assert no_deadline.grace == 45  # graceful_shutdown_timeout_s


def test_reclaims_queued_meanwhile_leave_in_the_same_resize() -> None:
    s = running(state(), [0, 1, 2])
    s.nodes = [node(i) for i in range(4)]
    queued: list[events.Event] = [
        events.Lost(node_id="i-2"),
        events.Reclaim(kind="rebalance", node_id="i-0"),  # a warning, not a notice
        events.Reclaim(node_id="i-3"),  # not a member
        events.Pause(),
        events.Reclaim(node_id="i-0"),
        events.Reclaim(node_id="i-2"),  # already leaving
    ]
    s.inbox = list(queued)
    plan = job_planner.reclaim_plan(s, events.Reclaim(node_id="i-1"), T0)
    assert [n.slot for n in plan.leaving] == [1, 2, 0]
    assert plan.absorbed == [queued[0], queued[4]]


def test_reclaim_policy_replace_owes_a_node_and_drop_shrinks() -> None:
    s = state(elastic={"min_nodes": 3})
    spot = node(0)
    assert job_planner.after_loss(s, spot, "lost") == job_planner.AfterLoss(True, True, 4)
    drop = state(elastic={"reclaim_policy": "drop", "min_nodes": 3})
    assert job_planner.after_loss(drop, spot, "lost") == job_planner.AfterLoss(True, False, 3)
    drop.target = 3
    assert job_planner.after_loss(drop, spot, "lost").target == 3  # never below min_nodes
    base = node(1, "on-demand", base=True)
    assert job_planner.after_loss(drop, base, "lost") == job_planner.AfterLoss(False, True, 3)


def test_scale_in_removes_spare_nodes_then_the_highest_ranks() -> None:
    s = running(state(), [2, 0, 1])
    s.nodes = [node(i) for i in range(4)]
    assert [n.slot for n in job_planner.removal_order(s)] == [3, 1, 0, 2]
    down = job_planner.scale_in_plan(s, 2, None)
    assert down.names == ["i-3", "i-1"] and down.target == 2
    named = job_planner.scale_in_plan(s, None, ["i-0"])
    assert named.names == ["i-0"] and named.target == 3
    s.target = 2  # (a loss shrank the job after the request was accepted)
    assert job_planner.scale_in_plan(s, 1, None).target == 2  # never below min_nodes


def test_scale_requests_are_checked_against_min_and_max() -> None:
    s = state()
    s.nodes = [node(i) for i in range(4)]
    assert job_planner.scale_out_error(s, 1) == "cannot scale out to 5 nodes: max_nodes is 4"
    assert job_planner.scale_in_error(s, ScaleIn(count=3)) == (
        "cannot scale in to 1 nodes: min_nodes is 2"
    )
    assert job_planner.scale_in_error(s, ScaleIn(node_ids=["i-7"])) == (
        "unknown or gone node(s): i-7"
    )
    assert job_planner.scale_in_error(s, ScaleIn()) == "give either count or node_ids"
    assert job_planner.scale_in_error(s, ScaleIn(count=2)) is None


# --- periodic capacity checks ------------------------------------------------------------------


def test_capacity_check_grows_opportunistically_and_swaps_back() -> None:
    s = running(state(), [0, 1])
    s.target = 2
    s.nodes = [node(0), node(1, "on-demand", fallback=True)]
    check = job_planner.capacity_check(s, launching=False)
    assert check == job_planner.CapacityCheck(grow=True, swap=1)
    assert job_planner.target_with_spot(s, check) == 5  # ceiling 4, plus one to swap
    assert job_planner.capacity_check(s, launching=True) == job_planner.CapacityCheck(True, 0)
    s.spec.elastic.opportunistic = False
    s.spec.on_demand.return_to_spot = False
    check = job_planner.capacity_check(s, launching=False)
    assert check is not None and not check.wants_spot
    s.phase = Phase.PAUSED
    assert job_planner.capacity_check(s, launching=False) is None
    assert job_planner.capacity_check(state(spot={"enabled": False}), launching=False) is None


# --- capacity pool -----------------------------------------------------------------------------


def test_a_grant_below_min_preempts_and_one_above_admits() -> None:
    s = state(pool={"name": "gpus"}, on_demand={"base_nodes": 1})
    s.phase = Phase.QUEUED
    low = job_planner.grant_plan(s, PoolGrant(seq=1, nodes=1, on_demand=1))
    assert low.preempt
    plan = job_planner.grant_plan(s, PoolGrant(seq=2, nodes=3, on_demand=1))
    assert not plan.preempt and plan.admit and plan.owed == 2 and plan.target == 4


@settings(max_examples=200)
@given(
    lifecycles=st.lists(st.sampled_from(["spot", "on-demand", "base"]), max_size=8),
    nodes=st.integers(0, 8),
    on_demand=st.integers(0, 8),
    members=st.integers(0, 8),
)
def test_a_grant_shrinks_on_demand_first_never_the_base(
    lifecycles: list[str], nodes: int, on_demand: int, members: int
) -> None:
    s = state(pool={"name": "gpus"}, elastic={"min_nodes": 1, "max_nodes": 8})
    s.nodes = [
        node(i, "spot" if kind == "spot" else "on-demand", base=kind == "base")
        for i, kind in enumerate(lifecycles)
    ]
    running(s, list(range(min(members, len(lifecycles)))))
    plan = job_planner.grant_plan(s, PoolGrant(seq=1, nodes=nodes, on_demand=on_demand))
    victims = {n.slot for n in plan.victims}
    kept = [n for n in s.nodes if n.slot not in victims]
    assert not any(n.base for n in plan.victims)
    base = sum(n.base for n in s.nodes)
    assert len(kept) <= max(nodes, base)
    assert sum(n.lifecycle == "on-demand" for n in kept) <= max(on_demand, base)
    # as few as it takes: the on-demand nodes over the allowance, and enough to fit the grant
    od_over = sum(n.lifecycle == "on-demand" for n in s.nodes) - on_demand
    od_removed = min(sum(n.lifecycle == "on-demand" and not n.base for n in s.nodes), od_over)
    removable = len(s.nodes) - base
    fit = min(removable, max(0, len(s.nodes) - nodes))
    assert len(victims) == max(max(0, od_removed), fit)


def test_pool_report_claims_min_max_and_holdings() -> None:
    s = state(pool={"name": "gpus", "team": "vision"}, on_demand={"max_nodes": 1}, priority=3)
    s.nodes = [node(0), node(1, "on-demand", fallback=True), node(2, state=NodeState.GONE)]
    s.step = 18_000
    r = job_planner.pool_report(s)
    assert (r.claiming, r.priority, r.team, r.min_nodes, r.max_nodes) == (True, 3, "vision", 2, 4)
    assert (r.holding, r.holding_on_demand, r.max_on_demand, r.progress) == (2, 1, 1, 0.5)
    s.phase = Phase.PAUSED
    assert not job_planner.pool_report(s).claiming


# --- typed states and events -------------------------------------------------------------------


def test_phase_and_node_state_predicates() -> None:
    assert {p for p in Phase if p.is_final} == {Phase.SUCCEEDED, Phase.FAILED, Phase.CANCELLED}
    assert {p for p in Phase if not p.claims_capacity} == {
        Phase.PAUSED,
        Phase.SUCCEEDED,
        Phase.FAILED,
        Phase.CANCELLED,
    }
    assert {s for s in NodeState if s.is_alive} == {NodeState.REQUESTED, NodeState.READY}


def test_an_inbox_carried_in_the_old_shape_decodes_into_typed_events() -> None:
    """Before typed events, an event was one model with every field (unused ones null);
    continue-as-new may carry such an inbox into a run of this code."""
    old = {"node_id": None, "deadline": None, "count": None, "node_ids": None, "grant": None}
    carried = state().model_dump(mode="json") | {
        "inbox": [
            old | {"kind": "reclaim", "node_id": "i-1", "deadline": "2026-01-01T00:00:30Z"},
            old | {"kind": "rebalance", "node_id": "i-2"},
            old | {"kind": "lost", "node_id": "i-3"},
            old | {"kind": "scale_out", "count": 2},
            old | {"kind": "scale_in", "node_ids": ["i-4"]},
            old | {"kind": "pause"},
            old | {"kind": "resume"},
            old | {"kind": "grant", "grant": {"seq": 3, "nodes": 2, "on_demand": 0}},
        ]
    }
    inbox = JobState.model_validate(carried).inbox
    assert inbox == [
        events.Reclaim(node_id="i-1", deadline=T0 + timedelta(seconds=30)),
        events.Reclaim(kind="rebalance", node_id="i-2"),
        events.Lost(node_id="i-3"),
        events.ScaleOut(count=2),
        events.ScaleIn(node_ids=["i-4"]),
        events.Pause(),
        events.Resume(),
        events.Grant(grant=PoolGrant(seq=3, nodes=2, on_demand=0)),
    ]
    assert (
        JobState.model_validate_json(JobState.model_validate(carried).model_dump_json()).inbox
        == inbox
    )
