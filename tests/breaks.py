"""The breaks tests/test_breaks.py applies, one at a time, to a copy of the repository: each a
behaviour that a unit test guards, the edit that breaks it (text that must occur exactly once
in its file), and the fast tests that must fail with it. Add one when a test guards a new
behaviour; a break that no longer matches the code fails test_every_break_matches_todays_code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Break:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    more: tuple[tuple[str, str], ...] = ()  # further edits in the same file

    @property
    def edits(self) -> tuple[tuple[str, str], ...]:
        return ((self.old, self.new), *self.more)

    def matches(self, repo: Path) -> bool:
        text = (repo / self.path).read_text()
        return all(text.count(old) == 1 for old, _ in self.edits)


def _in(file: str) -> Callable[..., tuple[str, ...]]:
    """Node ids of tests in `file` (a path under tests/)."""

    def named(*tests: str) -> tuple[str, ...]:
        return tuple(f"tests/{file}::{t}" for t in tests)

    return named


PJ = _in("workflows/test_planner_job.py")
PLT = _in("workflows/test_planner.py")
MBT = _in("workflows/test_make_before_break_planner.py")
AUTH = _in("webhook/test_webhook_auth.py")
EC2 = _in("aws/test_ec2.py")
HO = _in("elastic/test_handover.py")
CW = _in("elastic/test_checkpoint_writer.py")
SCH = _in("workflows/test_scheduled_change.py")
JP = "workflows/job/job_planner.py"
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
        JP,
        "return min(fits, key=lambda t: t.on_demand_price).name",
        "return max(fits, key=lambda t: t.gpus).name",
        PJ("test_total_gpus_packs_shares_and_the_fallback_is_sized_to_the_lost_share"),
    ),
    Break(
        "scaling_timeout_s growth debounce",
        JP,
        "return state.grow_since, state.grow_since + timedelta(\n        seconds=state.spec.elastic.scaling_timeout_s\n    )",
        "return state.grow_since, state.grow_since",
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
        JP,
        "    if not spec.on_demand.fallback:\n        return 0\n",
        "",
        PJ("test_on_demand_room_follows_fallback_max_nodes_base_and_the_pool"),
    ),
    Break(
        "on_demand.max_nodes",
        JP,
        "max(0, cap - spec.on_demand.base_nodes - used)",
        "max(0, cap - used)",
        PJ("test_on_demand_room_follows_fallback_max_nodes_base_and_the_pool"),
    ),
    Break(
        "on_demand.base_nodes ordered first",
        JP,
        "missing = max(0, state.spec.on_demand.base_nodes - sum(n.base for n in alive))",
        "missing = 0",
        PJ("test_base_nodes_are_ordered_first_on_demand"),
    ),
    Break(
        "total_gpus share (GPU packing)",
        JP,
        "        if held[used]:\n",
        "        if False:\n",
        PJ("test_total_gpus_packs_shares_and_the_fallback_is_sized_to_the_lost_share"),
    ),
    Break(
        "gpus_per_node share",
        JP,
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
        JP,
        "od_ok = not spot_only and (deadline_od or (owed > 0 and room > 0))",
        "od_ok = deadline_od or (owed > 0 and room > 0)",
        PJ("test_spot_orders_spread_over_zones_then_fall_back_for_what_is_owed"),
    ),
    Break(
        "spot spread over pools (held)",
        JP,
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
        JP,
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

# --- webhook auth: who may send a notice -------------------------------------------------------
AUTH_PY = "workers/webhook/auth.py"
AUTH_BREAKS = [
    Break(
        "bearer token compared whole",
        AUTH_PY,
        "ok = hmac.compare_digest(_bytes(auth[7:]), _bytes(config.bearer_token))",
        "ok = _bytes(config.bearer_token).startswith(_bytes(auth[7:]))",
        AUTH("test_a_bearer_token_must_match_exactly"),
    ),
    Break(
        "signature binds method and path",
        AUTH_PY,
        'return f"v2\\n{timestamp}\\n{method.upper()}\\n{path}\\n".encode() + body',
        'return f"v2\\n{timestamp}\\n".encode() + body',
        AUTH("test_a_signature_binds_method_and_path"),
    ),
    Break(
        "signature cut short refused",
        AUTH_PY,
        "if hmac.compare_digest(given, expected.encode()):",
        "if given and expected.encode().startswith(given):",
        AUTH("test_a_signature_cut_short_or_lengthened_is_refused"),
    ),
    Break(
        "signature dated ahead refused",
        AUTH_PY,
        "if not -HMAC_FUTURE_SKEW_S <= age <= config.replay_window_s:",
        "if not age <= config.replay_window_s:",
        AUTH("test_a_signature_too_old_or_dated_ahead_is_refused"),
    ),
    Break(
        "signature older than the replay window refused",
        AUTH_PY,
        "if not -HMAC_FUTURE_SKEW_S <= age <= config.replay_window_s:",
        "if not -HMAC_FUTURE_SKEW_S <= age:",
        AUTH("test_a_signature_too_old_or_dated_ahead_is_refused"),
    ),
    Break(
        "legacy signature only when asked for",
        AUTH_PY,
        "if config.hmac_legacy:",
        "if True:",
        AUTH("test_the_legacy_signature_only_when_asked_for"),
    ),
]

# --- notice parsing: a deadline is read in its own zone ---------------------------------------
EVENTS_PY = "workers/webhook/events.py"
NOTICE_BREAKS = [
    Break(
        "deadline offset converted, not relabelled",
        EVENTS_PY,
        "utc = value.astimezone(UTC)",
        "utc = value.replace(tzinfo=UTC)",
        AUTH("test_a_deadline_with_an_offset_is_converted_not_relabelled"),
    ),
    Break(
        "deadline kept in UTC",
        EVENTS_PY,
        "return utc\n",
        "return value\n",
        AUTH("test_a_deadline_with_an_offset_is_converted_not_relabelled"),
    ),
    Break(
        "deadline without a zone refused",
        EVENTS_PY,
        "Instant = Annotated[AwareDatetime, AfterValidator(_sane_time)]",
        "Instant = Annotated[datetime, AfterValidator(_sane_time)]",
        AUTH("test_a_deadline_without_a_zone_or_out_of_range_is_refused"),
    ),
    Break(
        "EventBridge spot warning: deadline two minutes on",
        EVENTS_PY,
        "deadline = event.time + SPOT_NOTICE\n",
        "deadline = event.time\n",
        AUTH("test_an_eventbridge_warning_comes_two_minutes_before_in_utc"),
    ),
    Break(
        "NTH queue mode: StartTime is the notice's time",
        EVENTS_PY,
        "return notice.start_time + SPOT_NOTICE if from_queue else notice.start_time",
        "return notice.start_time",
        AUTH("test_an_eventbridge_warning_comes_two_minutes_before_in_utc"),
    ),
]

# --- EC2 ownership: tags gc and release look for, client tokens --------------------------------
OWN_PY = "activities/ec2_ownership.py"
EC2_PY = "activities/ec2.py"
EC2_BREAKS = [
    Break(
        "client token differs per attempt",
        OWN_PY,
        'digest = hashlib.sha256(f"{job}/{slot}/{attempt}".encode()).hexdigest()',
        'digest = hashlib.sha256(f"{job}/{slot}".encode()).hexdigest()',
        EC2("test_the_client_token_is_stable_per_attempt_and_new_per_attempt"),
    ),
    Break(
        "the managed tag",
        OWN_PY,
        '        {"Key": MANAGED, "Value": "true"},\n',
        "",
        EC2("test_launch_lifecycle_and_tags"),
    ),
    Break(
        "gc spares the nodes of running jobs",
        OWN_PY,
        "if not running.get(job, False):",
        "if True:",
        EC2("test_gc_reaps_orphans_and_spares_live_jobs"),
    ),
    Break(
        "run_instances tags the volumes",
        EC2_PY,
        'for kind in ("instance", "volume")',
        'for kind in ("instance",)',
        EC2("test_launch_lifecycle_and_tags"),
    ),
    Break(
        "a fleet's node carries the ownership tags",
        EC2_PY,
        '            TagSpecifications=[{"ResourceType": "instance", "Tags": ownership_tags(req)}],\n',
        "",
        EC2("test_fleet_launch_offers_every_pool_tags_and_is_idempotent"),
    ),
    Break(
        "a fleet's volumes carry the ownership tags",
        EC2_PY,
        "ec2.create_tags(Resources=volumes, Tags=ownership_tags(req))",
        "volumes.clear()",
        EC2("test_fleet_launch_offers_every_pool_tags_and_is_idempotent"),
    ),
]

# --- the live rank hand-over: tensors from the survivors at the newest step -------------------
HO_PY = "workers/elastic/handover.py"
HANDOVER_BREAKS = [
    Break(
        "background checkpoint: written in the writer process",
        "workers/elastic/checkpoint.py",
        'background="process" if stager else "thread"',
        'background="thread"',
        CW("test_a_background_save_writes_in_a_process_of_its_own_at_nice_19"),
    ),
    Break(
        "background checkpoint: from a thread unless the process is asked for",
        "workers/elastic/checkpoint_writer.py",
        'asked = os.environ.get(WRITER_ENV) or "thread"',
        'asked = os.environ.get(WRITER_ENV) or "process"',
        CW("test_unless_the_process_is_asked_for_the_save_writes_from_a_thread"),
    ),
    Break(
        "background checkpoint: the shared-memory copy is cached",
        "workers/elastic/checkpoint_writer.py",
        "if _stager is None:",
        "if True:",
        CW("test_staging_reuses_its_shared_memory_copy_across_saves"),
    ),
    Break(
        "live notice: a rank parked on its peers' flag still owes the checkpoint",
        "workers/elastic/live.py",
        "event = elastic.store().control_record(generation) or {}",
        "event = elastic.elastic_event() or {}",
        _in("elastic/test_elastic_lib.py")(
            "test_a_rank_that_heard_of_a_notice_only_from_its_peers_still_owes_its_checkpoint"
        ),
    ),
    Break(
        "hand-over: every rank at the newest step gives",
        HO_PY,
        "sources=[r for r, s in enumerate(steps) if s == top],",
        "sources=[r for r, s in enumerate(steps) if s == top][:1],",
        HO("test_the_ranks_at_the_newest_step_give_and_the_rest_take"),
    ),
    Break(
        "hand-over: buckets packed up to their size",
        HO_PY,
        "        room -= size\n",
        "",
        HO("test_big_tensors_travel_alone_and_small_ones_are_packed_in_order"),
    ),
    Break(
        "hand-over: striped over the sources",
        HO_PY,
        "return sources[bucket % len(sources)]",
        "return sources[0]",
        HO("test_buckets_are_striped_over_the_sources_in_turn"),
    ),
    Break(
        "hand-over: takers load the optimizer state",
        HO_PY,
        'optim.load_state_dict({"state": optim_state, "param_groups": skel["param_groups"]})',
        "pass",
        HO("test_every_rank_ends_with_the_newest_state_striped_over_two_sources"),
    ),
]

# --- pure FSDP's in-memory reshard and peer copy (workers/elastic/sharded.py) --------------
SH_PY = "workers/elastic/sharded.py"
PC = _in("elastic/test_peer_copy.py")
PEER_COPY_BREAKS = [
    Break(
        "peer copy: stepped with the neighbour's gradients (never stale)",
        SH_PY,
        "        self.optim.step()\n        last.copy_step_s",
        "        last.copy_step_s",
        PC("test_a_node_lost_between_steps_is_rebuilt_from_its_peer_copy_bit_for_bit"),
    ),
    Break(
        "peer copy: a lost rank's rows from the node behind it on the ring",
        SH_PY,
        "elif (o - stride) % old_world in copies:",
        "elif (o + stride) % old_world in copies:",
        PC("test_a_lost_nodes_shards_come_from_the_node_behind_it_on_the_ring"),
        more=(
            (
                "sources.append((copies[(o - stride) % old_world], True))",
                "sources.append((copies[(o + stride) % old_world], True))",
            ),
        ),
    ),
    Break(
        "reshard: a survivor a step behind takes the step with its gradients",
        SH_PY,
        "finish = [n for n, h in survivors if h.step < top]",
        "finish = []",
        PC("test_a_survivor_a_step_behind_takes_the_step_only_with_its_gradients_in_hand"),
    ),
    Break(
        "a new generation's mesh forgets DTensor's caches",
        SH_PY,
        "    debug._clear_sharding_prop_cache()\n",
        "    return\n",
        PC("test_a_new_generations_mesh_is_not_an_old_one_from_dtensors_caches"),
    ),
]

# --- the CLI ---------------------------------------------------------------------------------
CLI_BREAKS = [
    Break(
        "an update aborted by a failed workflow task is tried again",
        "workers/cli/support.py",
        "if not task_failed(e) or time.monotonic() > deadline:",
        "if True:",
        _in("cli/test_update_retry.py")(
            "test_an_update_aborted_by_a_failed_workflow_task_is_tried_again"
        ),
    ),
]

# --- the suite's own guards: step-time records, hypothesis, long-list diffs ------------------
SUITE_BREAKS = [
    Break(
        "bench links: each host's sending is capped",
        "bench/netns.py",
        'shape = ["root", "tbf", "rate", f"{gbit}gbit",',
        'shape = ["root", "tbf", "rate", f"{gbit * 10}gbit",',
        _in("bench/test_handover_bench.py")("test_over_links_of_their_own_each_sender_is_capped"),
    ),
    Break(
        "a stuck record is rewritten at the next step",
        "workers/elastic/__init__.py",
        "if force or _clock.stale() or now - _last_step_times",
        "if force or now - _last_step_times",
        _in("elastic/test_elastic_lib.py")(
            "test_a_section_written_as_stuck_is_rewritten_at_the_next_step"
        ),
    ),
    Break(
        "hypothesis keeps no wall-clock deadline",
        "tests/conftest.py",
        'settings.register_profile("spotrain", deadline=None,',
        'settings.register_profile("spotrain", deadline=200,',
        _in("test_suite_hygiene.py")("test_a_slow_example_is_not_a_failure"),
    ),
    Break(
        "a long list's failed == explains itself briefly",
        "tests/assert_diff.py",
        "    return long_sequence_diff(left, right)",
        "    return None",
        _in("test_suite_hygiene.py")("test_a_long_list_that_differs_says_where_in_a_few_lines"),
    ),
]

# --- make-before-break's warning rule (workflows/policies/warning_rule.py) --------------------------------
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

BREAKS = (
    WARNING_RULE_BREAKS
    + PLANNER_BREAKS
    + AUTH_BREAKS
    + NOTICE_BREAKS
    + EC2_BREAKS
    + HANDOVER_BREAKS
    + PEER_COPY_BREAKS
    + CLI_BREAKS
    + SUITE_BREAKS
)
