"""Hops for gain: a job that can train moves to another zone when the move pays within
`HOP_HORIZON` by at least `HOP_MIN_GAIN`, never within `HOP_HOLD_DOWN` of its last hop
(workflows/policies/locality.py: weigh_move, hop_for_gain)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from temporalio import activity
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedCloud
from spotrain.workflows import contract
from spotrain.workflows.contract import Offer, WatchResult
from spotrain.workflows.job import orders
from spotrain.workflows.job.state import JobResult, TimelineEntry
from spotrain.workflows.policies import locality
from spotrain.workflows.policies.deadline import DeadlineState
from spotrain.workflows.policies.locality import Stay, hop_for_gain, weigh_move
from spotrain.workflows.spec import SpotPolicy
from tests.jobs import job_spec, record_history, simulated
from tests.workflows.test_placement import state_with, with_market

T0 = datetime(2026, 1, 1, tzinfo=UTC)
OD = 3.06  # p3.2xlarge on demand: what a node-hour of training is worth
MOVE_S = 60 + 60 + 120  # a checkpoint (the graceful timeout), a boot, a restart
G = 400_000_000  # 100M fp32 parameters' gradients

prices = st.floats(0.05, 3.0)
# A spot market over three zones: zone -> its cheapest offer (absent: it offers nothing).
market_strategy = st.dictionaries(st.sampled_from(["za", "zb", "zc"]), prices)


def offers_of(market: dict[str, float]) -> list[Offer]:
    return [Offer(instance_type="p3.2xlarge", zone=z, price=p) for z, p in market.items()]


def hop(
    stay: Stay, market: dict[str, float], wants: int = 4, **changes: object
) -> locality.Hop | None:
    args: dict[str, object] = {
        "placement": "zone",
        "home": "za",
        "stay": stay,
        "wants": wants,
        "min_nodes": 1,
        "worth_h": OD,
        "move_s": MOVE_S,
        "offers": offers_of(market),
        "dry": {},
        "regions": [],
        "last_hop": None,
        "now": T0,
    }
    return hop_for_gain(**with_market(args, changes))  # type: ignore[arg-type]


def test_more_nodes_for_less_pays_a_small_saving_does_not() -> None:
    """Held to 2 of 4 nodes at home (which offers no more), zone b gives 4 for less: over 2 h
    that is 4 x (3.06 - 0.5) - 2 x (3.06 - 0.97) = 6.06 USD/h more, 12.12, against a move of
    240 s x 4 x 3.06 = 0.82 and a minimum of 0.25 x 2 h x 2 x 0.97 = 0.97."""
    w = weigh_move(Stay(2, 0.97), Stay(4, 0.5), worth_h=OD, move_s=MOVE_S)
    assert w.gain_usd == pytest.approx(12.12) and w.cost_usd == pytest.approx(0.816)
    assert w.floor_usd == pytest.approx(0.97) and w.pays
    moved = hop(Stay(2, 0.97), {"zb": 0.5})
    assert moved is not None and moved.to == "zb"
    assert "zb offers 4 node(s) at $0.500/h against 2 at $0.970/h in za" in moved.why
    # At full size, a price 0.22 lower: gain 1.76 - move 0.82 = 0.94, under the minimum 1.94.
    assert hop(Stay(4, 0.97), {"za": 0.97, "zb": 0.75}) is None
    assert hop(Stay(4, 0.97), {"za": 0.97, "zb": 0.5}) is not None  # 0.47 lower: 2.94 > 1.94
    # Home still offers: it can grow there, so more nodes elsewhere are no gain.
    assert hop(Stay(2, 0.97), {"za": 0.97, "zb": 0.97}) is None
    assert hop(Stay(2, 0.97), {"zb": 0.97}) is not None  # ... unless it offers nothing
    # A launch at home found no capacity (dry): waited out, not left for nodes no zone has
    # shown it can give (a make-before-break run hopped to another zone as empty, 4 3 2 4).
    dry = {locality.pool_key("p3.2xlarge", "za"): T0}
    assert hop(Stay(2, 0.97), {"za": 0.97, "zb": 0.97}, dry=dry) is None


def test_a_zone_is_weighed_for_the_nodes_its_pools_say_they_can_give() -> None:
    """Where the provider states a pool's capacity (the simulated cloud, from its trace), a
    zone gives what its pools can: bought cheapest first, at their mean price. EC2 states
    none, and a zone is taken to give all `wants`."""

    def pools(zone: str, *priced: tuple[float, int | None]) -> list[Offer]:
        return [
            Offer(instance_type=f"t{i}", zone=zone, price=p, capacity=n)
            for i, (p, n) in enumerate(priced)
        ]

    # Held to 2 of 4 at 0.97, home offers no more. zb's 1 node at 0.5 is no gain on 2:
    # 1 x (3.06 - 0.5) < 2 x (3.06 - 0.97).
    assert hop(Stay(2, 0.97), {}, offers=pools("zb", (0.5, 1))) is None
    moved = hop(Stay(2, 0.97), {}, offers=pools("zb", (0.5, 2), (0.6, 5)))
    assert moved is not None and moved.to == "zb"
    assert "zb offers 4 node(s) at $0.550/h against 2" in moved.why  # 2 at 0.5, 2 at 0.6
    assert hop(Stay(2, 0.97), {}, offers=pools("zb", (0.5, None))) is not None
    # Home says it has room for 1 more (3 of 4): zb's 4 at the same price now pays, where
    # a home that states nothing was taken to give all 4.
    home_room = pools("za", (0.97, 1)) + pools("zb", (0.97, 4))
    moved = hop(Stay(2, 0.97), {}, offers=home_room)
    assert moved is not None and "against 3 at $0.970/h in za" in moved.why
    assert hop(Stay(2, 0.97), {}, offers=pools("za", (0.97, None)) + pools("zb", (0.97, 4))) is None
    # A zone that cannot give min_nodes is no place to train, however cheap: 1 node at 0.05
    # against 2 at 3.0 would pay on nodes x (worth - price) alone.
    assert hop(Stay(2, 3.0), {}, offers=pools("zb", (0.05, 1))) is not None
    assert hop(Stay(2, 3.0), {}, min_nodes=2, offers=pools("zb", (0.05, 1))) is None


@given(
    held=st.integers(1, 6),
    extra=st.integers(0, 6),
    price=prices,
    pools=st.lists(st.tuples(st.sampled_from(["zb", "zc"]), prices, st.integers(1, 8)), max_size=6),
    min_nodes=st.integers(1, 6),
)
def test_a_hop_for_gain_goes_only_where_the_pools_can_give_min_nodes(
    held: int, extra: int, price: float, pools: list[tuple[str, float, int]], min_nodes: int
) -> None:
    offers = [
        Offer(instance_type=f"t{i}", zone=z, price=p, capacity=n)
        for i, (z, p, n) in enumerate(pools)
    ]
    moved = hop(Stay(held, price), {}, held + extra, min_nodes=min_nodes, offers=offers)
    if moved is not None:
        there = sum(n for z, _, n in pools if z == moved.to)
        assert there >= min_nodes


def test_the_hold_down_and_placement_any_keep_it_where_it_is() -> None:
    cheap = {"zb": 0.1}
    just = T0 - locality.HOP_HOLD_DOWN + timedelta(seconds=1)
    assert hop(Stay(2, 0.97), cheap, last_hop=just) is None
    assert hop(Stay(2, 0.97), cheap, last_hop=T0 - locality.HOP_HOLD_DOWN) is not None
    assert hop(Stay(2, 0.97), cheap, placement="any") is None
    regions = ["us-east-1", "us-west-2"]
    inside = {"us-east-1b": 0.1}
    kept = hop(Stay(2, 0.97), inside, placement="region", home="us-east-1a", regions=regions)
    assert kept is None  # its own region
    far = hop(
        Stay(2, 0.97), {"us-west-2a": 0.1}, placement="region", home="us-east-1a", regions=regions
    )
    assert far is not None and far.to == "us-west-2a"


@given(
    held=st.integers(1, 8),
    extra=st.integers(0, 8),
    price=prices,
    market=market_strategy,
    cheaper=st.floats(0.0, 1.0),
)
def test_a_better_market_never_undoes_a_hop(
    held: int, extra: int, price: float, market: dict[str, float], cheaper: float
) -> None:
    """Lower prices elsewhere never stop a hop that paid (and one to the cheapest zone)."""
    wants = held + extra
    before = hop(Stay(held, market.get("za", price)), market, wants)
    lower = {z: p if z == "za" else p * cheaper for z, p in market.items()}
    after = hop(Stay(held, market.get("za", price)), lower, wants)
    if before is not None:
        assert after is not None
        cheapest = min(p for z, p in lower.items() if z != "za")
        assert before.to != "za" and lower[after.to] == pytest.approx(cheapest, abs=1e-9)


@given(held=st.integers(1, 8), extra=st.integers(0, 8), price=prices, market=market_strategy)
def test_a_hop_never_pays_back_on_the_same_market(
    held: int, extra: int, price: float, market: dict[str, float]
) -> None:
    """No flapping even without the hold-down: once the job has moved (and pays the market
    price where it went), the same market never moves it again, back or on."""
    wants = held + extra
    moved = hop(Stay(held, market.get("za", price)), market, wants)
    if moved is not None:
        there = Stay(wants, market[moved.to])
        assert hop(there, market, wants, home=moved.to) is None


@given(stay=st.integers(1, 8), price=prices, market=market_strategy)
def test_no_gain_no_hop(stay: int, price: float, market: dict[str, float]) -> None:
    """As many nodes at no lower a price elsewhere never pays: the move always costs."""
    pricier = {z: max(p, price) for z, p in market.items()}
    assert hop(Stay(stay, price), pricier, wants=stay) is None


@given(
    types=st.lists(prices, min_size=1, max_size=3),
    mix=st.lists(st.integers(0, 2), min_size=1, max_size=8),
    zones=st.lists(st.sampled_from(["zb", "zc"]), unique=True),
    extra=st.integers(0, 4),
)
def test_a_mix_of_types_never_moves_for_a_price_its_home_offers_too(
    types: list[float], mix: list[int], zones: list[str], extra: int
) -> None:
    """Every zone offers the same types at the same prices, and the job holds a mix of them
    at home (paying their mean): it stays. Weighed against what it pays, the cheapest type
    elsewhere looked like a gain; it bought the same mix there and moved again (the demo
    hopped on its first capacity check, 4 of 4 m5.large and m5.xlarge nodes)."""
    held = [types[i % len(types)] for i in mix]
    offers = [
        Offer(instance_type=f"t{i}", zone=z, price=p)
        for z in ["za", *zones]
        for i, p in enumerate(types)
    ]
    stay = Stay(len(held), sum(held) / len(held))
    assert hop(stay, {}, wants=len(held) + extra, offers=offers) is None


def test_orders_weigh_the_billed_prices_and_leave_base_nodes_out() -> None:
    """The job's live nodes, at what they are billed, against the offers at what it would be
    billed there: the spec's spot price, when it gives one, is the same in every zone."""
    offers = [Offer(instance_type="p3.2xlarge", zone="us-east-1b", price=0.1)]
    fixed = state_with(["us-east-1a"] * 2)  # the spec's spot_price: 0.97 everywhere
    fixed.target = 2
    assert orders.hop_for_gain(fixed, offers, T0, move_s=MOVE_S) is None
    fixed.nodes[0].base, fixed.nodes[0].price = True, OD  # on demand in either zone
    assert orders.hop_for_gain(fixed, offers, T0, move_s=MOVE_S) is None
    market = state_with(["us-east-1a"] * 2)
    market.target = 2
    market.spec.spot.instance_types[0].spot_price = None
    market.spot_prices = {"p3.2xlarge@us-east-1b": 0.1}  # (as find_offers books them)
    moved = orders.hop_for_gain(market, offers, T0, move_s=MOVE_S)
    assert moved is not None and moved.to == "us-east-1b"
    market.deadline = DeadlineState(due=T0, mode="on-demand")  # buys no spot: no gain
    assert orders.hop_for_gain(market, offers, T0, move_s=MOVE_S) is None
    market.deadline = None
    market.held = True  # parked ranks hold the state
    assert orders.hop_for_gain(market, offers, T0, move_s=MOVE_S) is None
    market.running = True  # ... no longer: the generation they formed runs, and checkpoints
    assert orders.hop_for_gain(market, offers, T0, move_s=MOVE_S) is not None
    lone = state_with(["us-east-1a"])  # below min 2: hop_to's case, not this one
    assert orders.hop_for_gain(lone, offers, T0, move_s=MOVE_S) is None


