"""Where a job's nodes may be, and what a ring across zones costs: pure functions.

A data-parallel job all-reduces its gradients every step. Across zones every byte is billed
(EC2: USD 0.01/GB in each direction, so 0.02 per GB that crosses) and the ring runs at the
pace of its slowest link, so by default (`placement: zone`) a job keeps every node in one zone,
its home. The home is where its live nodes are; a job with none picks the zone whose spot
offers look best (placement score, then how many pools, then price). `region` keeps it in one
region, and `any` lets it go wherever spot is best, paying for the bytes.

A job whose home cannot give it `min_nodes` hops: the idle nodes it holds there go, and it
buys in the zone that can serve (`hop_to`); a pool where a launch found no capacity counts as
offering nothing for `DRY_FOR`. It hops at most once per `HOP_HOLD_DOWN`, so a
flickering market cannot make it flap, and never while ranks hold its state in memory.
A job that can train hops too, when another zone pays for the move (`hop_for_gain`), for the
nodes that zone can give (`gives`: its pools' stated capacity where the provider states it),
and a job spread over zones gathers in one when that pays (`gather_to`): both weigh the move
the same way (`weigh_move`): what the job's nodes yield an hour here and there, valued at
the on-demand price, over `HOP_HORIZON`, against the time the move trains nothing, with a
minimum gain (`HOP_MIN_GAIN`) and the same hold-down.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from spotrain.workflows.contract import Offer
from spotrain.workflows.spec import Placement

# EC2's data transfer prices (aws.amazon.com/ec2/pricing/on-demand, "Data Transfer"): between
# zones of a region USD 0.01/GB out of one and 0.01/GB into the other; between US regions
# USD 0.02/GB out (in is free).
CROSS_ZONE_USD_PER_GB = 0.02
CROSS_REGION_USD_PER_GB = 0.02
HOP_HOLD_DOWN = timedelta(minutes=30)
# A pool where a launch found no capacity is left out this long: EC2's offers come from price
# history, which lists a pool whether or not it has capacity, and a job kept in one zone would
# otherwise try the same empty pools for ever instead of hopping.
DRY_FOR = timedelta(minutes=10)
GB = 1e9
# A job that can train hops when the move pays within this long: about as long as a spot
# market's prices and capacity hold (they move within hours), so a better zone is not
# counted on for longer than it is likely to stay better.
HOP_HORIZON = timedelta(hours=2)
# ... and only by at least this share of what its nodes would cost it over the horizon by
# staying: room for what the rule cannot see (a zone that offers may not give every node).
HOP_MIN_GAIN = 0.25


def region_of(zone: str, regions: Sequence[str]) -> str:
    """A zone's region: the longest of `regions` its name starts with (us-west-2-lax-1a is
    in us-west-2), else the name less its last letter."""
    owners = [r for r in regions if zone.startswith(r)]
    return max(owners, key=len) if owners else zone[:-1]


def unit_of(zone: str, placement: Placement, regions: Sequence[str]) -> str:
    """What `placement` keeps a job inside: the zone itself, or its region."""
    return region_of(zone, regions) if placement == "region" else zone


def home_zone(held: Sequence[str], offers: Sequence[Offer]) -> str | None:
    """The zone the job stays in: where most of its live nodes are (`held`, in slot order;
    a tie goes to the earliest), else the zone whose offers look best; None: nowhere yet."""
    if held:
        counts = Counter(held)
        most = max(counts.values())
        return next(z for z in held if counts[z] == most)
    zones = {o.zone for o in offers if o.zone}
    if not zones:
        return None
    return min(zones, key=lambda z: _zone_rank(z, offers))


def _zone_rank(zone: str, offers: Sequence[Offer]) -> tuple[float, int, float, str]:
    """Best first: placement score (likelihood of capacity), pools offered, cheapest price."""
    mine = [o for o in offers if o.zone == zone]
    score = max((o.score or 0.0 for o in mine), default=0.0)
    return (-score, -len(mine), min(o.price for o in mine), zone)


def placed(
    offers: list[Offer], placement: Placement, home: str | None, regions: Sequence[str]
) -> list[Offer]:
    """The offers a job may buy from: those in its home's zone or region (an offer of no zone,
    "Karpenter's pick", is pinned to the home zone), all of them for `any` or no home yet."""
    if placement == "any" or home is None:
        return offers
    unit = unit_of(home, placement, regions)
    inside = []
    for o in offers:
        if not o.zone and placement == "zone":
            inside.append(o.model_copy(update={"zone": home}))
        elif not o.zone or unit_of(o.zone, placement, regions) == unit:
            inside.append(o)
    return inside


def pool_key(instance_type: str, zone: str) -> str:
    return f"{instance_type}@{zone}"


def fresh(offers: list[Offer], dry: dict[str, datetime], now: datetime) -> list[Offer]:
    """The offers less the pools a launch found empty within `DRY_FOR` (`dry`: pool_key ->
    when)."""
    return [
        o
        for o in offers
        if now - dry.get(pool_key(o.instance_type, o.zone), now - DRY_FOR) >= DRY_FOR
    ]


def still_dry(dry: dict[str, datetime], now: datetime) -> dict[str, datetime]:
    """`dry` less what has aged out (so the job's state stays small)."""
    return {k: t for k, t in dry.items() if now - t < DRY_FOR}


@dataclass(frozen=True)
class Market:
    """What every move is weighed in (`hop_to`, `hop_for_gain`, `gather_to`): the spot
    offers, the pools a launch found empty (`dry`: pool_key -> when), the regions zones are
    named under, when the job last moved (None: never) and now."""

    offers: list[Offer]
    dry: dict[str, datetime]
    regions: Sequence[str]
    last_hop: datetime | None
    now: datetime

    @property
    def held_down(self) -> bool:
        """Within `HOP_HOLD_DOWN` of the last move, so a flickering market cannot make a job
        flap."""
        return self.last_hop is not None and self.now - self.last_hop < HOP_HOLD_DOWN

    @property
    def offered(self) -> list[Offer]:
        """The offers less the pools found dry (`fresh`)."""
        return fresh(self.offers, self.dry, self.now)


@dataclass(frozen=True)
class Hop:
    to: str  # the zone to buy in
    why: str


def hop_to(
    *,
    placement: Placement,
    home: str | None,
    held: int,
    min_nodes: int,
    state_in_memory: bool,
    market: Market,
) -> Hop | None:
    """Move the job when its home cannot give it `min_nodes`: it holds fewer (`held` live
    nodes), and its zone or region offers no spot pool now that is not dry, or its pools
    state they cannot make up the rest (`gives`), and another can give more. Not while held
    down (`Market.held_down`), and not while parked ranks hold the state (leaving would
    throw it away)."""
    if placement == "any" or home is None or state_in_memory or market.held_down:
        return None
    regions = market.regions
    here = unit_of(home, placement, regions)
    home_offers = fresh(placed(market.offers, placement, home, regions), market.dry, market.now)
    at_home = held + gives(home_offers, max(min_nodes - held, 0)).nodes
    away = [o for o in market.offered if o.zone and unit_of(o.zone, placement, regions) != here]
    can = {z: gives([o for o in away if o.zone == z], min_nodes).nodes for z in zones(away)}
    # Zones count up to min_nodes: a job that holds them, or whose home offers what it
    # lacks (where its pools say so), waits.
    if not can or max(can.values()) <= at_home:
        return None
    to = min((z for z in can if can[z] == max(can.values())), key=lambda z: _zone_rank(z, away))
    where = "region" if placement == "region" else "zone"
    home_gives = (
        f"can give {at_home} of min {min_nodes}"
        if at_home > held
        else f"offers no spot and it holds {held} of min {min_nodes} node(s)"
    )
    return Hop(
        to=to,
        why=f"its {where} {here} {home_gives}; {unit_of(to, placement, regions)} offers",
    )


@dataclass(frozen=True)
class Stay:
    """A job in a zone (or region): how many nodes, at what USD per node-hour."""

    nodes: int
    price_h: float


@dataclass(frozen=True)
class Weighed:
    """A move over `HOP_HORIZON`, in USD: it pays when its gain less its cost is more than
    `floor` (`HOP_MIN_GAIN` of the nodes' cost by staying)."""

    gain_usd: float
    cost_usd: float
    floor_usd: float

    @property
    def pays(self) -> bool:
        return self.gain_usd - self.cost_usd > self.floor_usd

    def describe(self) -> str:
        sign = ">" if self.pays else "<="
        return (
            f"gain ${self.gain_usd:.2f} - move ${self.cost_usd:.2f} {sign} "
            f"min ${self.floor_usd:.2f} over {HOP_HORIZON.total_seconds() / 3600:g} h"
        )


def weigh_move(stay: Stay, go: Stay, *, worth_h: float, move_s: float) -> Weighed:
    """A node-hour of training is worth `worth_h` (its on-demand price: what the work would
    cost without spot), so an hour in a zone yields nodes x (worth - price). The gain is the
    difference between the two zones over the horizon: more nodes (throughput, if steps scale
    with them), a lower price, or both. The move costs `move_s` (a checkpoint, a boot, a
    restart) with the new nodes billed and nothing trained: move_s x nodes x worth. The
    checkpoint comes first, so no step is lost."""
    hours = HOP_HORIZON.total_seconds() / 3600
    yields = go.nodes * (worth_h - go.price_h) - stay.nodes * (worth_h - stay.price_h)
    return Weighed(
        gain_usd=hours * yields,
        cost_usd=move_s / 3600 * go.nodes * worth_h,
        floor_usd=HOP_MIN_GAIN * hours * stay.nodes * stay.price_h,
    )


def zones(offers: Sequence[Offer]) -> list[str]:
    """The zones `offers` name, in the order they first appear."""
    return list(dict.fromkeys(o.zone for o in offers if o.zone))


def gives(offers: Sequence[Offer], wants: int) -> Stay:
    """What `offers` give a job that wants `wants` nodes, bought cheapest first: each pool
    as many as its stated capacity, a pool that states none all that are left (EC2's price
    history lists a pool whatever it holds), at their mean price. Stay(0, 0.0): nothing."""
    nodes, cost = 0, 0.0
    for o in sorted(offers, key=lambda o: o.price):
        take = wants - nodes if o.capacity is None else min(o.capacity, wants - nodes)
        nodes, cost = nodes + take, cost + take * o.price
    return Stay(nodes, cost / nodes if nodes else 0.0)


def hop_for_gain(
    *,
    placement: Placement,
    home: str,
    stay: Stay,
    wants: int,
    min_nodes: int,
    worth_h: float,
    move_s: float,
    market: Market,
) -> Hop | None:
    """Move a job that can train (`stay`: its nodes at home) to the zone (or region) whose
    move pays most (`weigh_move`), if any pays. Each other zone (or region) that offers spot
    (not dry) is taken to give what its pools can of the `wants` nodes the job would hold
    (`gives`), at the prices the job would be billed; one that cannot give `min_nodes` is no
    place to train. Its home, if it still offers, gives the nodes the job holds and what its
    pools can add, at the price it pays now or its own cheapest offer's, whichever is lower (a
    job that holds a mix of types must not move for a price its home offers too: it would buy
    the same mix there and move again). Not while held down."""
    if placement == "any" or market.held_down:
        return None
    regions = market.regions
    # Home counts as able to give them even while a launch there found no capacity (dry):
    # a job that can train waits that out rather than hop for nodes no zone has shown it
    # can give (a job short of min_nodes hops by `hop_to`).
    if at_home := placed(market.offers, placement, home, regions):
        more = gives(at_home, max(wants - stay.nodes, 0)).nodes
        cheapest = min(o.price for o in at_home)
        stay = Stay(stay.nodes + more, min(stay.price_h, cheapest))
    here = unit_of(home, placement, regions)
    offered = market.offered
    units: dict[str, list[Offer]] = {}
    for o in offered:
        if o.zone and (unit := unit_of(o.zone, placement, regions)) != here:
            units.setdefault(unit, []).append(o)
    # Each unit goes to its cheapest offer's zone, the units weighed in the order of those
    # offers: of two that pay the same, the first offered wins.
    firsts = {id(min(offers, key=lambda o: o.price)): unit for unit, offers in units.items()}
    best: tuple[float, Offer, Stay, Weighed] | None = None
    for o in offered:
        if (unit := firsts.get(id(o))) is None:
            continue
        go = gives(units[unit], wants)
        if go.nodes < min_nodes:
            continue
        w = weigh_move(stay, go, worth_h=worth_h, move_s=move_s)
        net = w.gain_usd - w.cost_usd
        if w.pays and (best is None or net > best[0]):
            best = (net, o, go, w)
    if best is None:
        return None
    _, o, go, w = best
    return Hop(
        to=o.zone,
        why=f"{unit_of(o.zone, placement, regions)} offers {go.nodes} node(s) at "
        f"${go.price_h:.3f}/h against {stay.nodes} at ${stay.price_h:.3f}/h in {here}: "
        f"{w.describe()}",
    )


def gather_to(
    *,
    zones: Sequence[str],
    prices: Sequence[float],
    crossing_usd_h: float,
    worth_h: float,
    move_s: float,
    market: Market,
) -> Hop | None:
    """A job spread over zones (`placement: any`; its members' `zones` and `prices`) gathers
    in one: of the zones it is in that offer spot (not dry), the one that holds most of
    its members, when the move pays (`weigh_move`, the same rule as a hop): staying, a
    node-hour costs its price plus its share of the ring's traffic across zones
    (`crossing_usd_h`); gathered, the nodes from other zones are bought there at its
    cheapest offer. Not while held down."""
    if len(set(zones)) < 2 or market.held_down:
        return None
    offered = market.offered
    home = home_zone([z for z in zones if any(o.zone == z for o in offered)], [])
    if home is None:
        return None
    there = [o.price for o in offered if o.zone == home]
    n = len(zones)
    stay = Stay(n, (sum(prices) + crossing_usd_h) / n)
    gathered = [p if z == home else min(there) for z, p in zip(zones, prices, strict=True)]
    w = weigh_move(stay, Stay(n, sum(gathered) / n), worth_h=worth_h, move_s=move_s)
    if not w.pays:
        return None
    away = n - list(zones).count(home)
    return Hop(
        to=home,
        why=f"{away} of {n} node(s) outside {home}, the ring across zones ${crossing_usd_h:.2f}/h, "
        f"and {home} offers spot: {w.describe()}",
    )


def grouped_by_zone(order: Sequence[int], zone_of: Mapping[int, str]) -> list[int]:
    """`order` (slots in rank order) with each zone's nodes side by side: zones in the order
    they first appear, nodes in their order within each. A ring over k zones then crosses on k
    links, not on nearly every link as nodes bought pool by pool interleave, and rank 0
    stays rank 0."""
    zones = list(dict.fromkeys(zone_of[m] for m in order))
    return [m for z in zones for m in order if zone_of[m] == z]


@dataclass(frozen=True)
class Crossing:
    """Bytes a step sends between nodes in different zones, and in different regions."""

    zone_gb: float = 0.0
    region_gb: float = 0.0

    @property
    def cost(self) -> float:
        """USD per step (a byte across regions pays the region rate, not both)."""
        return (self.zone_gb - self.region_gb) * CROSS_ZONE_USD_PER_GB + (
            self.region_gb * CROSS_REGION_USD_PER_GB
        )


def ring_crossing(zones: Sequence[str], gradient_bytes: int, regions: Sequence[str]) -> Crossing:
    """One step's all-reduce over a ring of nodes in rank order (`zones`, one per node): each
    of its N links carries 2(N-1)/N of the gradient bytes; those whose ends are in different
    zones cross (a ring that spans k zones crosses at least k times)."""
    n = len(zones)
    if n < 2:
        return Crossing()
    per_link = 2 * (n - 1) / n * gradient_bytes / GB
    links = [(zones[i], zones[(i + 1) % n]) for i in range(n)]
    across_zones = sum(1 for a, b in links if a != b)
    across_regions = sum(1 for a, b in links if region_of(a, regions) != region_of(b, regions))
    return Crossing(zone_gb=across_zones * per_link, region_gb=across_regions * per_link)
