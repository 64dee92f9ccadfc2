"""What the goodput benchmark pays for a node-hour of each trace: the price table by the cloud
and GPU a trace's file name says (issue 48: GCP traces were priced at AWS's prices), unless
--spot-price / --on-demand-price price every trace alike."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..common import table


@dataclass(frozen=True)
class NodePrice:
    """One node (one GPU) of a cloud, USD per hour."""

    instance: str
    on_demand: float
    spot: float


# Keyed by (cloud, GPU), both as the trace's file name spells them. The 1-GPU shape each
# cloud sells for that GPU; list prices, without sustained-use or committed discounts.
PRICES: dict[tuple[str, str], NodePrice] = {
    # AWS p3.2xlarge (1 V100), us-east-1: on demand 3.06 (AWS's list price); spot 0.9701,
    # what the "Can't Be Late" paper's simulations use (../shared/traces/README.md) and
    # every committed goodput table (bench/results/goodput*.json) was priced at.
    ("aws", "v100"): NodePrice("p3.2xlarge", on_demand=3.06, spot=0.9701),
    # GCP n1-standard-8 + 1 NVIDIA V100 in us-central1, from Google's public list prices: on
    # demand 0.38 (the VM) + 2.48 (the GPU) = 2.86. Spot about 0.86 (VM and GPU together):
    # Google's spot prices float (they may change once a day), and this is the approximate
    # public list price as of 2026-12-07, not checked against Google's price page when it
    # was written; --spot-price and --on-demand-price give another day's or region's.
    ("gcp", "v100"): NodePrice("n1-standard-8 + 1 V100", on_demand=2.86, spot=0.86),
}

_CLOUD = re.compile(r"(?<![a-z])(aws|gcp)(?![a-z])")
_GPU = re.compile(r"[a-z]+\d+[a-z]*")  # a token of the name: v100, a100, a10g
# A GCP zone (us-central1-a, europe-west4-b), which the AWS-shaped zone pattern Trace.load
# reads names with (us-east-2b) does not match.
_GCP_ZONE = re.compile(r"(?<![a-z])[a-z]+-[a-z]+\d+-[a-z](?![a-z0-9])")

FLAGS = "--spot-price and --on-demand-price"


class PriceError(ValueError):
    """A trace the benchmark cannot price: the command line says why, without a traceback."""


def cloud_of(path: str | Path) -> str:
    """The cloud ("aws" or "gcp") a trace's file name says (the `aws` of
    availability_16-node_aws-08-27-2023_us-east-2b_v100_1.json), as its own word; PriceError
    for a name that says neither or both."""
    name = Path(path).name
    found = set(_CLOUD.findall(name.lower()))
    if len(found) != 1:
        says = "both aws and gcp" if found else "no cloud (aws or gcp)"
        raise PriceError(
            f"{name}: the file name says {says}, so its prices are unknown: give {FLAGS}"
        )
    return found.pop()


def gpu_of(path: str | Path) -> str:
    """The GPU a trace's file name names ("v100"), "" if none: the token of letters then
    digits among its '_'-separated parts."""
    tokens = Path(path).stem.lower().split("_")
    return next((t for t in tokens if _GPU.fullmatch(t)), "")


def table_price(path: str | Path) -> NodePrice:
    """The table's price for a trace, by its file name; PriceError if the table has none."""
    cloud, gpu = cloud_of(path), gpu_of(path)
    try:
        return PRICES[cloud, gpu]
    except KeyError:
        raise PriceError(
            f"{Path(path).name}: no {cloud} {gpu or '(no GPU named)'} price in "
            f"bench/goodput/prices.py (it has {', '.join(' '.join(k) for k in PRICES)}): "
            f"give {FLAGS}"
        ) from None


def with_zone(arg: str) -> str:
    """`ZONE=PATH` for a GCP trace named without its zone given (Trace.load would fall back to
    the whole file name); every other argument as it is."""
    if "=" in arg:
        return arg
    found = _GCP_ZONE.search(Path(arg).name)
    return f"{found.group(0)}={arg}" if found else arg


@dataclass(frozen=True)
class TracePrice:
    """What one trace's nodes were priced at, and where the figures came from."""

    zone: str
    file: str
    cloud: str  # "" where the name says none and the flags price it
    gpu: str
    instance: str
    spot_price: float
    on_demand_price: float
    source: str  # "table", "flags", or "table, --spot-price" where one flag overrode


PRICE_COLUMNS = ["zone", "cloud", "gpu", "instance", "spot_price", "on_demand_price", "source"]


def trace_price(zone: str, arg: str, spot: float | None, on_demand: float | None) -> TracePrice:
    """A trace's prices (`arg`: its `[ZONE=]PATH`): each flag given overrides the table for it;
    with both given the name need say no cloud."""
    path = arg.rpartition("=")[2]
    name = Path(path).name
    if spot is not None and on_demand is not None:
        try:
            cloud = cloud_of(path)
        except PriceError:
            cloud = ""
        return TracePrice(zone, name, cloud, gpu_of(path), "", spot, on_demand, "flags")
    listed = table_price(path)
    flags = (("--spot-price", spot), ("--on-demand-price", on_demand))
    overridden = [flag for flag, value in flags if value is not None]
    return TracePrice(
        zone,
        name,
        cloud_of(path),
        gpu_of(path),
        listed.instance,
        listed.spot if spot is None else spot,
        listed.on_demand if on_demand is None else on_demand,
        ", ".join(["table", *overridden]),
    )


def one_price(prices: list[TracePrice]) -> tuple[float, float]:
    """The scenario's (spot, on-demand) price. The traces of one scenario merge into one
    job's capacity, and its node-hours are billed by lifecycle, not by trace (Row, the
    workflow's JobResult, one SimulatedCloud spot price, the job spec's one instance type),
    and its on-demand nodes belong to no trace; so traces priced differently (clouds mixed)
    are refused rather than billed at one of their prices."""
    distinct = {(p.spot_price, p.on_demand_price) for p in prices}
    if len(distinct) > 1:
        each = "; ".join(
            f"{p.zone} ({p.cloud or 'no cloud'}): spot {p.spot_price}, on-demand "
            f"{p.on_demand_price}"
            for p in prices
        )
        raise PriceError(
            f"traces priced differently in one scenario ({each}): the benchmark bills one "
            f"job's node-hours at one price, so it cannot mix clouds; run each cloud's traces "
            f"apart, or give {FLAGS} to price them all alike"
        )
    return distinct.pop()


def price_table(prices: list[TracePrice]) -> str:
    """The readable form of the report's `prices`, each price whole (the table's rounding
    would show 0.9701 as 0.97)."""
    rows = [
        vars(p) | {"spot_price": f"{p.spot_price:g}", "on_demand_price": f"{p.on_demand_price:g}"}
        for p in prices
    ]
    return "prices per trace (USD per node-hour):\n" + table(rows, PRICE_COLUMNS)