class PricedCloud(SimulatedCloud):
    """Capacity and the spot price per zone, each a function of time (`market`: zone, when
    -> (nodes, USD/h))."""

    def __init__(self, market: Callable[[str, datetime], tuple[int, float]]) -> None:
        super().__init__(capacity=lambda _t, zone, when: market(zone, when)[0])
        self.market = market

    @activity.defn(name=contract.FIND_OFFERS)
    def find_offers(self, policy: SpotPolicy) -> list[Offer]:
        now = activity.info().current_attempt_scheduled_time
        return [
            o.model_copy(update={"price": self.market(o.zone, now)[1]})
            for o in super().find_offers(policy)
        ]


def market_spec(total_steps: int) -> dict[str, Any]:
    """Billed at the market's price (no spot_price in the spec), min 2 and max 4, spot only."""
    spec = job_spec(total_steps=total_steps, on_demand={"fallback": False})
    spec["spot"]["instance_types"] = [{"name": "p3.2xlarge", "gpus": 1, "on_demand_price": OD}]
    return spec


def hops_of(result: JobResult) -> list[TimelineEntry]:
    return [e for e in result.timeline if e.event == "zone hop"]


async def test_a_job_that_can_train_hops_for_more_nodes_for_less_but_not_within_the_hold_down(
    ts_env: WorkflowEnvironment,
) -> None:
    """Zone a gives 2 nodes at 0.97 (min 2, max 4); after 20 minutes zone b gives plenty at
    0.5: the job trains at 2, so hop_to would keep it, but the move pays, and at the next
    capacity check it checkpoints, leaves a and trains at 4 in b. Ten minutes later a gives
    plenty at 0.1: that pays too, but only once 30 minutes have passed since the first hop.
    (Progress reports every 5 minutes keep the history in one run, recorded whole.)"""
    t0 = await ts_env.get_current_time()
    opens = t0 + timedelta(minutes=20)

    def market(zone: str, when: datetime) -> tuple[int, float]:
        if zone == "us-east-1a":
            return (99, 0.1) if when >= opens + timedelta(minutes=10) else (2, 0.97)
        return (99, 0.5) if when >= opens else (0, 0.5)

    cloud = PricedCloud(market)
    spec = market_spec(total_steps=12_000)
    spec["elastic"]["progress_report_interval_s"] = 300
    async with simulated(ts_env.client, cloud=cloud) as sim:
        handle = await sim.start(spec)
        result = await asyncio.wait_for(handle.result(), 300)
        await record_history(handle, "hops_that_pay")  # (patch hops-that-pay)
    assert result.phase == "Succeeded" and result.steps_done == 12_000
    assert result.continued_as_new == 0
    first, second = hops_of(result)
    assert result.hops == 2 and result.steps_lost == 0  # (each hop checkpointed first)
    assert first.detail.startswith(
        "to us-east-1b: us-east-1b offers 4 node(s) at $0.500/h against 2 at $0.970/h"
    )
    check = timedelta(seconds=120)  # capacity_check_interval_s
    assert opens <= first.time <= opens + 2 * check
    assert second.detail.startswith("to us-east-1a: us-east-1a offers 4 node(s) at $0.100/h")
    hold = locality.HOP_HOLD_DOWN
    assert first.time + hold <= second.time <= first.time + hold + 2 * check
    zones = [n.zone for n in cloud.launches]
    assert zones == ["us-east-1a"] * 2 + ["us-east-1b"] * 4 + ["us-east-1a"] * 4, zones
    assert cloud.running() == []


