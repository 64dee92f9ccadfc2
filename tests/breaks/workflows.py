"""Breaks of the planners: each documented spec field's effect, make-before-break and its
warning rule."""

from __future__ import annotations

from tests.breaks.model import Break, _in

PJ = _in("workflows/test_planner_job.py")
PLT = _in("workflows/test_planner.py")
MBT = _in("workflows/test_make_before_break_planner.py")
SCH = _in("workflows/test_scheduled_change.py")
PLC = _in("workflows/test_placement.py")
JP = "workflows/job/job_planner.py"
OR = "workflows/job/orders.py"
LO = "workflows/policies/locality.py"
PL = "workflows/job/planner.py"
MB = "workflows/policies/make_before_break.py"

# --- the planner: each documented spec field's effect ----------------------------------------
PLANNER_BREAKS = [
    Break(
        "scale_config per world size",
        JP,
        "spec.scale_config.get(world, {})",
        "spec.scale_config.get(len(nodes), {})",
        PJ("test_scale_config_is_the_entry_for_the_world_size_in_processes"),
    ),
    Break(
        "on-demand type sized to the lost share",
        OR,
        "return min(fits, key=lambda t: t.on_demand_price).name",
        "return max(fits, key=lambda t: t.gpus).name",
        PJ("test_total_gpus_packs_shares_and_the_fallback_is_sized_to_the_lost_share"),
    ),
    Break(
        "scaling_timeout_s growth debounce",
        JP,
        "return since, since + timedelta(seconds=state.spec.elastic.scaling_timeout_s)",
        "return since, since",
        PJ("test_growth_waits_scaling_timeout_after_nodes_arrive"),
    ),
    Break(
        "scaling_timeout_s gang-start hold",
        JP,
        "hold = now + timedelta(seconds=state.spec.elastic.scaling_timeout_s)",
        "hold = now",
        PJ("test_gang_start_waits_scaling_timeout_for_the_nodes_ordered"),
    ),
    Break(
        "faulty_scale_down_timeout_s",
        JP,
        "return now + timedelta(seconds=state.spec.elastic.faulty_scale_down_timeout_s)",
        "return now",
        PJ("test_after_a_loss_the_hold_is_faulty_scale_down_timeout"),
    ),
    Break(
        "graceful_shutdown_timeout_s",
        JP,
        "timeout = state.spec.elastic.graceful_shutdown_timeout_s",
        "timeout = 60.0",
        PJ("test_reclaim_plan_per_case"),
    ),
    Break(
        "act_on_rebalance",
        JP,
        'if event.kind == "rebalance" and state.spec.elastic.warning_policy != "shrink":',
        "if False:",
        PJ("test_reclaim_plan_per_case"),
    ),
    Break(
        "reclaim batching into one resize",
        JP,
        "    for other in state.inbox:\n",
        "    for other in state.inbox[:0]:\n",
        PJ("test_reclaims_queued_meanwhile_leave_in_the_same_resize"),
    ),
    Break(
        "reclaim_policy (replace/drop)",
        JP,
        'owe = state.spec.elastic.reclaim_policy == "replace" or node.base',
        "owe = True",
        PJ("test_reclaim_policy_replace_owes_a_node_and_drop_shrinks"),
    ),
    Break(
        "stall_timeout_s",
        JP,
        "(now - state.progress_at).total_seconds() > stall",
        "(now - state.progress_at).total_seconds() > 2 * stall",
        PJ("test_watch_verdicts_and_stall_timeout"),
    ),
    Break(
        "max_restarts",
        JP,
        "if state.restarts <= limit:",
        "if state.restarts <= limit + 1:",
        PJ("test_max_restarts_fails_the_job_one_past_the_limit"),
    ),
    Break(
        "min_nodes floor on scale-in",
        JP,
        "return ScaleDown(victims, max(state.spec.elastic.min_nodes, state.target - len(victims)))",
        "return ScaleDown(victims, state.target - len(victims))",
        PJ("test_scale_in_removes_spare_nodes_then_the_highest_ranks"),
    ),
    Break(
        "max_nodes check on scale-out",
        JP,
        "if state.target + count > limit:",
        "if state.target + count > limit + 1:",
        PJ("test_scale_requests_are_checked_against_min_and_max"),
    ),
    Break(
        "opportunistic",
        JP,
        "grow=spec.elastic.opportunistic and state.target < state.ceiling",
        "grow=state.target < state.ceiling",
        PJ("test_capacity_check_grows_opportunistically_and_swaps_back"),
    ),
    Break(
        "return_to_spot (release fallback left out)",
        JP,
        "if not spare or not state.spec.on_demand.return_to_spot or deadline.on_demand(state.deadline):",
        "if not spare or deadline.on_demand(state.deadline):",
        PJ("test_return_to_spot_releases_fallback_nodes_left_out"),
    ),
    Break(
        "return_to_spot (growth swaps back)",
        JP,
        "swaps_back = state.spec.on_demand.return_to_spot and",
        "swaps_back = True and",
        PJ("test_growth_swaps_fallback_nodes_for_spot_at_the_same_size"),
    ),
    Break(
        "return_to_spot (capacity check)",
        JP,
        "swap = spec.on_demand.return_to_spot and not launching",
        "swap = not launching",
        PJ("test_capacity_check_grows_opportunistically_and_swaps_back"),
    ),
    Break(
        "on_demand.fallback",
        OR,
        "    if not spec.on_demand.fallback:\n        return 0\n",
        "",
        PJ("test_on_demand_room_follows_fallback_max_nodes_base_and_the_pool"),
    ),
    Break(
        "on_demand.max_nodes",
        OR,
        "max(0, cap - spec.on_demand.base_nodes - used)",
        "max(0, cap - used)",
        PJ("test_on_demand_room_follows_fallback_max_nodes_base_and_the_pool"),
    ),
    Break(
        "on_demand.base_nodes ordered first",
        OR,
        "missing = max(0, state.spec.on_demand.base_nodes - sum(n.base for n in alive))",
        "missing = 0",
        PJ("test_base_nodes_are_ordered_first_on_demand"),
    ),
    Break(
        "total_gpus share (GPU packing)",
        OR,
        "        if held[used]:\n",
        "        if False:\n",
        PJ("test_total_gpus_packs_shares_and_the_fallback_is_sized_to_the_lost_share"),
    ),
    Break(
        "gpus_per_node share",
        OR,
        "return spec.gpus_per_node or 0, spec.gpus_per_node or spec.procs_per_node",
        "return 0, spec.procs_per_node",
        PJ("test_gpus_per_node_and_procs_per_node_set_the_share"),
    ),
    Break(
        "discrete_sizes / increment_step",
        JP,
        "e.min_nodes, e.max_nodes, e.increment_step, e.discrete_sizes)",
        "e.min_nodes, e.max_nodes, None, None)",
        PJ("test_a_generation_starts_at_the_largest_allowed_size_ready"),
    ),
    Break(
        "growth never buys on-demand (spot_only)",
        OR,
        "od_ok = not spot_only and (deadline_od or (owed > 0 and room > 0))",
        "od_ok = deadline_od or (owed > 0 and room > 0)",
        PJ("test_spot_orders_spread_over_zones_then_fall_back_for_what_is_owed"),
    ),
    Break(
        "spot spread over pools (held)",
        OR,
        "            held[ranked[0]] += 1\n",
        "",
        PJ("test_spot_orders_spread_over_zones_then_fall_back_for_what_is_owed"),
    ),
    Break(
        "grant: on-demand nodes give way first",
        JP,
        'victims = [n for n in removable if n.lifecycle == "on-demand"][:extra_on_demand]',
        "victims = []",
        PJ("test_a_grant_shrinks_on_demand_first_never_the_base"),
    ),
    Break(
        "grant: below min preempts",
        JP,
        "preempt=grant.nodes < state.spec.elastic.min_nodes,",
        "preempt=False,",
        PJ("test_a_grant_below_min_preempts_and_one_above_admits"),
    ),
    Break(
        "grant: base nodes never give way",
        JP,
        "removable = [n for n in removal_order(state) if not n.base]",
        "removable = removal_order(state)",
        PJ("test_a_grant_shrinks_on_demand_first_never_the_base"),
    ),
    Break(
        "pool report: priority",
        JP,
        "priority=spec.priority,",
        "priority=0,",
        PJ("test_pool_report_claims_min_max_and_holdings"),
    ),
    Break(
        "spot_price before the market's",
        OR,
        '        spec_type.spot_price\n        or state.spot_prices.get(f"{instance_type}@{zone}")',
        '        state.spot_prices.get(f"{instance_type}@{zone}")\n        or spec_type.spot_price',
        PJ("test_node_price_spec_then_market_then_on_demand"),
    ),
    Break(
        "removal order: highest rank first",
        JP,
        "    return list(reversed(in_rank_order))",
        "    return in_rank_order",
        PJ("test_scale_in_removes_spare_nodes_then_the_highest_ranks"),
    ),
    Break(
        "global_batch_size passed on",
        JP,
        "global_batch_size=spec.global_batch_size,",
        "global_batch_size=None,",
        PJ("test_scale_config_is_the_entry_for_the_world_size_in_processes"),
    ),
    Break(
        "uneven batch split",
        PL,
        "return split.small if rank < split.n_small else split.large",
        "return split.small",
        PLT("test_uneven_batch_adds_up_and_differs_by_at_most_one"),
    ),
    Break(
        "members: base then spot first",
        PL,
        'tier = 0 if c.base else (1 if c.lifecycle == "spot" else 2)',
        "tier = 0",
        PJ("test_growth_swaps_fallback_nodes_for_spot_at_the_same_size"),
    ),
    Break(
        "early_warning / reclaim_notice: make_before_break",
        MB,
        "policy = e.warning_policy if event.kind in WARNINGS else e.reclaim_notice",
        'policy = "make_before_break"',
        MBT("test_policies_pass_to_the_usual_reclaim_path"),
    ),
    Break(
        "a move to on-demand for the deadline grows to the ceiling",
        "workflows/policies/deadline_hooks.py",
        "            s.target = s.ceiling\n",
        "            pass\n",
        _in("workflows/test_deadline.py")(
            "test_a_move_to_on_demand_asks_for_every_node_the_job_may_hold"
        ),
    ),
    Break(
        "a straggler is blamed on its own node with several ranks to a node",
        "workflows/policies/stragglers.py",
        'return [n.node_id or "" for n in members for _ in range(n.procs)]',
        'return [n.node_id or "" for n in members]',
        _in("workflows/test_stragglers.py")(
            "test_with_two_ranks_to_a_node_a_slow_rank_is_blamed_on_its_own_node"
        ),
    ),
    Break(
        "a swap of several checkpoints within the shortest notice's grace",
        MB,
        "grace=min(grace(w) for w, _ in pairs),",
        "grace=max(grace(w) for w, _ in pairs),",
        MBT("test_one_resize_swapping_several_checkpoints_within_the_shortest_notices_grace"),
    ),
    Break(
        "max_surge_nodes",
        MB,
        "cap = e.max_nodes + e.max_surge_nodes",
        "cap = e.max_nodes + 1",
        MBT("test_no_room_at_max_nodes_without_surge_but_room_below_it"),
    ),
    Break(
        "the pool's grant caps the overlap",
        MB,
        "cap = min(cap, state.grant.nodes if state.grant else 0)",
        "cap = cap",
        MBT("test_a_pools_grant_caps_the_overlap"),
    ),
    Break(
        "checkpoint p99 sets the swap-by time",
        MB,
        "return stats.p99_s",
        "return 0.0",
        MBT("test_a_notice_waits_for_its_replacement_only_until_deadline_minus_checkpoint_p99"),
    ),
    Break(
        "a late notice shrinks",
        MB,
        "if w.deadline is not None and swap_by(state, w.deadline) <= now]",
        "if False]",
        MBT("test_a_notice_waits_for_its_replacement_only_until_deadline_minus_checkpoint_p99"),
    ),
]

