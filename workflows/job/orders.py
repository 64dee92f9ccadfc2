"""What a job buys next, as pure functions over its state: each node's shape (GPUs and
processes, sized to the share it stands in for), its price, and the orders that close the
gap between the nodes held and the nodes allowed: base on-demand first, then spot in the
snuggest pools of the job's home zone (`placement`), then on-demand for what it is owed.
`capacity.fleet` places these orders; `job_planner` plans everything else.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from spotrain.workflows.contract import Lifecycle, Offer
from spotrain.workflows.job import planner
from spotrain.workflows.job.state import JobState, Phase
from spotrain.workflows.policies import deadline, locality, make_before_break
from spotrain.workflows.spec import JobSpec, Placement

Pool = tuple[str, str]  # (instance type, zone)

# --- the next node's shape ---------------------------------------------------------------------


def need(spec: JobSpec, held_procs: Iterable[int]) -> tuple[int, int]:
    """(GPUs, processes) of the next node ordered, given the processes of the live nodes.
    With `total_gpus`, the first share of the packing no live node holds yet (15 over
    {10, 8}: 10, then 5); a node beyond the packing (user scale-out) gets the largest shape."""
    if spec.total_gpus is None:
        return spec.gpus_per_node or 0, spec.gpus_per_node or spec.procs_per_node
    shapes = [t.gpus for t in spec.spot.instance_types]
    held = Counter(held_procs)
    for _, used in planner.pack_gpus(spec.total_gpus, shapes):
        if held[used]:
            held[used] -= 1
        else:
            return used, used
    return max(shapes), max(shapes)


def next_need(state: JobState) -> tuple[int, int]:
    return need(state.spec, (n.procs for n in state.nodes if n.alive))


def on_demand_type(spec: JobSpec, gpus: int) -> str:
    """An on-demand node sized to the share it stands in for: the cheapest type with `gpus`."""
    fits = [t for t in spec.spot.instance_types if t.gpus >= gpus]
    return min(fits, key=lambda t: t.on_demand_price).name


def on_demand_room(state: JobState) -> int:
    """How many more on-demand fallback nodes the policy (and the pool's grant) allow."""
    spec = state.spec
    if not spec.on_demand.fallback:
        return 0
    cap = spec.on_demand.max_nodes
    used = sum(1 for n in state.nodes if n.alive and n.lifecycle == "on-demand" and not n.base)
    room = 10**6 if cap is None else max(0, cap - spec.on_demand.base_nodes - used)
    if spec.pool is not None:  # the pool's on-demand allowance counts the base too
        used_all = sum(1 for n in state.nodes if n.alive and n.lifecycle == "on-demand")
        room = min(room, max(0, (state.grant.on_demand if state.grant else 0) - used_all))
    return room


def node_price(state: JobState, lifecycle: Lifecycle, instance_type: str, zone: str) -> float:
    """USD/h of a node just bought: the spec's spot price, else the market's, else on-demand."""
    spec_type = state.spec.instance_type(instance_type)
    if lifecycle == "on-demand":
        return spec_type.on_demand_price
    return (
        spec_type.spot_price
        or state.spot_prices.get(f"{instance_type}@{zone}")
        or spec_type.on_demand_price
    )


# --- ordering nodes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Order:
    """One node to buy: spot from `pools` (best first), else on-demand `instance_type`."""

    lifecycle: Lifecycle
    instance_type: str
    procs: int
    pools: list[Pool] = field(default_factory=list)
    base: bool = False
    fallback: bool = False
    on_demand_ok: bool = False  # a spot order may fall back to on-demand if every pool fails
    home: str | None = None  # the job's zone (placement): where its on-demand nodes go too

    @property
    def zone(self) -> str | None:
        return self.pools[0][1] if self.pools else self.home


@dataclass(frozen=True)
class SpotOrders:
    orders: list[Order]
    owed: int  # nodes still owed an on-demand fallback afterwards
    waiting: int  # nodes it could not order now (0: none)


def shortfall(state: JobState) -> int:
    """Nodes to order now so the job holds what it is allowed, with the replacements ordered
    ahead of warned nodes (0 while paused)."""
    if state.phase == Phase.PAUSED:
        return 0
    return max(0, make_before_break.wanted(state) - sum(1 for n in state.nodes if n.alive))


def base_orders(state: JobState, short: int, home: str | None = None) -> list[Order]:
    """The on-demand base nodes missing, ordered before anything else (in `home`, the job's
    zone, if it has one)."""
    alive = [n for n in state.nodes if n.alive]
    missing = max(0, state.spec.on_demand.base_nodes - sum(n.base for n in alive))
    procs = [n.procs for n in alive]
    orders = []
    for _ in range(min(missing, short)):
        gpus, p = need(state.spec, procs)
        orders.append(Order("on-demand", on_demand_type(state.spec, gpus), p, base=True, home=home))
        procs.append(p)
    return orders


def spot_held(state: JobState) -> Counter[Pool]:
    """The job's live spot nodes per (type, zone) pool: new ones spread over pools."""
    return Counter(
        (n.instance_type, n.zone or "") for n in state.nodes if n.alive and n.lifecycle == "spot"
    )


@dataclass(frozen=True)
class Placed:
    """Where the job buys: its home zone (None: anywhere), the offers there, and a hop if
    its home cannot serve it."""

    home: str | None
    offers: list[Offer]
    hop: locality.Hop | None = None


def placed(
    state: JobState, offers: list[Offer], placement: Placement, now: datetime, *, launching: bool
) -> Placed:
    """The offers `placement` lets the job buy from, around its home zone (where its live
    nodes are; with none, the best zone whose pools are not dry), or in the zone it hops to
    (`locality.hop_to`: only with no launch in flight and no generation running, so the nodes
    it leaves are idle). A dry pool of the home stays in its offers: a job that can train
    there keeps trying it, and returns to spot as soon as it has capacity again."""
    if placement == "any":
        return Placed(None, offers)
    held = [n.zone for n in state.nodes if n.alive and n.zone]
    home = locality.home_zone(held, locality.fresh(offers, state.dry_pools, now))
    regions = state.spec.spot.regions
    hop = None
    if not state.running and not launching:
        hop = locality.hop_to(
            placement=placement,
            home=home,
            held=len(held),
            min_nodes=state.spec.elastic.min_nodes,
            state_in_memory=state.held,
            market=market(state, offers, now),
        )
    if hop is not None:
        home = hop.to
    return Placed(home, locality.placed(offers, placement, home, regions), hop)


def hop_for_gain(
    state: JobState, offers: list[Offer], now: datetime, *, move_s: float
) -> locality.Hop | None:
    """Where a job that can train (at least `min_nodes` live, no ranks `parked`) moves for
    gain (`locality.hop_for_gain`): its live nodes at the mean price it pays against every
    other zone's offers at the prices it would be billed, a node-hour worth the mean
    on-demand price of its nodes. Its base on-demand nodes cost the same in any zone, so
    they are left out of both sides; a job the deadline policy keeps on on-demand buys no
    spot, so it stays. Call with no launch in flight: the nodes it leaves must be all it
    holds."""
    alive = [n for n in state.nodes if n.alive]
    home = locality.home_zone([n.zone for n in alive if n.zone], [])
    too_few = len(alive) < state.spec.elastic.min_nodes
    if home is None or too_few or parked(state) or deadline.on_demand(state.deadline):
        return None
    base = sum(n.base for n in alive)
    alive = [n for n in alive if not n.base]
    if not alive:
        return None
    return locality.hop_for_gain(
        placement=state.spec.placement,
        home=home,
        stay=locality.Stay(len(alive), sum(n.price for n in alive) / len(alive)),
        wants=max(len(alive), state.allowed - base),
        min_nodes=max(state.spec.elastic.min_nodes - base, 1),
        worth_h=sum(n.on_demand_price for n in alive) / len(alive),
        move_s=move_s,
        market=market(state, billed(state, offers), now),
    )


def gathering(
    state: JobState, offers: list[Offer], now: datetime, *, move_s: float
) -> locality.Hop | None:
    """Where a running job that spans zones (`placement: any`) gathers
    (`locality.gather_to`): its ring's traffic across zones at the pace last seen, against
    the zone that holds most of its members, at the prices it would be billed there. Call
    with no launch in flight."""
    spec = state.spec
    rate = state.steps_per_hour
    if not state.running or rate is None or spec.gradient_bytes is None:
        return None
    members = state.member_nodes
    zones = [n.zone or "" for n in members]
    per_step = locality.ring_crossing(zones, spec.gradient_bytes, spec.spot.regions)
    return locality.gather_to(
        zones=zones,
        prices=[n.price for n in members],
        crossing_usd_h=per_step.cost * rate,
        worth_h=sum(n.on_demand_price for n in members) / len(members),
        move_s=move_s,
        market=market(state, billed(state, offers), now),
    )


def market(state: JobState, offers: list[Offer], now: datetime) -> locality.Market:
    """The market a move of the job is weighed in: `offers`, and the job's dry pools,
    regions and last hop."""
    return locality.Market(
        offers=offers,
        dry=state.dry_pools,
        regions=state.spec.spot.regions,
        last_hop=state.last_hop_at,
        now=now,
    )


def parked(state: JobState) -> bool:
    """Ranks parked between generations hold the job's state (live resize): a move would
    throw it away. (`held` stays set while the generation they formed runs: that one
    checkpoints before a move.)"""
    return state.held and not state.running


def billed(state: JobState, offers: list[Offer]) -> list[Offer]:
    """`offers` at the price a spot node from each would be billed (the spec's, if it gives
    one)."""
    return [
        o.model_copy(update={"price": node_price(state, "spot", o.instance_type, o.zone)})
        for o in offers
    ]


def spot_orders(
    state: JobState,
    offers: list[Offer],
    short: int,
    held: Counter[Pool],
    *,
    spot_only: bool,
    home: str | None = None,
    fill_zones: bool = False,
) -> SpotOrders:
    """`short` more nodes: spot in the snuggest pool that fits each node's share, spread over
    pools (with `fill_zones`, in the zones the job holds most in first); failing that,
    on-demand (in `home`, the job's zone) for the nodes the job is owed, within the on-demand
    room (never with `spot_only`, the opportunistic growth); else wait for capacity."""
    gpus = {t.name: t.gpus for t in state.spec.spot.instance_types}
    held = Counter(held)
    procs = [n.procs for n in state.nodes if n.alive]
    room = on_demand_room(state)
    owed = state.owed
    deadline_od = deadline.on_demand(state.deadline)  # the deadline policy buys on-demand
    pools = [] if deadline_od else [(o.instance_type, o.zone) for o in offers]
    orders: list[Order] = []
    for i in range(short):
        share, p = need(state.spec, procs)
        od_ok = not spot_only and (deadline_od or (owed > 0 and room > 0))
        ranked = planner.spot_pools(pools, gpus, share, held, fill_zones=fill_zones)
        if ranked:
            held[ranked[0]] += 1
            orders.append(
                Order("spot", ranked[0][0], p, pools=ranked, on_demand_ok=od_ok, home=home)
            )
        elif od_ok:
            od_type = on_demand_type(state.spec, share)
            orders.append(Order("on-demand", od_type, p, fallback=True, home=home))
            room -= 1
        else:
            return SpotOrders(orders, owed, short - i)
        procs.append(p)
        owed = max(0, owed - 1)
    return SpotOrders(orders, owed, 0)


def launch_tries(
    order: Order, fallback_type: str | None
) -> list[tuple[str, str | None, Lifecycle]]:
    """(type, zone, lifecycle) to try in turn for one node: each spot pool, then on-demand of
    `fallback_type` if given; an on-demand order tries only its own type. On-demand goes to
    the job's home zone if it has one (None: the provider's choice)."""
    if order.lifecycle == "on-demand":
        return [(order.instance_type, order.home, "on-demand")]
    tries: list[tuple[str, str | None, Lifecycle]] = [(t, z, "spot") for t, z in order.pools]
    if fallback_type is not None:
        tries.append((fallback_type, order.home, "on-demand"))
    return tries