async def test_a_job_hops_only_for_the_nodes_the_other_zone_has_room_for(
    ts_env: WorkflowEnvironment,
) -> None:
    """Zone a gives 2 nodes at 0.97 (min 2, max 4). From minute 20 zone b offers at 0.5 with
    room for 1 node: taken to give all 4, as a zone that states nothing is, that looked like
    4 nodes for less, and the job would have left 2 nodes to wait on 1. It stays. From
    minute 60 b has room for 3: 3 for less pays, and it trains at 3 in b."""
    t0 = await ts_env.get_current_time()

    def market(zone: str, when: datetime) -> tuple[int, float]:
        if zone == "us-east-1a":
            return 2, 0.97
        if when >= t0 + timedelta(minutes=60):
            return 3, 0.5
        return (1 if when >= t0 + timedelta(minutes=20) else 0), 0.5

    cloud = PricedCloud(market)
    async with simulated(ts_env.client, cloud=cloud) as sim:
        result = await asyncio.wait_for((await sim.start(market_spec(14_400))).result(), 300)
    assert result.phase == "Succeeded" and result.steps_done == 14_400
    (hopped,) = hops_of(result)
    assert hopped.detail.startswith("to us-east-1b: us-east-1b offers 3 node(s) at $0.500/h")
    check = timedelta(seconds=120)  # capacity_check_interval_s
    assert t0 + timedelta(minutes=60) <= hopped.time <= t0 + timedelta(minutes=60) + 2 * check
    zones = [n.zone for n in cloud.launches]
    assert zones == ["us-east-1a"] * 2 + ["us-east-1b"] * 3, zones
    assert cloud.running() == []