# --- make-before-break's warning rule (workflows/policies/warning_rule.py) ----------------
WR = "workflows/policies/warning_rule.py"
WRT = ("tests/workflows/test_warning_rule.py",)
WARNING_RULE_BREAKS = [
    Break(
        "warning rule: a false positive pays the swap's pause",
        WR,
        "case.surge_price_h * case.boot_s / 3600 + pause_usd)",
        "case.surge_price_h * case.boot_s / 3600)",
        WRT,
    ),
    Break("warning_reclaim_probability", WR, "p=e.warning_reclaim_probability,", "p=0.5,", WRT),
    Break(
        "warning rule: every member's price",
        WR,
        "members_price_h=sum(n.price for n in state.member_nodes),",
        "members_price_h=state.member_nodes[0].price,",
        WRT,
    ),
    Break(
        "warning_rule: always",
        WR,
        'if state.spec.elastic.warning_rule == "always":',
        "if False:",
        WRT,
    ),
    Break(
        "warning rule: the notice swaps only if the boot fits",
        WR,
        "and swap_window >= BOOT_S",
        "",
        WRT,
    ),
    Break(
        "warning rule: a scheduled change is certain",
        WR,
        "return replace(case, p=1.0, notice_swaps=False)",
        "return case",
        SCH("test_the_rule_takes_a_scheduled_change_as_certain"),
    ),
    Break(
        "a scheduled change's swap keeps its start as its deadline",
        MB,
        "deadline = event.deadline if dated else None",
        'deadline = event.deadline if event.kind == "reclaim" else None',
        SCH(
            "test_a_scheduled_change_swaps_by_its_own_start_and_shrinks_if_the_replacement_is_late"
        ),
    ),
    Break(
        "AWS Health scheduled change: its own kind, due at startTime",
        "workers/webhook/events.py",
        "return [_scheduled(i, health_event_id(event.id, i), start) for i in instances]",
        "return [_early_warning(i, health_event_id(event.id, i)) for i in instances]",
        SCH("test_aws_payloads_of_scheduled_changes_parse_to_their_own_kind_and_start"),
    ),
]

