"""Placement: a job's nodes stay in one zone (or region), it hops when its zone cannot serve
it, and a ring across zones is billed per byte (workflows/policies/locality.py)."""

from __future__ import annotations

import asyncio
import io
import re
from collections import Counter
from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.cli.report import Report, print_report
from spotrain.workflows.contract import Offer
from spotrain.workflows.job import orders
from spotrain.workflows.job.state import JobState, NodeRecord, NodeState
from spotrain.workflows.policies import locality
from spotrain.workflows.policies.locality import Crossing, hop_to, ring_crossing
from spotrain.workflows.spec import parse_spec
from tests.jobs import job_spec, record_history, simulated, skip

T0 = datetime(2026, 1, 1, tzinfo=UTC)
REGIONS = ["us-east-1", "us-west-2"]
G = 400_000_000  # 100M fp32 parameters' gradients


def offer(
    zone: str, itype: str = "p3.2xlarge", price: float = 1.0, score: float | None = None
) -> Offer:
    return Offer(instance_type=itype, zone=zone, price=price, score=score)


def test_home_is_where_most_live_nodes_are_else_the_best_offered_zone() -> None:
    assert locality.home_zone(["b", "a", "a"], [offer("c")]) == "a"
    assert locality.home_zone(["b", "a"], []) == "b"  # a tie: the earliest slot's
    # No node yet: the placement score first, then the number of pools, then the price.
    scored = [offer("a", score=3), offer("b", score=9)]
    assert locality.home_zone([], scored) == "b"
    pools = [offer("a"), offer("b"), offer("b", "g5.xlarge")]
    assert locality.home_zone([], pools) == "b"
    assert locality.home_zone([], [offer("a", price=2), offer("b", price=1)]) == "b"
    assert locality.home_zone([], []) is None
    assert locality.home_zone([], [offer("")]) is None  # (Karpenter's pick: no zone named)


def test_placed_keeps_the_offers_of_the_home_zone_or_region() -> None:
    offers = [offer("us-east-1a"), offer("us-east-1b"), offer("us-west-2a"), offer("")]
    zone = locality.placed(offers, "zone", "us-east-1a", REGIONS)
    assert [o.zone for o in zone] == ["us-east-1a", "us-east-1a"]  # "" pinned to the home
    region = locality.placed(offers, "region", "us-east-1b", REGIONS)
    assert [o.zone for o in region] == ["us-east-1a", "us-east-1b", ""]
    assert locality.placed(offers, "any", "us-east-1a", REGIONS) == offers
    assert locality.placed(offers, "zone", None, REGIONS) == offers  # no home yet
    assert locality.region_of("us-west-2-lax-1a", REGIONS) == "us-west-2"


MARKET_FIELDS = ("offers", "dry", "regions", "last_hop", "now")


def with_market(args: dict[str, object], changes: dict[str, object]) -> dict[str, object]:
    """`args | changes` with the market's fields (`locality.Market`) gathered into one."""
    merged = args | changes
    fields = {k: merged.pop(k) for k in MARKET_FIELDS if k in merged}
    return merged | {"market": locality.Market(**fields)}  # type: ignore[arg-type]


def hop(**changes: object) -> locality.Hop | None:
    args: dict[str, object] = {
        "placement": "zone",
        "home": "us-east-1a",
        "held": 1,
        "min_nodes": 2,
        "state_in_memory": False,
        "offers": [offer("us-east-1b")],
        "dry": {},
        "regions": REGIONS,
        "last_hop": None,
        "now": T0,
    }
    return hop_to(**with_market(args, changes))  # type: ignore[arg-type]


