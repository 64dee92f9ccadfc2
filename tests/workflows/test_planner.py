"""The planner's pure decisions, property-tested with hypothesis."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from spotrain.workflows.job import planner
from spotrain.workflows.job.planner import Candidate


@given(world=st.integers(1, 512), extra=st.integers(0, 10_000))
def test_uneven_batch_adds_up_and_differs_by_at_most_one(world: int, extra: int) -> None:
    global_batch = world + extra
    split = planner.uneven_batch(global_batch, world)
    assert split.small * split.n_small + split.large * (world - split.n_small) == global_batch
    assert split.large - split.small in (0, 1)
    assert 1 <= split.n_small <= world and split.small >= 1
    shares = [planner.local_batch_size(global_batch, world, r) for r in range(world)]
    assert sum(shares) == global_batch


def test_uneven_batch_example_and_refusal() -> None:
    assert planner.uneven_batch(10, 4) == planner.BatchSplit(small=2, large=3, n_small=2)
    assert planner.uneven_batch(12, 4) == planner.BatchSplit(small=3, large=3, n_small=4)
    try:
        planner.uneven_batch(3, 4)
    except ValueError as err:
        assert "cannot split a batch of 3 over 4 ranks" in str(err)
    else:
        raise AssertionError("a batch smaller than the world must be refused")


@given(lo=st.integers(1, 20), span=st.integers(0, 40), step=st.integers(1, 8))
def test_allowed_sizes_with_a_step(lo: int, span: int, step: int) -> None:
    sizes = planner.allowed_sizes(lo, lo + span, step, None)
    assert sizes[0] == lo and all(b - a == step for a, b in itertools.pairwise(sizes))
    assert sizes[-1] <= lo + span < sizes[-1] + step


@given(
    sizes=st.lists(st.integers(1, 64), min_size=1, max_size=8),
    available=st.integers(0, 80),
    cap=st.none() | st.integers(0, 80),
)
def test_best_size_is_the_largest_allowed_that_fits(
    sizes: list[int], available: int, cap: int | None
) -> None:
    best = planner.best_size(available, sorted(set(sizes)), cap)
    limit = available if cap is None else min(available, cap)
    fitting = [s for s in sizes if s <= limit]
    assert best == (max(fitting) if fitting else None)


def test_discrete_sizes_skip_sizes_not_listed() -> None:
    sizes = planner.allowed_sizes(2, 8, None, [8, 2, 4])
    assert sizes == [2, 4, 8]
    assert planner.best_size(7, sizes) == 4
    assert planner.best_size(1, sizes) is None


candidates = st.lists(
    st.builds(
        Candidate,
        slot=st.integers(0, 50),
        lifecycle=st.sampled_from(["spot", "on-demand"]),
        base=st.booleans(),
    ),
    unique_by=lambda c: c.slot,
    max_size=12,
)


@given(ready=candidates, data=st.data())
def test_choose_members_prefers_base_then_spot_and_keeps_rank_order(
    ready: list[Candidate], data: st.DataObject
) -> None:
    slots = [c.slot for c in ready]
    current = data.draw(st.lists(st.sampled_from(slots), unique=True) if slots else st.just([]))
    size = data.draw(st.integers(0, len(ready)))
    chosen = planner.choose_members(current, ready, size)
    assert len(chosen) == size and len(set(chosen)) == size
    by_slot = {c.slot: c for c in ready}

    def tier(c: Candidate) -> int:
        return 0 if c.base else (1 if c.lifecycle == "spot" else 2)

    left_out = [c for c in ready if c.slot not in chosen]
    if chosen and left_out:  # nobody left out is preferred to anyone chosen
        assert max(tier(by_slot[s]) for s in chosen) <= min(tier(c) for c in left_out)
    kept = [s for s in chosen if s in current]
    assert kept == [s for s in current if s in chosen]  # survivors keep their relative ranks
    assert chosen[: len(kept)] == kept  # newcomers go last


@given(
    members=st.lists(st.text(min_size=1, max_size=5), unique=True, max_size=10),
    count=st.integers(0, 12),
)
def test_scale_in_by_count_removes_the_highest_ranks(members: list[str], count: int) -> None:
    victims = planner.scale_in_victims(members, count, None)
    assert victims == list(reversed(members))[:count]


def test_scale_in_by_name_keeps_only_known_members() -> None:
    assert planner.scale_in_victims(["a", "b", "c"], None, ["c", "zz", "a"]) == ["a", "c"]


@given(
    pools=st.lists(
        st.tuples(st.sampled_from(["g5", "p3"]), st.sampled_from(["a", "b", "c"])),
        unique=True,
        min_size=1,
    ),
    count=st.integers(0, 30),
)
def test_diversify_spreads_evenly(pools: list[tuple[str, str]], count: int) -> None:
    picks = planner.diversify(pools, {}, count)
    assert len(picks) == count
    load = [picks.count(p) for p in pools]
    assert max(load) - min(load) <= 1


def test_diversify_fills_the_emptiest_pool_first() -> None:
    pools = [("g5", "a"), ("g5", "b")]
    assert planner.diversify(pools, {("g5", "a"): 3}, 2) == [("g5", "b"), ("g5", "b")]
    assert planner.diversify([], {}, 3) == []


@given(total=st.integers(1, 200), shapes=st.lists(st.integers(1, 16), min_size=1, max_size=4))
def test_pack_gpus_never_over_allocates(total: int, shapes: list[int]) -> None:
    nodes = planner.pack_gpus(total, shapes)
    assert sum(used for _, used in nodes) == total
    assert all(0 < used <= shape and shape in shapes for shape, used in nodes)
    largest = max(shapes)
    assert len(nodes) == -(-total // largest)  # as few nodes as the largest shape allows


def test_pack_gpus_example() -> None:
    assert planner.pack_gpus(15, [10, 8]) == [(10, 10), (8, 5)]


@given(left=st.floats(-100, 1000), graceful=st.floats(1, 600))
def test_grace_never_exceeds_the_notice_or_the_timeout(left: float, graceful: float) -> None:
    grace = planner.grace_for_notice(left, graceful)
    assert 0 <= grace <= graceful and grace <= max(0.0, left - 5)


pools_strategy = st.lists(
    st.tuples(st.sampled_from(["g1", "g4", "g8"]), st.sampled_from(["za", "zb", "zc"])),
    unique=True,
    max_size=9,
)
held_strategy = st.dictionaries(
    st.tuples(st.sampled_from(["g1", "g4", "g8"]), st.sampled_from(["za", "zb", "zc"])),
    st.integers(0, 5),
)
GPUS = {"g1": 1, "g4": 4, "g8": 8}


@given(offers=pools_strategy, need=st.integers(0, 8), held=held_strategy)
def test_spot_pools_fit_the_share_snuggest_first_and_spread(
    offers: list[tuple[str, str]], need: int, held: dict[tuple[str, str], int]
) -> None:
    ranked = planner.spot_pools(offers, GPUS, need, held)
    fitting = [p for p in offers if GPUS[p[0]] >= need]
    assert sorted(ranked) == sorted(fitting)  # every fitting pool, to fall over to; no other
    if ranked:
        first = ranked[0]
        snug = min(GPUS[p[0]] for p in fitting)
        assert GPUS[first[0]] == snug  # the fewest idle GPUs
        same_shape = [p for p in fitting if GPUS[p[0]] == snug]
        assert held.get(first, 0) == min(held.get(p, 0) for p in same_shape)  # spread
        assert [GPUS[p[0]] for p in ranked[1:]] == sorted(GPUS[p[0]] for p in ranked[1:])


@given(offers=pools_strategy, need=st.integers(0, 8), held=held_strategy)
def test_spot_pools_that_fill_zones_buy_where_the_job_holds_most(
    offers: list[tuple[str, str]], need: int, held: dict[tuple[str, str], int]
) -> None:
    ranked = planner.spot_pools(offers, GPUS, need, held, fill_zones=True)
    fitting = [p for p in offers if GPUS[p[0]] >= need]
    assert sorted(ranked) == sorted(fitting)
    if ranked:
        in_zone = {z: sum(n for (_, zone), n in held.items() if zone == z) for _, z in offers}
        snug = min(GPUS[p[0]] for p in fitting)
        first = ranked[0]
        assert GPUS[first[0]] == snug
        same_shape = [p for p in fitting if GPUS[p[0]] == snug]
        assert in_zone[first[1]] == max(in_zone[p[1]] for p in same_shape)  # the fullest zone
        there = [p for p in same_shape if p[1] == first[1]]
        assert held.get(first, 0) == min(held.get(p, 0) for p in there)  # spread inside it
        rest = [(GPUS[p[0]], -in_zone[p[1]]) for p in ranked[1:]]
        assert rest == sorted(rest)  # falls over to the next fullest zones


def test_spot_pools_example() -> None:
    offers = [("g8", "za"), ("g4", "za"), ("g4", "zb"), ("g1", "zc")]
    held = {("g4", "za"): 2}
    assert planner.spot_pools(offers, GPUS, 3, held) == [("g4", "zb"), ("g4", "za"), ("g8", "za")]
    assert planner.spot_pools(offers, GPUS, 9, held) == []
    # A job that may span zones fills the zone it holds most in: za, where g4 holds 2.
    assert planner.spot_pools(offers, GPUS, 3, held, fill_zones=True) == [
        ("g4", "za"),
        ("g4", "zb"),
        ("g8", "za"),
    ]
    assert planner.spot_pools(offers, GPUS, 1, {("g1", "zc"): 1}, fill_zones=True)[0] == (
        "g1",
        "zc",
    )
