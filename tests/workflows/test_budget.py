"""A job's total-spend cap: the pure decisions (property-tested), the spec's and the CLI's
refusals, and the real workflow on the time-skipping server pausing at its cap (checkpoint,
every node released, the reason in `status`), refusing to resume until the cap is raised, and
finishing once it is."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from temporalio.client import WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment

from spotrain.workers.cli.main import parser
from spotrain.workers.cli.report import Report, tables
from spotrain.workflows.job.state import JobState
from spotrain.workflows.policies import budget
from spotrain.workflows.policies.budget import BudgetState
from spotrain.workflows.spec import SpecError, parse_spec
from tests.jobs import fast_runtime, fast_spec, job_spec, record_history, simulated, skip, until

T0 = datetime(2026, 1, 1, tzinfo=UTC)
caps = st.floats(0.01, 1e6)
spends = st.floats(0, 2e6)


@given(caps, spends, st.booleans())
def test_verdict_pauses_at_the_cap_and_warns_once_past_80_percent(
    cap: float, spent: float, warned: bool
) -> None:
    v = budget.verdict(BudgetState(cap_usd=cap, warned=warned), spent)
    if spent >= cap:
        assert v == "reached"
    elif spent >= 0.8 * cap and not warned:
        assert v == "warn"
    else:
        assert v == "under"


def test_verdict_edges() -> None:
    b = BudgetState(cap_usd=10.0)
    assert [budget.verdict(b, x) for x in (0, 7.99, 8.0, 9.99, 10.0, 11)] == [
        "under",
        "under",
        "warn",
        "warn",
        "reached",
        "reached",
    ]
    assert budget.verdict(b.model_copy(update={"warned": True}), 9.0) == "under"


@given(caps, spends, st.floats(0.01, 1000))
def test_reached_at_is_when_the_rate_spends_what_is_left(
    cap: float, spent: float, rate: float
) -> None:
    at = budget.reached_at(BudgetState(cap_usd=cap), spent, rate, T0)
    assert at is not None and at > T0  # never now: the main loop would spin
    paid = spent + rate * (at - T0).total_seconds() / 3600
    if at - T0 == budget.SOONEST:
        assert spent + rate * 0.001 / 3600 >= cap  # (reached, or within a millisecond)
    elif at - T0 < timedelta(hours=budget.LONGEST_WAIT_H):
        assert paid == pytest.approx(cap, rel=1e-6, abs=1e-6)
    else:  # far off: looked at again in a day
        assert at - T0 == timedelta(hours=budget.LONGEST_WAIT_H) and paid <= cap * (1 + 1e-9)


def test_nothing_billed_never_reaches_the_cap() -> None:
    assert budget.reached_at(BudgetState(cap_usd=5), 1.0, 0.0, T0) is None
    assert budget.reached_at(BudgetState(cap_usd=5), 1.0, 2.0, T0) == T0 + timedelta(hours=2)
    assert budget.reached_at(BudgetState(cap_usd=5), 5 - 1e-12, 2.0, T0) == T0 + budget.SOONEST


def test_resume_is_refused_only_while_the_budget_is_spent() -> None:
    b = BudgetState(cap_usd=4.0)
    assert budget.resume_error(None, 100.0, "j") is None
    assert budget.resume_error(b, 3.99, "j") is None
    error = budget.resume_error(b, 4.02, "my-job")
    assert error is not None
    assert "budget spent: $4.02 of $4.00" in error and "spotrain budget my-job --usd" in error


@pytest.mark.parametrize("usd", [0.0, -1.0, float("nan"), float("inf")])
def test_a_new_cap_must_be_positive_and_finite(usd: float) -> None:
    assert "positive number of USD" in (budget.set_error(usd) or "")
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["budget", "my-job", "--usd", str(usd)])
    assert exit_.value.code == 2


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "budget_usd: Input should be greater than 0"),
        (-5, "budget_usd: Input should be greater than 0"),
        ("ten", "budget_usd: Input should be a valid number"),
        (float("inf"), "budget_usd: must be a finite number > 0 and <= 1,000,000,000, got inf"),
    ],
)
def test_spec_refuses_bad_budgets(value: Any, message: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(job_spec(budget_usd=value))
    assert message in str(err.value)


def test_spec_budget_becomes_the_jobs_cap() -> None:
    assert JobState.new(parse_spec(job_spec())).budget is None
    s = JobState.new(parse_spec(job_spec(budget_usd=12.5)))
    assert s.budget == BudgetState(cap_usd=12.5)
    assert s.status(T0).budget_usd == 12.5


async def test_job_pauses_at_its_budget_and_resumes_once_it_is_raised(
    ts_env: WorkflowEnvironment,
) -> None:
    """4 spot nodes at $0.97/h spend $4 in about an hour (the job needs 2.5 h): the job
    pauses then, within a cent of the cap, holding no node; resume is refused until
    `set_budget` raises the cap; then it finishes."""
    async with simulated(ts_env.client) as sim:
        spec = job_spec(budget_usd=4.0)
        name = spec["name"]
        handle = await sim.start(spec)
        await skip(ts_env, timedelta(hours=2))
        paused = await sim.status(handle)
        held = sim.cloud.running(name)
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("resume", {})
        with pytest.raises(WorkflowUpdateFailedError) as negative:
            await handle.execute_update("set_budget", {"usd": -3})
        raised = await handle.execute_update("set_budget", {"usd": 20}, result_type=str)
        resumed = await handle.execute_update("resume", {}, result_type=str)
        result = await handle.result()
    assert paused.phase == "Paused" and paused.world_size == 0 and held == []
    assert paused.paused_reason == "budget reached: $4.00 of $4.00"  # at the cap, not later
    assert paused.budget_usd == 4.0
    assert 4.0 <= paused.cost_so_far < 4.01  # the checkpoint and release cost a little more
    assert 0 < paused.checkpoint_step == paused.step < 36_000  # paused after a checkpoint
    events = [(e.event, e.detail) for e in paused.timeline]
    (warning,) = [detail for event, detail in events if event == "budget 80% spent"]
    assert warning.endswith(" of $4.00") and 3.2 <= float(warning.split()[0][1:]) < 3.25
    assert ("paused", paused.paused_reason) in events
    assert "budget spent: $4.00 of $4.00; raise it first" in str(refused.value.cause)
    assert "positive number of USD" in str(negative.value.cause)
    assert raised == "budget set: $4.00 of $20.00" and resumed == "resuming"
    assert result.phase == "Succeeded" and result.steps_done == 36_000
    assert result.steps_lost == 0 and 9.5 < result.total_cost < 20
    assert sim.cloud.running(name) == []
    shown = tables(Report.from_result(result))  # `spotrain report`
    assert ["budget", "", "$20.00"] in [list(row) for row in zip(*cells(shown), strict=True)]


def cells(shown: Any) -> list[list[str]]:
    """The cost table's columns, as the terminal would show them."""
    return [list(column.cells) for column in shown.renderables[-1].columns]


