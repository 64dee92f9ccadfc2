"""The capacity pool's rules as pure functions, property-tested with hypothesis."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from spotrain.workflows.capacity.allocation import (
    NOTHING,
    Claim,
    Grant,
    Quota,
    allocate,
    floor,
    issue,
    never_fits,
    usage_total,
)


def claim(job: str, arrival: int, lo: int, hi: int, **kw: object) -> Claim:
    return Claim(job=job, priority=0, arrival=arrival, min_nodes=lo, max_nodes=hi, **kw)  # type: ignore[arg-type]


@st.composite
def claims(draw: st.DrawFn) -> list[Claim]:
    out = []
    for i in range(draw(st.integers(0, 6))):
        lo = draw(st.integers(1, 4))
        hi = lo + draw(st.integers(0, 4))
        all_od = draw(st.booleans())
        base = lo if all_od else draw(st.integers(0, lo))
        out.append(
            Claim(
                job=f"j{i}",
                priority=draw(st.integers(0, 2)),
                arrival=i,
                min_nodes=lo,
                max_nodes=hi,
                gpus_per_node=draw(st.sampled_from([0, 1, 4])),
                spot_price=1.0,
                on_demand_price=3.0,
                min_on_demand=base,
                max_on_demand=hi if all_od else base + draw(st.integers(0, 2)),
                all_on_demand=all_od,
                team=draw(st.sampled_from([None, "a", "b"])),
                progress=draw(st.floats(0, 1)),
                preemptible=draw(st.booleans()),
                running=draw(st.booleans()),
            )
        )
    return out


quotas = st.builds(
    Quota,
    nodes=st.none() | st.integers(0, 16),
    gpus=st.none() | st.integers(0, 32),
    on_demand=st.none() | st.integers(0, 8),
    cost_per_hour=st.none() | st.floats(0, 30),
    team_cost_per_hour=st.dictionaries(st.sampled_from(["a", "b"]), st.floats(0, 20)),
)


def within(total: dict[str, float], quota: Quota) -> bool:
    return (
        (quota.nodes is None or total["nodes"] <= quota.nodes)
        and (quota.gpus is None or total["gpus"] <= quota.gpus)
        and (quota.on_demand is None or total["on_demand"] <= quota.on_demand)
    )


def sane(cs: list[Claim], quota: Quota) -> list[Claim]:
    """What the pool passes in: no job that could never fit, and running jobs that fit
    together at their mins (they were admitted under this quota)."""
    kept: list[Claim] = []
    for c in (c for c in cs if never_fits(c, quota) is None):
        if c.running:
            trial = [*(k for k in kept if k.running), c]
            if not within(usage_total(trial, {k.job: floor(k) for k in trial}), quota):
                c = Claim(**{**c.__dict__, "running": False})
        kept.append(c)
    return kept


@settings(max_examples=400)
@given(claims(), quotas)
def test_grants_fit_the_quota_and_respect_each_jobs_range(cs: list[Claim], quota: Quota) -> None:
    cs = sane(cs, quota)
    grants = allocate(cs, quota)
    assert within(usage_total(cs, grants), quota)
    for c in cs:
        g = grants[c.job]
        assert g == NOTHING or c.min_nodes <= g.nodes <= c.max_nodes
        assert g.on_demand <= g.nodes
        if g != NOTHING:
            assert g.on_demand >= floor(c).on_demand
            assert g.on_demand <= max(c.max_on_demand, floor(c).on_demand) or c.all_on_demand
            if c.all_on_demand:
                assert g.on_demand == g.nodes
        if c.running and not c.preemptible:
            assert g != NOTHING  # never taken below its min


@settings(max_examples=400)
@given(claims(), quotas)
def test_nobody_jumps_the_queue_and_growth_waits_for_higher_priorities(
    cs: list[Claim], quota: Quota
) -> None:
    cs = sane(cs, quota)
    grants = allocate(cs, quota)
    waiting = [c for c in cs if grants[c.job] == NOTHING and not c.running]
    for w in waiting:
        for c in cs:
            newly_admitted = not c.running and grants[c.job] != NOTHING
            behind = (c.priority, -c.arrival) < (w.priority, -w.arrival)
            assert not (newly_admitted and behind), (w, c)
    top = max((c.priority for c in cs if grants[c.job] == NOTHING), default=None)
    for c in cs:
        if top is not None and c.priority < top:
            assert grants[c.job].nodes <= c.min_nodes  # no growth while a higher one waits


@settings(max_examples=400)
@given(claims(), quotas)
def test_preemption_only_for_a_higher_priority_and_only_what_it_needs(
    cs: list[Claim], quota: Quota
) -> None:
    cs = sane(cs, quota)
    grants = allocate(cs, quota)
    for victim in (c for c in cs if c.running and grants[c.job] == NOTHING):
        assert victim.preemptible
        beneficiaries = [c for c in cs if c.priority > victim.priority and grants[c.job] != NOTHING]
        assert beneficiaries, victim
        # Handing the victim its min back would break the quota: the preemption was needed.
        back = {**grants, victim.job: floor(victim)}
        assert not within(usage_total(cs, back), quota)


@settings(max_examples=400)
@given(claims(), quotas)
def test_budgets_cap_growth(cs: list[Claim], quota: Quota) -> None:
    cs = sane(cs, quota)
    grants = allocate(cs, quota)
    mins = usage_total(cs, {c.job: floor(c) if grants[c.job] != NOTHING else NOTHING for c in cs})
    total = usage_total(cs, grants)
    if quota.cost_per_hour is not None:
        assert total["cost_per_hour"] <= max(quota.cost_per_hour, mins["cost_per_hour"]) + 1e-6
    for team, cap in quota.team_cost_per_hour.items():
        team_claims = [c for c in cs if c.team == team]
        spent = usage_total(team_claims, grants)["cost_per_hour"]
        at_min = usage_total(team_claims, {c.job: floor(c) for c in team_claims if grants[c.job]})
        assert spent <= max(cap, at_min["cost_per_hour"]) + 1e-6


@settings(max_examples=400)
@given(claims(), quotas, st.data())
def test_issuing_never_overcommits(cs: list[Claim], quota: Quota, data: st.DataObject) -> None:
    """Whatever jobs hold or may still use (`committed`), what is issued now keeps the total
    of max(committed, issued) within the quota, if it was within before."""
    cs = sane(cs, quota)
    ideal = allocate(cs, quota)
    committed: dict[str, Grant] = {}
    for c in cs:
        nodes = data.draw(st.integers(0, c.max_nodes))
        committed[c.job] = Grant(nodes, data.draw(st.integers(0, nodes)))
    if not within(usage_total(cs, committed), quota):
        return
    issued = {c.job: committed[c.job] for c in cs}
    new = issue(cs, ideal, issued, committed, quota)
    after = {
        j: Grant(max(committed[j].nodes, g.nodes), max(committed[j].on_demand, g.on_demand))
        for j, g in new.items()
    }
    assert within(usage_total(cs, after), quota)
    for c in cs:
        g = new[c.job]
        assert g.nodes <= max(ideal[c.job].nodes, issued[c.job].nodes)
        assert g.nodes <= ideal[c.job].nodes or g.nodes <= issued[c.job].nodes
        if issued[c.job].nodes < c.min_nodes <= g.nodes:
            assert g.nodes >= c.min_nodes  # admitted only whole


def test_converges_to_the_ideal_once_jobs_release() -> None:
    """A high-priority arrival: the low job is lowered at once, the high one admitted only
    once the low one reports it released the nodes."""
    low = claim("low", 0, 2, 4, running=True)
    high = Claim("high", priority=5, arrival=1, min_nodes=3, max_nodes=3)
    quota = Quota(nodes=5)
    ideal = allocate([low, high], quota)
    assert ideal == {"low": Grant(2), "high": Grant(3)}
    holding = {"low": Grant(4), "high": NOTHING}
    first = issue([low, high], ideal, holding, holding, quota)
    assert first == {"low": Grant(2), "high": NOTHING}  # 4 still held: no room for 3
    released = {"low": Grant(2), "high": NOTHING}
    assert issue([low, high], ideal, first, released, quota) == ideal


def test_fifo_within_a_priority_and_progress_first_growth() -> None:
    quota = Quota(nodes=6)
    a = claim("a", 0, 2, 4, running=True, progress=0.1)
    b = claim("b", 1, 2, 4, running=True, progress=0.7)
    assert allocate([a, b], quota) == {"a": Grant(2), "b": Grant(4)}  # b is further along
    big = claim("big", 2, 4, 4)
    small = claim("small", 3, 1, 1)
    grants = allocate([a, b, big, small], quota)
    assert grants["big"] == NOTHING and grants["small"] == NOTHING  # small waits behind big


def test_preemption_needs_a_higher_priority_and_the_policy() -> None:
    quota = Quota(nodes=2)
    high = Claim("high", priority=1, arrival=1, min_nodes=2, max_nodes=2)
    same = Claim("same", priority=0, arrival=1, min_nodes=2, max_nodes=2)
    victim = claim("low", 0, 2, 2, running=True, preemptible=True)
    stubborn = claim("low", 0, 2, 2, running=True)
    assert allocate([victim, high], quota) == {"low": NOTHING, "high": Grant(2)}
    assert allocate([stubborn, high], quota) == {"low": Grant(2), "high": NOTHING}
    assert allocate([victim, same], quota) == {"low": Grant(2), "same": NOTHING}


def test_budget_caps_growth_but_not_the_min() -> None:
    job = claim("j", 0, 2, 6, spot_price=1.0, on_demand_price=3.0, team="t")
    assert allocate([job], Quota(cost_per_hour=3.5)) == {"j": Grant(3)}
    assert allocate([job], Quota(cost_per_hour=1.0)) == {"j": Grant(2)}  # min regardless
    assert allocate([job], Quota(team_cost_per_hour={"t": 4.0})) == {"j": Grant(4)}


def test_never_fits_names_the_limit() -> None:
    assert "quota is 3" in str(never_fits(claim("j", 0, 4, 4), Quota(nodes=3)))
    gpus = never_fits(claim("j", 0, 2, 2, gpus_per_node=4), Quota(gpus=6))
    assert "8 GPU(s)" in str(gpus)
    assert never_fits(claim("j", 0, 2, 2), Quota(nodes=2)) is None
