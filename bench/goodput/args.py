"""The goodput benchmark's command line (bench/goodput/): the setup's numbers, the traces,
their prices (prices.py) and which rows to run."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ..common import DEFAULT_TRACE, REPO, SHARED_TRACES, load_traces
from .model import Setup
from .prices import PriceError, one_price, trace_price, with_zone


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
    for flag, what in (("--spot-price", "spot"), ("--on-demand-price", "on-demand")):
        p.add_argument(
            flag,
            type=float,
            default=None,
            metavar="USD",
            help=f"USD per {what} node-hour, for every trace (default: each trace's cloud's "
            "price, by its file name: aws or gcp, and its GPU; the table in "
            "bench/goodput/prices.py)",
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
    fields = {
        k: v
        for k, v in vars(args).items()
        if hasattr(defaults, k) and k not in ("resize", "spot_price", "on_demand_price")
    }
    named = [with_zone(a) for a in args.trace] or [str(SHARED_TRACES / DEFAULT_TRACE)]
    traces = load_traces(named)
    try:
        args.prices = [
            trace_price(t.zone, a, args.spot_price, args.on_demand_price)
            for t, a in zip(traces, named, strict=True)
        ]
        spot, on_demand = one_price(args.prices)
    except PriceError as err:
        p.error(str(err))  # exits 2 with the message, no traceback
    setup = replace(defaults, **fields, traces=traces, spot_price=spot, on_demand_price=on_demand)
    return setup, args
