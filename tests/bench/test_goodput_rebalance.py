"""The goodput benchmark's rebalance recommendations (`bench/goodput/rebalance.py`): the
published sample as default, leads within its range, false ones at the stated share, every
node recommended once, and the count of what came of them; then one tiny run of the
benchmark with them, where acting on every warning swaps and the product's rule does not."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import pytest

from bench import goodput
from bench.goodput import rebalance as goodput_rebalance
from bench.goodput.rebalance import Recommendations
from tests.bench.test_bench_smoke import TICKS_A, write_trace


def test_the_default_is_the_published_sample() -> None:
    r = Recommendations()
    assert (r.fp_rate, r.lead_min_s, r.lead_max_s) == (0.5, 17 * 60, 8 * 3600 + 42 * 60)


def test_leads_are_log_uniform_within_the_range_and_fixed_when_it_is_one_point() -> None:
    rng = random.Random(1)
    leads = [goodput_rebalance.log_uniform(1020, 31320, rng) for _ in range(4000)]
    assert min(leads) >= 1020 and max(leads) <= 31320
    assert statistics.median(leads) == pytest.approx(math.sqrt(1020 * 31320), rel=0.1)
    assert goodput_rebalance.log_uniform(600, 600, rng) == 600


@pytest.mark.parametrize("fp_rate", [0.0, 0.3, 0.5, 0.8])
def test_false_recommendations_are_the_stated_share(fp_rate: float) -> None:
    rng = random.Random(2)
    false = sum(goodput_rebalance.false_count(fp_rate, rng) for _ in range(20_000))
    assert false / (false + 20_000) == pytest.approx(fp_rate, abs=0.01)


def test_send_recommends_each_node_once_and_counts_what_was_taken() -> None:
    r = Recommendations(fp_rate=0.9, seed=3)
    others = [f"i-{i}" for i in range(10)]
    first = r.send(["i-0"], others, 0.0)
    assert first[0] == "i-0" and len(first) > 1 and len(set(first)) == len(first)
    assert set(first) <= set(others) and r.doomed == {"i-0"}
    again = r.send(["i-0", *first], others, 60.0)  # already recommended: nothing new
    assert again == []
    r.reclaimed("i-0", 31_320.0)
    r.reclaimed(first[1], 31_321.0)  # later than the longest lead: never taken
    r.reclaimed("i-99", 0.0)  # taken without a recommendation: not counted
    assert r.report() == {
        "recommended": len(first),
        "false": len(first) - 1,
        "followed_by_reclaim": 1,
        "never_taken": len(first) - 1,
    }
    assert [w[1:] for w in r.warnings([(100.0, "z"), (10**6, "z")])] == [("z", 10**6)]


def test_false_recommendations_without_a_node_to_go_to_wait_for_the_next_chance() -> None:
    r = Recommendations(fp_rate=0.9, seed=4)
    assert r.send(["i-0"], ["i-0"], 0.0) == ["i-0"]  # no other node: owed
    assert r.owed > 0
    sent = r.send(["i-1"], ["i-1", "i-2", "i-3"], 60.0)
    false = sent[1:]
    assert sent[0] == "i-1" and set(false) <= {"i-2", "i-3"} and false  # the owed ones go
    assert len(false) == 2 or r.owed == 0  # as many as there are nodes for
    assert r.report()["false"] == len(false)


def test_the_benchmark_with_recommendations(tmp_path: Path) -> None:
    """Every warning true, 10 min ahead: plain elastic ignores them (each warned node is the
    one its drop takes), acting on every warning swaps nodes out, the product's rule (the
    sample's 0.5 prior) acts on none."""
    report = goodput.main(
        [
            *("--trace", f"us-test-1a={write_trace(tmp_path / 'a.json', TICKS_A[:24])}"),
            *("--max-nodes", "3", "--min-nodes", "1", "--work-node-hours", "6"),
            *("--rebalance", "--rebalance-fp-rate", "0", "--max-surge-nodes", "2"),
            *("--rebalance-lead-min-s", "600", "--rebalance-lead-max-s", "600"),
            *("--only", "elastic", "--no-deadline", "--out", str(tmp_path)),
            *("--spot-price", "0.9701", "--on-demand-price", "3.06"),  # a.json names no cloud
            *("--wedge-s", "15", "--run-timeout-s", "60"),
        ]
    )
    rows = {r["policy"]: r for r in report["rows"]}
    plain, rule = rows["spotrain elastic"], rows["spotrain elastic +mbb"]
    always = rows["spotrain elastic +mbb always"]
    assert plain["recommended"] > 0 and plain["recommended_false"] == 0
    assert plain["recommended_taken"] == plain["recommended"]
    assert (plain["swapped"], rule["swapped"]) == (0, 0) and always["swapped"] > 0
    assert always["recommended_taken"] < always["recommended"]  # swapped out before the drop
