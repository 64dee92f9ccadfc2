"""A TrainingJob's nodes, as its workflow buys, launches, checks and releases them.

Sequencing only, like the workflow it serves: what to order comes from `job_planner`, and
every call to the node provider goes through `calls`. Each launch runs as its own task, so a
slow or failing pool never holds up the main loop; the fleet books every outcome in the job's
state and says so through `on_change`. Call from workflow code only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.contract import (
        CAPACITY_ERROR,
        CONFIG_ERROR,
        DescribeRequest,
        LaunchRequest,
        Lifecycle,
        NodeInfo,
        Offer,
        ReleaseRequest,
    )
    from spotrain.workflows.job import calls, orders
    from spotrain.workflows.job.orders import Order
    from spotrain.workflows.job.state import JobState, NodeRecord, NodeState
    from spotrain.workflows.policies import locality, make_before_break, warning_rule
    from spotrain.workflows.spec import Placement


# A hop restarts every rank on new nodes: processes start, build and load (the restart mode's
# pause in warning_rule).
RESTART_S = warning_rule.PAUSE_S["restart"]


def unless_cancelled(err: ActivityError) -> None:
    """For code that shrugs off an activity's failure: never shrug off the job's cancellation
    (a workflow cancelled while it awaits an activity sees that activity fail as cancelled)."""
    if is_cancelled_exception(err):
        raise asyncio.CancelledError() from err


class Fleet:
    def __init__(self, state: JobState, on_change: Callable[[], None]) -> None:
        self.s = state
        self.on_change = on_change
        self.launches: dict[int, asyncio.Task[None]] = {}
        self.fatal: str | None = None  # a launch failed for good (credentials, bad type)

    async def reconcile(
        self, *, spot_only: bool = False, offers: list[Offer] | None = None
    ) -> None:
        """Order nodes until the job holds what it may (base on-demand first, then spot, then
        on-demand fallback for the nodes it is owed), all in its home zone or region unless
        its placement is `any`; first hop if its home cannot serve it. `offers`: those this
        capacity check already looked up (None: look them up)."""
        s = self.s
        short = orders.shortfall(s)
        if short <= 0:
            return
        # (before the patch every job bought anywhere, base nodes before any offer was seen)
        placement = s.spec.placement if workflow.patched("zone-placement") else "any"
        where = None
        if placement != "any":
            where = await self._placed(placement, offers)
            short = orders.shortfall(s)  # (a hop released the nodes it held)
        elif offers is not None:
            where = orders.Placed(None, offers)
        await self._buy(short, placement, where, spot_only=spot_only)

    async def _buy(
        self, short: int, placement: Placement, where: orders.Placed | None, *, spot_only: bool
    ) -> None:
        """Order `short` nodes `where` (None: anywhere, offers not looked up yet)."""
        s = self.s
        base = orders.base_orders(s, short, where.home if where else None)
        for order in base:
            self._order(order)
        short -= len(base)
        if short <= 0:
            return
        held = orders.spot_held(s)
        if where is None:
            where = orders.Placed(None, await self.find_offers())
        offers = make_before_break.away_from_warned(s, where.offers)
        # (before the patch a job that may span zones spread over them all)
        fill = placement != "zone" and workflow.patched("spanning-jobs-fill-zones")
        plan = orders.spot_orders(
            s, offers, short, held, spot_only=spot_only, home=where.home, fill_zones=fill
        )
        for order in plan.orders:
            self._order(order)
        s.owed = plan.owed
        if plan.waiting:
            s.record(workflow.now(), "waiting for capacity", f"{plan.waiting} node(s) short")

    async def _placed(self, placement: Placement, offers: list[Offer] | None) -> orders.Placed:
        """The offers around the job's home; after a hop, its idle nodes gone. Every change of
        home counts as a hop, also that of a job left with no node, which moves for free."""
        s = self.s
        now = workflow.now()
        if offers is None:
            offers = await self.find_offers()
        where = orders.placed(s, offers, placement, now, launching=bool(self.launches))
        if where.home is not None and s.home_zone not in (None, where.home):
            why = where.hop.why if where.hop else f"it holds no node in {s.home_zone}"
            self._hopped(where.home, why)
        if where.hop is not None:
            await self.release([n for n in s.nodes if n.alive], f"hop to {where.hop.to}")
        s.home_zone = where.home or s.home_zone
        return where

    def _hopped(self, to: str, why: str) -> None:
        s = self.s
        s.hops += 1
        s.last_hop_at = workflow.now()
        s.record(workflow.now(), "zone hop", f"to {to}: {why}")

    async def hop_if_it_pays(self, stop: Callable[[str], Awaitable[None]]) -> list[Offer] | None:
        """Move a job that can train to a zone where the move pays (`orders.hop_for_gain`),
        or gather one that spans zones into the zone that holds most of it
        (`orders.gathering`): `stop` its generation with a checkpoint, release the nodes that
        leave (every one, or those outside that zone), buy their replacements there. Only
        with no launch in flight, so every node it holds is known. Returns the offers it
        looked up, if it did and stayed: the rest of the capacity check buys from them
        rather than asking again (an activity, and its events, a check)."""
        s = self.s
        placement = s.spec.placement
        alive = sum(n.alive for n in s.nodes)
        if self.launches or alive < s.spec.elastic.min_nodes:
            return None
        spanning = placement == "any"
        if spanning and not workflow.patched("spanning-jobs-gather"):
            return None  # (hops-that-pay came first, for zone and region only)
        offers = await self.find_offers()
        move_s = make_before_break.checkpoint_s(s) + warning_rule.BOOT_S + RESTART_S
        rule = orders.gathering if spanning else orders.hop_for_gain
        hop = rule(s, offers, workflow.now(), move_s=move_s)
        if hop is None:
            return offers
        if s.running:
            await stop(hop.why)
            if s.finished:  # (its last step ran as it stopped)
                return None
        leaving = [n for n in s.nodes if n.alive and not (spanning and n.zone == hop.to)]
        await self.release(leaving, f"hop to {hop.to}")
        self._hopped(hop.to, hop.why)
        if spanning:  # (new spot nodes fill the zone that holds most: hop.to)
            where = orders.Placed(None, offers)
        else:
            s.home_zone = hop.to
            inside = locality.placed(offers, placement, hop.to, s.spec.spot.regions)
            where = orders.Placed(hop.to, inside, hop)
        await self._buy(orders.shortfall(s), placement, where, spot_only=False)
        return None

    def _order(self, order: Order) -> None:
        s = self.s
        s.next_slot = max(s.next_slot, len(s.nodes))  # (states carried from before next_slot)
        node = NodeRecord(
            slot=s.next_slot,
            lifecycle=order.lifecycle,
            instance_type=order.instance_type,
            zone=order.zone,
            base=order.base,
            fallback=order.fallback,
            procs=order.procs,
            price=0.0,
            on_demand_price=s.spec.instance_type(order.instance_type).on_demand_price,
        )
        s.nodes.append(node)
        s.next_slot += 1
        task = asyncio.create_task(self._launch(node, order))
        self.launches[node.slot] = task
        task.add_done_callback(lambda _: self.launches.pop(node.slot, None))

    async def _launch(self, node: NodeRecord, order: Order) -> None:
        """Try each spot pool in turn, then on-demand if allowed; capacity errors move on."""
        s = self.s
        fallback_type = None
        if order.on_demand_ok and node.lifecycle == "spot":  # sized to the share it stands in for
            fallback_type = orders.on_demand_type(s.spec, orders.next_need(s)[0])
        tries = orders.launch_tries(order, fallback_type)
        for i, (itype, zone, lifecycle) in enumerate(tries):
            node.instance_type, node.zone, node.lifecycle = itype, zone, lifecycle
            node.fallback = node.fallback or (lifecycle == "on-demand" and not node.base)
            try:
                info = await calls.launch_node(
                    self._launch_request(node, tries[i + 1 :]),
                    f"launch {lifecycle} {itype} in {zone or 'any zone'}, slot {node.slot}",
                    s.spec.elastic.max_launch_attempts,
                )
            except ActivityError as err:
                node.attempt += 1
                if calls.error_type(err) == CAPACITY_ERROR:
                    if lifecycle == "spot" and zone:  # (placement leaves it out a while)
                        now = workflow.now()
                        s.dry_pools = locality.still_dry(s.dry_pools, now)
                        s.dry_pools[locality.pool_key(itype, zone)] = now
                    continue
                s.record(workflow.now(), "launch failed", f"slot {node.slot}: {err.cause}")
                if calls.error_type(err) == CONFIG_ERROR:  # will not heal by retrying: say so
                    self.fatal = f"cannot launch {lifecycle} {itype}: {err.cause}"
                break
            if not node.alive:  # released while launching (cancel, pause, scale in)
                await self.release_ids([info.node_id], "no longer needed")
                return
            self._ready(node, info)
            return
        node.state, node.reason, node.ended_at = NodeState.GONE, "no capacity", workflow.now()
        self.on_change()

    def _launch_request(
        self, node: NodeRecord, rest: list[tuple[str, str | None, Lifecycle]]
    ) -> LaunchRequest:
        s = self.s
        spot = node.lifecycle == "spot"
        return LaunchRequest(
            job=s.spec.name,
            slot=node.slot,
            attempt=node.attempt,
            generation=s.generation,
            lifecycle=node.lifecycle,
            instance_type=node.instance_type,
            zone=node.zone,
            max_price=s.spec.spot.max_price if spot else None,
            gpus=s.spec.instance_type(node.instance_type).gpus,
            **self._regions(),
            fallback_pools=[(t, z) for t, z, lc in rest if lc == "spot" and z] if spot else [],
            placement_group=s.spec.placement_group,
        )

    def _ready(self, node: NodeRecord, info: NodeInfo) -> None:
        s = self.s
        # (an EC2 Fleet may have chosen another pool than the first asked for)
        node.node_id, node.address, node.zone = info.node_id, info.address, info.zone
        node.instance_type = info.instance_type
        node.state = NodeState.READY
        node.ready_at = workflow.now()
        node.price = orders.node_price(s, node.lifecycle, info.instance_type, info.zone)
        s.record(
            workflow.now(),
            "node ready",
            f"{node.lifecycle} {info.instance_type} {info.zone} {info.node_id}",
        )
        self.on_change()

    async def settle(self) -> None:
        """Let in-flight launches finish so that every node they made is known (and released)."""
        await workflow.wait_condition(lambda: not self.launches)

    async def release(
        self, nodes: list[NodeRecord], reason: str, state: NodeState = NodeState.RELEASED
    ) -> None:
        s = self.s
        now = workflow.now()
        for n in nodes:
            n.state, n.reason = state, reason
            n.ended_at = n.ended_at or now
            s.record(
                now, f"node {state}", f"{n.lifecycle} {n.node_id or f'slot {n.slot}'}: {reason}"
            )
        await self.release_ids([n.node_id for n in nodes if n.node_id], reason)
        self.on_change()

    async def release_ids(self, ids: list[str], reason: str) -> None:
        if ids:
            await calls.release_nodes(
                ReleaseRequest(job=self.s.spec.name, node_ids=ids, **self._regions()),
                f"release {', '.join(ids)}: {reason}",
            )

    def _regions(self) -> dict[str, Any]:
        """Where the provider looks for the job's nodes: its home region and more_regions."""
        spot = self.s.spec.spot
        return {"region": spot.region, "more_regions": spot.more_regions}

    async def find_offers(self) -> list[Offer]:
        s = self.s
        if not s.spec.spot.enabled:
            return []
        try:
            offers = await calls.find_offers(s.spec.spot)
        except ActivityError as err:
            unless_cancelled(err)
            return []  # a flapping cloud API means no new orders this round, nothing more
        s.spot_prices |= {f"{o.instance_type}@{o.zone}": o.price for o in offers}
        return offers

    async def describe(self, nodes: list[NodeRecord] | None) -> list[NodeInfo]:
        """The provider's view of `nodes`, or of every node tagged with the job (None)."""
        ids = [] if nodes is None else [n.node_id for n in nodes if n.node_id]
        if nodes is not None and not ids:
            return []
        try:
            return await calls.describe_nodes(
                DescribeRequest(job=self.s.spec.name, node_ids=ids, **self._regions()),
                f"check {len(ids)} node(s)" if ids else "find every node of the job",
            )
        except ActivityError as err:
            unless_cancelled(err)
            return []  # only a node that is really gone changes membership, not an API error