async def test_a_job_does_not_hop_for_a_gain_below_the_minimum(
    ts_env: WorkflowEnvironment,
) -> None:
    """At 4 of 4 in zone a at 0.97, zone b offers from minute 10 at 0.75: over 2 h that
    saves 1.76 USD against a move of about 0.8, less than the minimum (0.25 x 2 h x 4 x
    0.97 = 1.94). The job stays in a."""
    t0 = await ts_env.get_current_time()

    def market(zone: str, when: datetime) -> tuple[int, float]:
        if zone == "us-east-1a":
            return 4, 0.97
        return (99, 0.75) if when >= t0 + timedelta(minutes=10) else (0, 0.75)

    cloud = PricedCloud(market)
    async with simulated(ts_env.client, cloud=cloud) as sim:
        result = await asyncio.wait_for((await sim.start(market_spec(14_400))).result(), 300)
    assert result.phase == "Succeeded" and result.hops == 0 and hops_of(result) == []
    assert {n.zone for n in cloud.launches} == {"us-east-1a"}


async def test_a_capacity_check_looks_up_the_offers_once(ts_env: WorkflowEnvironment) -> None:
    """Zone a has room for 3 nodes for its first 20 minutes, then plenty; b none. The job
    trains at 3 and, each check, weighs a hop and grows: both from the one look-up of the
    offers (they asked twice, and a third time to place the growth: an activity and its
    events each)."""
    t0 = await ts_env.get_current_time()

    def market(zone: str, when: datetime) -> tuple[int, float]:
        if zone == "us-east-1a":
            return (99 if when >= t0 + timedelta(minutes=20) else 3), 0.97
        return 0, 0.97

    cloud = PricedCloud(market)
    spec = market_spec(total_steps=12_000)
    spec["elastic"]["progress_report_interval_s"] = 300  # (one run: its history whole)
    async with simulated(ts_env.client, cloud=cloud) as sim:
        handle = await sim.start(spec)
        result = await asyncio.wait_for(handle.result(), 300)
        events = [e async for e in handle.fetch_history_events()]
        await record_history(handle, "offers_once_a_check")  # (patch hops-that-pay)
    assert result.phase == "Succeeded" and result.hops == 0 and result.continued_as_new == 0
    assert len(cloud.launches) == 4  # 3, then (once a has room) the 4th
    looked_up, checks = 0, 0
    for e in events:  # each capacity check starts with describe_nodes
        name = e.activity_task_scheduled_event_attributes.activity_type.name
        if name == contract.DESCRIBE_NODES:
            checks += 1
            looked_up = 0
        elif name == contract.FIND_OFFERS:
            looked_up += 1
            assert looked_up == 1 or checks == 0, f"offers looked up twice in check {checks}"
    assert checks >= 10


