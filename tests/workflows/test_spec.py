"""The job spec: the example validates; every impossible spec is refused with the field named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from spotrain.workflows.spec import SpecError, parse_spec
from tests.jobs import job_spec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "job.yaml"


def refusal(spec: Any) -> str:
    with pytest.raises(SpecError) as err:
        parse_spec(spec)
    return str(err.value)


def test_example_and_defaults() -> None:
    spec = parse_spec(yaml.safe_load(EXAMPLE.read_text()))
    assert spec.elastic.min_nodes == 2 and spec.elastic.max_nodes == 4
    assert spec.elastic.reclaim_policy == "replace" and spec.on_demand.fallback
    minimal = parse_spec(job_spec())
    assert minimal.type == "pytorch" and minimal.cleanup == "keep_failed"
    assert minimal.placement == "zone" and minimal.placement_group is False
    assert parse_spec(job_spec(placement_group=True)).placement_group is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"elastic": {"min_nodes": 5}}, "elastic: min_nodes (5) > max_nodes (4)"),
        (
            {"elastic": {"increment_step": 2, "discrete_sizes": [2, 4]}},
            "set increment_step or discrete_sizes, not both",
        ),
        (
            {"elastic": {"discrete_sizes": [2, 8]}},
            "discrete_sizes [8] outside [min_nodes, max_nodes] = [2, 4]",
        ),
        ({"elastic": {"initial_nodes": 9}}, "initial_nodes (9) outside"),
        (
            {"elastic": {"graceful_shutdown_timeout_s": -1}},
            "elastic.graceful_shutdown_timeout_s: Input should be greater than 0",
        ),
        ({"spot": {"instance_types": []}}, "spot.instance_types: List should have at least 1 item"),
        ({"name": "Bad_Name"}, "name: String should match pattern"),
        ({"checkpoint": "/no/scheme"}, "must be s3://bucket/prefix or file:///path"),
        ({"total_steps": 0}, "total_steps: Input should be greater than 0"),
        ({"gpus_per_node": 4}, "gpus_per_node (4) exceeds every instance type's GPUs ([1])"),
        (
            {"global_batch_size": 3},
            "global_batch_size (3) is smaller than the largest world size (4)",
        ),
        ({"on_demand": {"base_nodes": 5}}, "on_demand.base_nodes (5) > elastic.max_nodes (4)"),
        ({"spot": {"enabled": False}, "on_demand": {"fallback": False}}, "no nodes"),
        (
            {"elastic": {"min_nodes": 2, "typo_field": 1}},
            "elastic.typo_field: Extra inputs are not permitted",
        ),
        ({"tpye": "pytorch"}, "tpye: Extra inputs are not permitted"),
        # as strict as the TrainingJob CRD's schema: text or a boolean is no count
        ({"total_steps": "1000"}, "total_steps: Input should be a valid integer"),
        ({"total_steps": "1e3"}, "total_steps: Input should be a valid integer"),
        ({"elastic": {"min_nodes": True}}, "elastic.min_nodes: Input should be a valid integer"),
        (
            {"elastic": {"opportunistic": "yes"}},
            "elastic.opportunistic: Input should be a valid boolean",
        ),
        (
            {"elastic": {"graceful_shutdown_timeout_s": "60"}},
            "elastic.graceful_shutdown_timeout_s: Input should be a valid number",
        ),
        ({"elastic": {"peer_copy": True}}, "peer_copy keeps shards in memory for live resize"),
        ({"spot": {"more_regions": ["us-west-2", "us-east-1"]}}, "more_regions repeats us-east-1"),
        # a cluster placement group is one zone's
        (
            {"placement": "region", "placement_group": True},
            "(spec): placement_group needs placement: zone (a cluster placement group is one "
            "zone's), not region",
        ),
        ({"placement": "any", "placement_group": True}, "placement_group needs placement: zone"),
        ({"placement_group": "yes"}, "placement_group: Input should be a valid boolean"),
        (
            {"spot": {"more_regions": ["us-west-2"], "zones": ["us-west-2a", "eu-west-1b"]}},
            "spot: zones ['eu-west-1b'] are in none of the regions ['us-east-1', 'us-west-2']",
        ),
        (
            {
                "total_gpus": 15,
                "spot": {
                    "instance_types": [
                        {"name": "a", "gpus": 10, "on_demand_price": 1},
                        {"name": "b", "gpus": 8, "on_demand_price": 1},
                    ]
                },
            },
            "total_gpus 15 packs onto 2 node(s) using 10 + 5 GPUs: set elastic.max_nodes to 2",
        ),
    ],
)
def test_impossible_specs_are_refused_with_the_field(
    overrides: dict[str, Any], message: str
) -> None:
    assert message in refusal(job_spec(**overrides))


def test_every_problem_is_listed_and_non_mappings_refused() -> None:
    text = refusal({"name": "x"})
    assert "command: Field required" in text and "spot: Field required" in text
    assert "expected a mapping, got list" in refusal([1, 2])