# --- placement: one zone, hops, the bytes a ring sends across zones ---------------------------
PLACEMENT_BREAKS = [
    Break(
        "placement keeps the home zone's offers",
        LO,
        "elif not o.zone or unit_of(o.zone, placement, regions) == unit:",
        "elif True:",
        PLC("test_placed_keeps_the_offers_of_the_home_zone_or_region"),
    ),
    Break(
        "the home is where most live nodes are",
        LO,
        "return next(z for z in held if counts[z] == most)",
        "return held[-1]",
        PLC("test_home_is_where_most_live_nodes_are_else_the_best_offered_zone"),
    ),
    Break(
        "a hop only below min_nodes",
        LO,
        "    if not can or max(can.values()) <= at_home:",
        "    if not can:",
        PLC("test_a_job_hops_only_when_its_zone_cannot_give_it_min_nodes_and_another_can"),
    ),
    Break(
        "the hop hold-down",
        LO,
        "return self.last_hop is not None and self.now - self.last_hop < HOP_HOLD_DOWN",
        "return False",
        PLC("test_the_hold_down_keeps_a_flickering_market_from_making_a_job_flap"),
    ),
    Break(
        "a pool found empty is left out a while",
        LO,
        "if now - dry.get(pool_key(o.instance_type, o.zone), now - DRY_FOR) >= DRY_FOR",
        "if True",
        PLC("test_a_pool_found_empty_is_left_out_for_a_while"),
    ),
    Break(
        "a job that may span zones fills the zone it holds most in",
        PL,
        "fitting.sort(key=lambda p: (gpus[p[0]], -in_zone[p[1]]))",
        "fitting.sort(key=lambda p: (gpus[p[0]], in_zone[p[1]]))",
        PLT("test_spot_pools_that_fill_zones_buy_where_the_job_holds_most"),
    ),
    Break(
        "every crossing link is billed",
        LO,
        "across_zones = sum(1 for a, b in links if a != b)",
        "across_zones = min(1, sum(1 for a, b in links if a != b))",
        PLC("test_a_ring_bills_the_links_that_cross_zones_and_regions"),
    ),
]