def gather(zones: list[str], **changes: object) -> locality.Hop | None:
    args: dict[str, object] = {
        "zones": zones,
        "prices": [0.97] * len(zones),
        "crossing_usd_h": 10.0,
        "worth_h": OD,
        "move_s": MOVE_S,
        "offers": offers_of({"za": 0.97, "zb": 0.97}),
        "dry": {},
        "regions": [],
        "last_hop": None,
        "now": T0,
    }
    return locality.gather_to(**with_market(args, changes))  # type: ignore[arg-type]


def test_a_job_spread_over_zones_gathers_where_most_of_it_is_when_that_pays() -> None:
    """a a b b at 10 USD/h across zones: over 2 h the ring costs 20, the move 0.82, the minimum
    0.25 x 2 h x (3.88 + 10) = 6.94; it gathers in za, the first zone that holds most."""
    moved = gather(["za", "za", "zb", "zb"])
    assert moved is not None and moved.to == "za"
    assert moved.why.startswith("2 of 4 node(s) outside za, the ring across zones $10.00/h")
    assert gather(["zb", "za", "zb"]).to == "zb"  # type: ignore[union-attr]
    assert gather(["za", "za", "zb", "zb"], crossing_usd_h=1.0) is None  # gain 2 - 0.82 < 2.19
    assert gather(["za"] * 4) is None  # one zone already
    full = gather(["za", "za", "zb"], offers=offers_of({"zb": 0.97}))  # za has no room
    assert full is not None and full.to == "zb"
    assert gather(["za", "za", "zb"], offers=offers_of({"zc": 0.97})) is None  # nor zb
    dry = {locality.pool_key("p3.2xlarge", "za"): T0}  # za found empty: zb is the one
    assert gather(["za", "za", "zb"], dry=dry).to == "zb"  # type: ignore[union-attr]
    just = T0 - locality.HOP_HOLD_DOWN + timedelta(seconds=1)
    assert gather(["za", "za", "zb"], last_hop=just) is None