def test_a_job_hops_only_when_its_zone_cannot_give_it_min_nodes_and_another_can() -> None:
    moved = hop()
    assert moved is not None and moved.to == "us-east-1b"
    assert "us-east-1a offers no spot" in moved.why and "1 of min 2" in moved.why
    assert hop(held=2) is None  # it can train where it is
    assert hop(offers=[offer("us-east-1a"), offer("us-east-1b")]) is None  # home may serve
    found_empty = {locality.pool_key("p3.2xlarge", "us-east-1a"): T0}
    both = [offer("us-east-1a"), offer("us-east-1b")]
    assert hop(offers=both, dry=found_empty) is not None  # ... unless its pools are dry
    assert hop(offers=[]) is None  # nowhere better
    assert hop(state_in_memory=True) is None  # parked ranks hold the state
    assert hop(placement="any") is None
    region = hop(placement="region", offers=[offer("us-east-1b"), offer("us-west-2a")])
    assert region is None  # its region still offers
    assert hop(placement="region", offers=[offer("us-west-2a")]) is not None


def test_a_job_hops_when_its_zone_says_it_cannot_make_up_min_nodes_and_another_can() -> None:
    """Where pools state their capacity: home's room for 1 more leaves the job at 2 of min
    4, so it goes where the pools can give more, the zone that can give most first."""

    def room(zone: str, n: int | None) -> Offer:
        return offer(zone).model_copy(update={"capacity": n})

    short = {"held": 1, "min_nodes": 4}
    moved = hop(offers=[room("us-east-1a", 1), room("us-east-1b", 4)], **short)
    assert moved is not None and moved.to == "us-east-1b"
    assert "its zone us-east-1a can give 2 of min 4; us-east-1b offers" in moved.why
    assert hop(offers=[room("us-east-1a", 3), room("us-east-1b", 4)], **short) is None
    assert hop(offers=[room("us-east-1a", 1), room("us-east-1b", 2)], **short) is None
    assert hop(offers=[room("us-east-1a", None), room("us-east-1b", 4)], **short) is None
    # Home offers nothing: the zone that can give most, though b ranks first by name.
    most = hop(offers=[room("us-east-1b", 1), room("us-east-1c", 3)], **short)
    assert most is not None and most.to == "us-east-1c"
    assert hop(offers=[room("us-east-1b", 1)], held=2, min_nodes=4) is None  # no more there


def test_the_hold_down_keeps_a_flickering_market_from_making_a_job_flap() -> None:
    just = T0 - locality.HOP_HOLD_DOWN + timedelta(seconds=1)
    assert hop(last_hop=just) is None
    assert hop(last_hop=T0 - locality.HOP_HOLD_DOWN) is not None


def test_a_pool_found_empty_is_left_out_for_a_while() -> None:
    offers = [offer("a"), offer("b")]
    dry = {locality.pool_key("p3.2xlarge", "a"): T0}
    assert locality.fresh(offers, dry, T0 + timedelta(minutes=9)) == offers[1:]
    assert locality.fresh(offers, dry, T0 + locality.DRY_FOR) == offers
    assert locality.still_dry(dry, T0 + locality.DRY_FOR) == {}
    assert locality.still_dry(dry, T0) == dry


def test_ranks_go_zone_by_zone_keeping_rank_0_and_each_zones_order() -> None:
    zone_of = {0: "b", 1: "a", 2: "b", 3: "a", 4: "c", 5: "a"}
    assert locality.grouped_by_zone([0, 1, 2, 3, 4, 5], zone_of) == [0, 2, 1, 3, 5, 4]
    assert locality.grouped_by_zone([3, 1], zone_of) == [3, 1]
    zones = [zone_of[m] for m in locality.grouped_by_zone(list(zone_of), zone_of)]
    assert (
        ring_crossing(zones, G, REGIONS).zone_gb
        < ring_crossing(list(zone_of.values()), G, REGIONS).zone_gb
    )