async def test_budget_pause_and_raise_on_the_dev_server(dev_env: WorkflowEnvironment) -> None:
    """The same story in real time on the dev server (which records the updates too, for the
    replay tests): 4 nodes at $9.70/h reach a $0.05 cap in about 5 s of a 15 s job."""
    pricey = {"name": "p3.2xlarge", "gpus": 1, "on_demand_price": 30.6, "spot_price": 9.7}
    spec = fast_spec(budget_usd=0.05, spot={"instance_types": [pricey]})
    async with simulated(dev_env.client, runtime=fast_runtime()) as sim:
        handle = await sim.start(spec)
        paused = await until(sim, handle, lambda s: s.phase == "Paused")
        held = sim.cloud.running(spec["name"])
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update("resume", {})
        await handle.execute_update("set_budget", {"usd": 1.0})
        await handle.execute_update("resume", {})
        result = await handle.result()
        await record_history(handle, "budget_pause")
    assert paused.paused_reason is not None
    # Spend is checked at each progress report (0.25 s here): on a loaded machine one comes
    # late and the cap is passed by that much (seen in CI: $0.06). Within 4.6 s of 4 nodes.
    spent = re.match(r"budget reached: \$(\d+\.\d\d) of \$0\.05", paused.paused_reason)
    assert spent and 0.05 <= float(spent[1]) < 0.10, paused.paused_reason
    assert held == [] and 0 < paused.step < 600
    assert "budget spent" in str(refused.value.cause)
    assert result.steps_done == 600 and result.total_cost < 1.0