@given(
    zones=st.lists(st.sampled_from(["za", "zb", "zc"]), min_size=1, max_size=8),
    crossing=st.floats(0.0, 100.0),
    market=market_strategy,
)
def test_gathering_goes_only_where_most_of_the_job_is_and_ends_the_crossing(
    zones: list[str], crossing: float, market: dict[str, float]
) -> None:
    """It gathers a job in a zone it is in, that offers, and that holds no fewer of its
    nodes than another such zone; once gathered (no crossing) the rule never moves it."""
    moved = gather(zones, crossing_usd_h=crossing, offers=offers_of(market))
    if moved is not None:
        assert zones.count(moved.to) == max(zones.count(z) for z in zones if z in market)
        assert len(set(zones)) > 1 and moved.to in market
        there = [moved.to] * len(zones)
        assert gather(there, crossing_usd_h=0.0, offers=offers_of(market)) is None


async def test_a_spanning_job_gathers_in_one_zone_again_when_it_has_room(
    ts_env: WorkflowEnvironment,
) -> None:
    """`placement: any`, 100M parameters: zone a gives 2 nodes; zone b 2 for 20 minutes,
    then plenty. The job fills a, spills into b (a a b b: 1.2 GB across zones a step, about
    USD 350 an hour at 4 x 3,600 steps), and once b has room it checkpoints, leaves a and
    trains at 4 in b (patch spanning-jobs-gather): no byte crosses after that."""
    t0 = await ts_env.get_current_time()
    room = t0 + timedelta(minutes=20)

    def capacity(_t: str, zone: str, when: datetime) -> int:
        return 2 if zone == "us-east-1a" or when < room else 99

    cloud = SimulatedCloud(capacity=capacity)
    spec = job_spec(gradient_bytes=G, placement="any", total_steps=12_000)
    spec["elastic"]["progress_report_interval_s"] = 300  # (one run, recorded whole)
    async with simulated(ts_env.client, cloud=cloud) as sim:
        handle = await sim.start(spec)
        result = await asyncio.wait_for(handle.result(), 300)
        await record_history(handle, "spanning_gathers")  # (patch spanning-jobs-gather)
    assert result.phase == "Succeeded" and result.steps_done == 12_000
    assert result.continued_as_new == 0 and result.steps_lost == 0
    (moved,) = hops_of(result)
    assert moved.detail.startswith("to us-east-1b: 2 of 4 node(s) outside us-east-1b")
    assert room <= moved.time <= room + timedelta(seconds=2 * 120)
    a, b = "us-east-1a", "us-east-1b"
    assert [n.zone for n in cloud.launches] == [a, a, b, b, b, b]
    split_s = (moved.time - t0).total_seconds()
    assert 0 < result.transfer.zone_gb <= split_s * 4 * 1.2  # (at most 4 steps a second)
    assert cloud.running() == []


def test_orders_gather_a_running_split_job_at_the_pace_last_seen() -> None:
    """The ring's traffic an hour is a step's crossing at the pace between the last two
    progress reports: none known yet (or no gradient size), no gathering."""
    a, b = "us-east-1a", "us-east-1b"
    s = state_with([a, a, b, b], gradient_bytes=G, placement="any")
    s.members, s.running = [0, 1, 2, 3], True
    offers = [Offer(instance_type="p3.2xlarge", zone=a, price=0.97)]
    assert orders.gathering(s, offers, T0, move_s=MOVE_S) is None  # no pace seen yet
    s.progress_at, s.step = T0, 100
    seen = WatchResult(outcome="progress", step=100 + 3_600)
    s.note_progress(seen, T0 + timedelta(minutes=15))
    assert s.steps_per_hour == pytest.approx(14_400)
    moved = orders.gathering(s, offers, T0, move_s=MOVE_S)
    assert moved is not None and moved.to == a and "$345.60/h" in moved.why  # 1.2 GB x 0.02
    s.spec.gradient_bytes = None
    assert orders.gathering(s, offers, T0, move_s=MOVE_S) is None
