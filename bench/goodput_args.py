"""The goodput benchmark's command line (bench/goodput.py): the setup's numbers, the traces,
and which rows to run."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from .common import REPO, load_traces
from .goodput_model import Setup


def parse_args(argv: list[str] | None, description: str) -> tuple[Setup, argparse.Namespace]:
    """The benchmark's setup from the command line (a flag for each of its numbers), and the
    other options."""
    p = argparse.ArgumentParser(prog="bench.goodput", description=description)
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="[ZONE=]PATH",
        help="a trace file; repeat for several zones (default: shared us-east-2b)",
    )
    defaults = Setup(traces=[])
    for name in (
        "max_nodes",
        "min_nodes",
        "base_nodes",
        "work_node_hours",
        "steps_per_node_hour",
        "scaling_efficiency",
        "checkpoint_minutes",
        "restart_cost_s",
        "notice_s",
        "checkpoint_s",
        "grace_s",
        "rebalance_fp_rate",
        "rebalance_lead_min_s",
        "rebalance_lead_max_s",
        "max_surge_nodes",
        "state_gb",
        "gradient_gb",
        "sync_steps_per_s",
        "cross_zone_slowdown",
        "boot_median_s",
        "boot_sigma",
        "seed",
        "spot_price",
        "on_demand_price",
        "deadline_h",
        "deadline_margin_s",
        "run_timeout_s",
        "wedge_s",
    ):
        default = getattr(defaults, name)
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=int if isinstance(default, int) else float,
            default=default,
        )
    p.add_argument(
        "--resize",
        choices=["live", "restart", "both"],
        default="live",
        help="spotrain's elastic.resize: live (the product's, default), restart, or both "
        "(live's rows, then restart's marked '(restart)')",
    )
    p.add_argument(
        "--live-resize-results",
        dest="live_results",
        default="",
        metavar="PATH",
        help="live mode's pauses from this bench.live_resize results file (default: the "
        "data-parallel file measured nearest --state-gb; e.g. "
        "bench/results/live_resize_fsdp_25m.json)",
    )
    p.add_argument(
        "--placement",
        choices=["zone", "region", "any"],
        default=defaults.placement,
        help="spotrain's placement (default any: a job spans the traces' zones, traffic "
        "unbilled, like the baselines; zone: one zone at a time, hopping)",
    )
    p.add_argument("--no-deadline", action="store_true", help="skip the deadline policies")
    p.add_argument("--no-mbb", action="store_true", help="skip the make-before-break rows")
    p.add_argument(
        "--rebalance",
        action="store_true",
        help="rebalance recommendations ahead of drops, false ones too (the --rebalance-* "
        "flags; default: the published sample), and a '+mbb always' twin",
    )
    p.add_argument(
        "--only",
        default="",
        metavar="P,P,...",
        help="only these spotrain policies: elastic, +fallback, +od-base",
    )
    p.add_argument(
        "--deadline-factors",
        default="",
        metavar="F,F,...",
        help="also sweep deadlines at these multiples of the all-on-demand time",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    fields = {k: v for k, v in vars(args).items() if hasattr(defaults, k) and k != "resize"}
    return replace(defaults, **fields, traces=load_traces(args.trace)), args