def test_a_ring_bills_the_links_that_cross_zones_and_regions() -> None:
    assert ring_crossing(["a", "a", "a"], G, REGIONS) == Crossing()
    assert ring_crossing(["us-east-1a"], G, REGIONS) == Crossing()
    per_link = 2 * 3 / 4 * G / 1e9  # 0.6 GB on each of a 4-ring's links
    grouped = ring_crossing(["us-east-1a", "us-east-1a", "us-east-1b", "us-east-1b"], G, REGIONS)
    assert grouped.zone_gb == pytest.approx(2 * per_link) and grouped.region_gb == 0
    assert grouped.cost == pytest.approx(2 * per_link * locality.CROSS_ZONE_USD_PER_GB)
    mixed = ring_crossing(["us-east-1a", "us-east-1b"] * 2, G, REGIONS)
    assert mixed.zone_gb == pytest.approx(4 * per_link)  # rank order decides the crossings
    far = ring_crossing(["us-east-1a", "us-east-1a", "us-west-2a", "us-west-2a"], G, REGIONS)
    assert far.region_gb == far.zone_gb == pytest.approx(2 * per_link)
    assert far.cost == pytest.approx(2 * per_link * locality.CROSS_REGION_USD_PER_GB)


def state_with(zones: list[str], **spec: object) -> JobState:
    s = JobState.new(parse_spec(job_spec(**spec)))
    s.nodes = [
        NodeRecord(
            slot=i,
            lifecycle="spot",
            instance_type="p3.2xlarge",
            zone=z,
            state=NodeState.READY,
            procs=1,
            price=1.0,
            on_demand_price=3.06,
        )
        for i, z in enumerate(zones)
    ]
    return s


def test_orders_follow_the_home_zone_and_a_hop_moves_it() -> None:
    offers = [offer("us-east-1a"), offer("us-east-1b")]
    s = state_with(["us-east-1b"])
    where = orders.placed(s, offers, "zone", T0, launching=False)
    assert where.home == "us-east-1b" and [o.zone for o in where.offers] == ["us-east-1b"]
    assert where.hop is None
    assert orders.placed(s, offers, "any", T0, launching=False).offers == offers
    lone = state_with(["us-east-1b"])  # below min 2, and its zone offers nothing now
    moved = orders.placed(lone, offers[:1], "zone", T0, launching=False)
    assert moved.hop is not None and moved.home == "us-east-1a"
    assert orders.placed(lone, offers[:1], "zone", T0, launching=True).hop is None
    lone.running = True  # (a generation runs only at min or more: never hop from under it)
    assert orders.placed(lone, offers[:1], "zone", T0, launching=False).hop is None
    lone.owed = 1  # spot short at home: its on-demand fallback goes there too
    fallback = orders.spot_orders(lone, [], 1, Counter(), spot_only=False, home="us-east-1b")
    assert [(o.lifecycle, o.zone) for o in fallback.orders] == [("on-demand", "us-east-1b")]


async def test_a_job_stays_in_one_zone_and_any_spans_them_paying_for_the_bytes(
    ts_env: WorkflowEnvironment,
) -> None:
    """Zone a can give 2 nodes, zone b plenty. `placement: zone` trains at 2 in zone a
    rather than spread (2 spot, 2 on-demand fallback), then moves whole to b, where spot
    gives it all 4 (the patch hops-that-pay: the move pays); `any` fills zone a, spills
    into b and pays for every gradient byte that crosses (no capacity check in its 15
    minutes, so it does not gather in b: test_placement_hops.py). Ranked zone by zone (a a b b) its
    ring crosses on 2 links: 2 x 0.6 GB a step at 3,600 steps. (Before the patch
    spanning-jobs-fill-zones its nodes went pool by pool, a b a b, to the same count and rank
    order.)"""
    cloud = SimulatedCloud(capacity=lambda _t, zone, _w: 2 if zone == "us-east-1a" else 99)
    async with simulated(ts_env.client, cloud=cloud) as sim:
        kept = await (await sim.start(job_spec(gradient_bytes=G))).result()
        spread = job_spec(gradient_bytes=G, placement="any", total_steps=3_600)
        spread["elastic"]["capacity_check_interval_s"] = 3_600  # (no check: it stays split)
        handle = await sim.start(spread)
        spanned = await handle.result()
        await record_history(handle, "zone_grouped_ranks")  # (patch zone-grouped-ranks)
    assert kept.phase == spanned.phase == "Succeeded"
    kept_zones = [(n.lifecycle, n.zone) for n in cloud.launches if n.job == kept.name]
    a, b = "us-east-1a", "us-east-1b"  # in a: its on-demand fallback too, then 4 spot in b
    assert kept_zones == [("spot", a)] * 2 + [("on-demand", a)] * 2 + [("spot", b)] * 4
    assert kept.hops == 1 and kept.transfer.zone_gb == 0
    assert {n.zone for n in cloud.launches if n.job == spanned.name} == {
        "us-east-1a",
        "us-east-1b",
    }
    launched = [n.zone for n in cloud.launches if n.job == spanned.name]
    assert Counter(launched) == {"us-east-1a": 2, "us-east-1b": 2}  # (bought pool by pool)
    assert spanned.transfer.zone_gb == pytest.approx(3_600 * 2 * 0.6, rel=1e-6)
    assert spanned.transfer.cost == pytest.approx(spanned.transfer.zone_gb * 0.02, rel=1e-6)
    nodes = sum(spanned.cost.values())
    assert spanned.total_cost == pytest.approx(nodes + spanned.transfer.cost, abs=1e-5)
    console = Console(file=io.StringIO(), width=200)  # `spotrain report`'s cost table
    print_report(Report.from_result(spanned), console)
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    usd = re.escape(f"${spanned.transfer.cost:,.2f}")
    assert re.search(rf"across zones\s*│\s*4,320.0 GB\s*│\s*{usd}", shown), shown


