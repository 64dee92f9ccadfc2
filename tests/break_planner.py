"""Break each documented spec field's effect in the planner, one at a time, and check that a
unit test catches it (the file is restored after each). Not collected by pytest; run it after
changing `workflows/job_planner.py` or its tests, from the repository root:

    .venv/bin/python tests/break_planner.py      # exit 1 if a broken effect went unnoticed
"""

import subprocess
import sys
import time
from pathlib import Path

JP = Path("workflows/job_planner.py")
PL = Path("workflows/planner.py")
MB = Path("workflows/make_before_break.py")
WR = Path("workflows/warning_rule.py")

M = [
    (
        "scale_config per world size",
        JP,
        "spec.scale_config.get(world, {})",
        "spec.scale_config.get(len(nodes), {})",
    ),
    (
        "on-demand type sized to the lost share",
        JP,
        "return min(fits, key=lambda t: t.on_demand_price).name",
        "return max(fits, key=lambda t: t.gpus).name",
    ),
    (
        "scaling_timeout_s growth debounce",
        JP,
        "return state.grow_since, state.grow_since + timedelta(\n"
        "        seconds=state.spec.elastic.scaling_timeout_s\n    )",
        "return state.grow_since, state.grow_since",
    ),
    (
        "scaling_timeout_s gang-start hold",
        JP,
        "hold = now + timedelta(seconds=state.spec.elastic.scaling_timeout_s)",
        "hold = now",
    ),
    (
        "faulty_scale_down_timeout_s",
        JP,
        "return now + timedelta(seconds=state.spec.elastic.faulty_scale_down_timeout_s)",
        "return now",
    ),
    (
        "graceful_shutdown_timeout_s",
        JP,
        "timeout = state.spec.elastic.graceful_shutdown_timeout_s",
        "timeout = 60.0",
    ),
    (
        "act_on_rebalance",
        JP,
        'if event.kind == "rebalance" and state.spec.elastic.warning_policy != "shrink":',
        "if False:",
    ),
    (
        "reclaim batching into one resize",
        JP,
        "    for other in state.inbox:\n",
        "    for other in state.inbox[:0]:\n",
    ),
    (
        "reclaim_policy (replace/drop)",
        JP,
        'owe = state.spec.elastic.reclaim_policy == "replace" or node.base',
        "owe = True",
    ),
    (
        "stall_timeout_s",
        JP,
        "(now - state.progress_at).total_seconds() > stall",
        "(now - state.progress_at).total_seconds() > 2 * stall",
    ),
    ("max_restarts", JP, "if state.restarts <= limit:", "if state.restarts <= limit + 1:"),
    (
        "min_nodes floor on scale-in",
        JP,
        "return ScaleDown(victims, max(state.spec.elastic.min_nodes, state.target - len(victims)))",
        "return ScaleDown(victims, state.target - len(victims))",
    ),
    (
        "max_nodes check on scale-out",
        JP,
        "if state.target + count > limit:",
        "if state.target + count > limit + 1:",
    ),
    (
        "opportunistic",
        JP,
        "grow=spec.elastic.opportunistic and state.target < state.ceiling",
        "grow=state.target < state.ceiling",
    ),
    (
        "return_to_spot (release fallback left out)",
        JP,
        "if not spare or not state.spec.on_demand.return_to_spot:",
        "if not spare:",
    ),
    (
        "return_to_spot (growth swaps back)",
        JP,
        "swaps_back = state.spec.on_demand.return_to_spot and",
        "swaps_back = True and",
    ),
    (
        "return_to_spot (capacity check)",
        JP,
        "swap = spec.on_demand.return_to_spot and not launching",
        "swap = not launching",
    ),
    ("on_demand.fallback", JP, "    if not spec.on_demand.fallback:\n        return 0\n", ""),
    (
        "on_demand.max_nodes",
        JP,
        "max(0, cap - spec.on_demand.base_nodes - used)",
        "max(0, cap - used)",
    ),
    (
        "on_demand.base_nodes ordered first",
        JP,
        "missing = max(0, state.spec.on_demand.base_nodes - sum(n.base for n in alive))",
        "missing = 0",
    ),
    ("total_gpus share (GPU packing)", JP, "        if held[used]:\n", "        if False:\n"),
    (
        "gpus_per_node share",
        JP,
        "return spec.gpus_per_node or 0, spec.gpus_per_node or spec.procs_per_node",
        "return 0, spec.procs_per_node",
    ),
    (
        "discrete_sizes / increment_step",
        JP,
        "e.min_nodes, e.max_nodes, e.increment_step, e.discrete_sizes)",
        "e.min_nodes, e.max_nodes, None, None)",
    ),
    (
        "growth never buys on-demand (spot_only)",
        JP,
        "od_ok = not spot_only and owed > 0 and room > 0",
        "od_ok = owed > 0 and room > 0",
    ),
    ("spot spread over pools (held)", JP, "            held[ranked[0]] += 1\n", ""),
    (
        "grant: on-demand nodes give way first",
        JP,
        'victims = [n for n in removable if n.lifecycle == "on-demand"][:extra_on_demand]',
        "victims = []",
    ),
    (
        "grant: below min preempts",
        JP,
        "preempt=grant.nodes < state.spec.elastic.min_nodes,",
        "preempt=False,",
    ),
    (
        "grant: base nodes never give way",
        JP,
        "removable = [n for n in removal_order(state) if not n.base]",
        "removable = removal_order(state)",
    ),
    ("pool report: priority", JP, "priority=spec.priority,", "priority=0,"),
    (
        "spot_price before the market's",
        JP,
        '        spec_type.spot_price\n        or state.spot_prices.get(f"{instance_type}@{zone}")',
        '        state.spot_prices.get(f"{instance_type}@{zone}")\n        or spec_type.spot_price',
    ),
    (
        "removal order: highest rank first",
        JP,
        "    return list(reversed(in_rank_order))",
        "    return in_rank_order",
    ),
    (
        "global_batch_size passed on",
        JP,
        "global_batch_size=spec.global_batch_size,",
        "global_batch_size=None,",
    ),
    (
        "uneven batch split",
        PL,
        "return split.small if rank < split.n_small else split.large",
        "return split.small",
    ),
    (
        "members: base then spot first",
        PL,
        'tier = 0 if c.base else (1 if c.lifecycle == "spot" else 2)',
        "tier = 0",
    ),
    (
        "early_warning / reclaim_notice: make_before_break",
        MB,
        'policy = e.warning_policy if event.kind == "rebalance" else e.reclaim_notice',
        'policy = "make_before_break"',
    ),
    ("max_surge_nodes", MB, "cap = e.max_nodes + e.max_surge_nodes", "cap = e.max_nodes + 1"),
    (
        "the pool's grant caps the overlap",
        MB,
        "cap = min(cap, state.grant.nodes if state.grant else 0)",
        "cap = cap",
    ),
    ("checkpoint p99 sets the swap-by time", MB, "return stats.p99_s", "return 0.0"),
    (
        "a late notice shrinks",
        MB,
        "if w.deadline is not None and swap_by(state, w.deadline) <= now]",
        "if False]",
    ),
    (
        "warning rule: a notice that swaps leaves nothing to gain",
        WR,
        "resizes_avoided = 0 if case.notice_swaps else 1",
        "resizes_avoided = 1",
    ),
    (
        "warning rule: a false positive pays the swap's pause",
        WR,
        "case.surge_price_h * case.boot_s / 3600 + pause_usd)",
        "case.surge_price_h * case.boot_s / 3600)",
    ),
    ("warning_reclaim_probability", WR, "p=e.warning_reclaim_probability,", "p=0.5,"),
    (
        "warning rule: every member's price",
        WR,
        "members_price_h=sum(n.price for n in state.member_nodes),",
        "members_price_h=state.member_nodes[0].price,",
    ),
    ("warning_rule: always", WR, 'if state.spec.elastic.warning_rule == "always":', "if False:"),
    (
        "warning rule: the notice swaps only if the boot fits",
        WR,
        "and swap_window >= BOOT_S",
        "",
    ),
]


def main() -> int:
    survivors = []
    for name, path, old, new in M:
        text = path.read_text()
        if text.count(old) != 1:
            print(f"?? {name}: pattern found {text.count(old)} times")
            survivors.append(name)
            continue
        path.write_text(text.replace(old, new))
        started = time.monotonic()
        try:
            run = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pytest",
                    "-x",
                    "-q",
                    "-p",
                    "no:cacheprovider",
                    "tests/test_planner_job.py",
                    "tests/test_planner.py",
                    "tests/test_make_before_break_planner.py",
                    "tests/test_warning_rule.py",
                ],
                capture_output=True,
                text=True,
            )
        finally:
            path.write_text(text)
        took = time.monotonic() - started
        failed = [ln.split(" - ")[0] for ln in run.stdout.splitlines() if ln.startswith("FAILED")]
        if run.returncode == 0:
            survivors.append(name)
            print(f"SURVIVED  {name}")
        else:
            print(
                f"caught    {name:45s} {took:5.1f}s  {failed[0] if failed else run.stdout[-200:]}"
            )
    print(f"{len(M) - len(survivors)}/{len(M)} broken effects caught; survivors: {survivors}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
