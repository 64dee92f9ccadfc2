"""Each trace priced from its own cloud (issue 48): the cloud and GPU read from the file name,
the table's prices reaching a row's cost, the flags overriding them, and a clear error (no
traceback) for a name that says no cloud and for clouds mixed in one scenario. Pure: no
benchmark runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput.args import parse_args
from bench.goodput.model import all_on_demand, oracle
from bench.goodput.prices import (
    PRICES,
    PriceError,
    cloud_of,
    gpu_of,
    price_table,
    table_price,
    with_zone,
)

AWS = "availability_16-node_aws-08-27-2023_us-east-2b_v100_1.json"
GCP = "availability_16-node_gcp-08-27-2023_us-central1-a_v100_1.json"
TINY = ["--max-nodes", "2", "--work-node-hours", "4", "--steps-per-node-hour", "100"]
TINY += ["--boot-median-s", "0", "--restart-cost-s", "0"]


def trace(tmp_path: Path, name: str, data: tuple[int, ...] = (2, 2, 2, 2)) -> str:
    """A tiny trace file: `data` nodes, an hour a tick."""
    path = tmp_path / name
    path.write_text(json.dumps({"metadata": {"gap_seconds": 3600}, "data": list(data)}))
    return str(path)


def test_the_cloud_and_gpu_are_read_from_the_file_name() -> None:
    assert (cloud_of(AWS), gpu_of(AWS)) == ("aws", "v100")
    assert (cloud_of(GCP), gpu_of(GCP)) == ("gcp", "v100")
    assert cloud_of(f"/some/dir/{GCP}") == "gcp"  # the name, not the folder
    assert cloud_of("us-test-1a_AWS_a100.json") == "aws" and gpu_of("x_aws_a10g_2.json") == "a10g"
    assert gpu_of("availability_aws.json") == ""
    for name in ("a.json", "laws_gcpx.json", "availability_16-node_azure_eastus-1_v100.json"):
        with pytest.raises(PriceError, match="says no cloud"):
            cloud_of(name)
    with pytest.raises(PriceError, match="both aws and gcp"):
        cloud_of("aws_vs_gcp.json")


def test_the_table_prices_aws_as_the_committed_tables_and_gcp_apart() -> None:
    aws, gcp = table_price(AWS), table_price(GCP)
    assert (aws.instance, aws.spot, aws.on_demand) == ("p3.2xlarge", 0.9701, 3.06)
    assert (gcp.spot, gcp.on_demand) == (0.86, 2.86) and "n1-standard-8" in gcp.instance
    assert set(PRICES) == {("aws", "v100"), ("gcp", "v100")}
    with pytest.raises(PriceError, match="no gcp a100 price"):
        table_price(GCP.replace("v100", "a100"))


def test_a_gcp_zone_is_named_from_the_file_name() -> None:
    assert with_zone(f"/d/{GCP}") == f"us-central1-a=/d/{GCP}"
    assert with_zone(f"/d/{AWS}") == f"/d/{AWS}"  # Trace.load reads AWS zones itself
    assert with_zone(f"z=/d/{GCP}") == f"z=/d/{GCP}"


def test_a_gcp_trace_is_billed_at_gcps_prices(tmp_path: Path) -> None:
    setup, args = parse_args(["--trace", trace(tmp_path, GCP), *TINY], "")
    assert (setup.spot_price, setup.on_demand_price) == (0.86, 2.86)
    assert setup.traces[0].zone == "us-central1-a"
    best = oracle(setup)  # 2 nodes for 2 h: 4 spot node-hours
    assert best.spot_node_h == pytest.approx(4.0)
    assert best.report(setup, best.wall_h)["cost"] == pytest.approx(4 * 0.86)
    od = all_on_demand(setup)
    assert od.report(setup, best.wall_h)["cost"] == pytest.approx(4 * 2.86)
    [price] = [vars(p) for p in args.prices]
    assert price == {
        "zone": "us-central1-a",
        "file": GCP,
        "cloud": "gcp",
        "gpu": "v100",
        "instance": "n1-standard-8 + 1 V100",
        "spot_price": 0.86,
        "on_demand_price": 2.86,
        "source": "table",
    }
    shown = price_table(args.prices)
    assert "us-central1-a" in shown and "0.86" in shown and "2.86" in shown and "table" in shown


def test_an_aws_trace_keeps_the_committed_prices(tmp_path: Path) -> None:
    setup, args = parse_args(["--trace", trace(tmp_path, AWS), *TINY], "")
    assert (setup.spot_price, setup.on_demand_price) == (0.9701, 3.06)
    assert args.prices[0].zone == "us-east-2b" and args.prices[0].cloud == "aws"
    assert "0.9701" in price_table(args.prices)  # whole, not the table's 3 figures
    best = oracle(setup)
    assert best.report(setup, best.wall_h)["cost"] == pytest.approx(4 * 0.9701)


def test_the_flags_override_the_table_for_every_trace(tmp_path: Path) -> None:
    gcp = trace(tmp_path, GCP)
    setup, args = parse_args(["--trace", gcp, "--spot-price", "0.5", *TINY], "")
    assert (setup.spot_price, setup.on_demand_price) == (0.5, 2.86)
    assert args.prices[0].source == "table, --spot-price"
    flags = ["--spot-price", "0.5", "--on-demand-price", "1.5"]
    setup, args = parse_args(["--trace", gcp, *flags, *TINY], "")
    assert (setup.spot_price, setup.on_demand_price) == (0.5, 1.5)
    best = oracle(setup)
    assert best.report(setup, best.wall_h)["cost"] == pytest.approx(4 * 0.5)
    # both flags: a name that says no cloud, and clouds mixed, are priced alike
    plain = f"us-test-1a={trace(tmp_path, 'a.json')}"
    aws = trace(tmp_path, AWS)
    setup, args = parse_args(["--trace", plain, "--trace", gcp, "--trace", aws, *flags], "")
    assert [(p.cloud, p.spot_price, p.source) for p in args.prices] == [
        ("", 0.5, "flags"),
        ("gcp", 0.5, "flags"),
        ("aws", 0.5, "flags"),
    ]


def test_a_trace_of_no_known_cloud_is_refused_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = f"us-test-1a={trace(tmp_path, 'a.json')}"
    for argv in (["--trace", plain], ["--trace", plain, "--spot-price", "0.5"]):
        with pytest.raises(SystemExit) as exited:
            parse_args(argv, "")
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "a.json: the file name says no cloud" in err
        assert "--spot-price and --on-demand-price" in err and "Traceback" not in err


def test_clouds_mixed_in_one_scenario_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--trace", trace(tmp_path, AWS), "--trace", trace(tmp_path, GCP)]
    with pytest.raises(SystemExit) as exited:
        parse_args(argv, "")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "cannot mix clouds" in err and "us-east-2b (aws)" in err and "us-central1-a (gcp)" in err
    # one flag leaves the other price differing: still refused
    with pytest.raises(SystemExit):
        parse_args([*argv, "--spot-price", "0.5"], "")