async def test_a_job_that_may_span_zones_keeps_to_one_while_it_has_capacity(
    ts_env: WorkflowEnvironment,
) -> None:
    """Both zones give plenty: `placement: any` buys all 4 nodes in one zone (spread over
    zones, each step's ring would cross them, billed per byte) and pays no transfer."""
    cloud = SimulatedCloud(capacity=lambda _t, _zone, _w: 99)
    async with simulated(ts_env.client, cloud=cloud) as sim:
        handle = await sim.start(job_spec(gradient_bytes=G, placement="any", total_steps=600))
        result = await handle.result()
        await record_history(handle, "spanning_fills_zones")  # (patch spanning-jobs-fill-zones)
    assert result.phase == "Succeeded"
    launched = [n.zone for n in cloud.launches]
    assert len(launched) == 4 and len(set(launched)) == 1, launched
    assert result.transfer.zone_gb == 0 and result.transfer.cost == 0


async def test_a_job_whose_zone_runs_dry_hops_to_one_that_serves(
    ts_env: WorkflowEnvironment,
) -> None:
    """Min 2 nodes, zone a only at first. After an hour zone a has none and one of the job's
    nodes there is reclaimed: it holds 1 of min 2 with nothing offered at home, so it hops,
    releasing the idle node, and finishes in zone b."""
    t0 = await ts_env.get_current_time()
    dry = t0 + timedelta(hours=1)

    def capacity(_t: str, zone: str, when: datetime) -> int:
        return (4 if when < dry else 0) if zone == "us-east-1a" else (99 if when >= dry else 0)

    cloud = SimulatedCloud(capacity=capacity)
    async with simulated(ts_env.client, cloud=cloud) as sim:
        spec = job_spec(on_demand={"fallback": False}, elastic={"max_nodes": 2})
        handle = await sim.start(spec)
        await skip(ts_env, 3700)
        victim = cloud.running(spec["name"])[0]
        cloud.reclaim(victim.node_id)
        await handle.signal("node_lost", {"node_id": victim.node_id, "event_id": "lost-1"})
        result = await asyncio.wait_for(handle.result(), 120)  # (no hop: it waits for ever)
        await record_history(handle, "zone_hop")
    assert result.phase == "Succeeded" and result.steps_done == spec["total_steps"]
    hops = [e.detail for e in result.timeline if e.event == "zone hop"]
    assert len(hops) == result.hops == 1
    assert hops[0].startswith("to us-east-1b: its zone us-east-1a")
    zones = [n.zone for n in cloud.launches]
    assert zones[:2] == ["us-east-1a"] * 2 and set(zones[2:]) == {"us-east-1b"}
    assert cloud.running() == []
