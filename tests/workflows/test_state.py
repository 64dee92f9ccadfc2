"""Cost accounting survives pruning: totals are the same before and after, however often."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from spotrain.workflows.contract import Lifecycle
from spotrain.workflows.job.state import JobState, NodeRecord, NodeState
from spotrain.workflows.spec import parse_spec
from tests.jobs import job_spec

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def node(slot: int, lifecycle: Lifecycle, hours: float, ended: bool) -> NodeRecord:
    price = 0.97 if lifecycle == "spot" else 3.06
    return NodeRecord(
        slot=slot,
        lifecycle=lifecycle,
        instance_type="p3.2xlarge",
        state=NodeState.GONE if ended else NodeState.READY,
        price=price,
        on_demand_price=3.06,
        ready_at=T0,
        ended_at=T0 + timedelta(hours=hours) if ended else None,
    )


def flat(costs: tuple[dict[str, float], dict[str, float], float]) -> list[float]:
    hours, cost, all_on_demand = costs
    return [*hours.values(), *cost.values(), all_on_demand]


def test_pruning_keeps_every_total() -> None:
    state = JobState.new(parse_spec(job_spec()))
    now = T0 + timedelta(hours=10)
    state.nodes = [
        node(0, "spot", 2, True),
        node(1, "on-demand", 3, True),
        node(2, "spot", 0, False),
    ]
    before = state.costs(now)
    state.prune(now)
    assert [n.slot for n in state.nodes] == [2]
    assert flat(state.costs(now)) == pytest.approx(flat(before))
    state.nodes.append(node(3, "on-demand", 1, True))
    expected = state.costs(now)
    state.prune(now)  # a second prune adds to the first
    assert flat(state.costs(now)) == pytest.approx(flat(expected))
    hours, cost, all_on_demand = expected
    assert hours == {"spot": 2 + 10, "on-demand": 3 + 1}
    assert abs(cost["on-demand"] - 4 * 3.06) < 1e-9 and abs(all_on_demand - 16 * 3.06) < 1e-9


def test_pruning_keeps_the_last_generations_members() -> None:
    """A job that continues as new between generations plans the next one from the last
    one's members, gone ones included: they stay on record, and are counted once."""
    state = JobState.new(parse_spec(job_spec()))
    now = T0 + timedelta(hours=10)
    state.nodes = [node(0, "spot", 2, True), node(1, "spot", 3, True), node(2, "spot", 0, False)]
    state.members = [1, 2]  # slot 1 was lost; the generation stopped
    before = state.costs(now)
    state.prune(now)
    assert [n.slot for n in state.nodes] == [1, 2]
    assert [n.slot for n in state.member_nodes] == [1, 2]
    assert flat(state.costs(now)) == pytest.approx(flat(before))
