"""A scheduled change (AWS Health scheduledChange, an EC2 scheduled event: retirement, stop,
reboot, maintenance) is its own kind of early warning, `scheduled`: certain, and due at its
start time. make-before-break's rule weighs it with p = 1 (a rebalance recommendation, right
half the time, is declined by the same job), and its swap must beat that start as a notice's
must. The planner's decisions without a server, then the whole path: AWS's payloads
(tests/webhook/corpus, sources in its SOURCES.md) through the real webhook to a real
TrainingJob on the
Temporal dev server, with the simulated cloud naming its nodes as EC2 does."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment

from spotrain.activities.simulated import SimulatedCloud
from spotrain.workers.webhook.events import health_start, parse_aws, parse_kubernetes
from spotrain.workflows.job import events, job_planner
from spotrain.workflows.policies import make_before_break
from spotrain.workflows.policies.warning_rule import worth_acting
from tests.jobs import fast_runtime, fast_spec, record_history, running_at, simulated, until
from tests.webhook.webhook_support import running_webhook
from tests.workflows.test_make_before_break import MBB, SURGE, ranked
from tests.workflows.test_make_before_break import events as timeline
from tests.workflows.test_make_before_break_planner import state, warning
from tests.workflows.test_planner_job import T0

DATA = Path(__file__).parents[1] / "webhook" / "corpus"


def scheduled(node_id: str, start_s: float | None) -> events.Reclaim:
    deadline = None if start_s is None else T0 + timedelta(seconds=start_s)
    return events.Reclaim(kind="scheduled", node_id=node_id, deadline=deadline)


# --- parsing, the rule and the planner -----------------------------------------------------------


def test_aws_payloads_of_scheduled_changes_parse_to_their_own_kind_and_start() -> None:
    def one(parse: Any, name: str) -> tuple[str, str, datetime | None]:
        [notice] = parse(json.loads((DATA / name).read_text()))
        return notice.kind, notice.node_id, notice.deadline

    health = "eventbridge/nth-health-scheduled-change.json"  # startTime in RFC 1123
    assert one(parse_aws, health) == (
        "scheduled",
        "i-12345678",
        datetime(2016, 6, 5, 15, 10, 9, tzinfo=UTC),
    )
    undated = "eventbridge/karpenter-health-scheduled-change.json"  # no startTime
    assert one(parse_aws, undated) == ("scheduled", "i-0cafe0000000000b2", None)
    imds = "nth/imds-scheduled-event.json"  # NTH, IMDS mode: StartTime is the event's start
    assert one(parse_kubernetes, imds)[::2] == (
        "scheduled",
        datetime(2019, 10, 29, 20, 10, tzinfo=UTC),
    )
    queue = "nth/queue-health-scheduled-change.json"  # NTH, queue mode: StartTime is NTH's now
    assert one(parse_kubernetes, queue)[::2] == ("scheduled", None)
    rebalance = "eventbridge/nth-rebalance-recommendation.json"  # still a guess, undated
    assert one(parse_aws, rebalance)[::2] == ("rebalance", None)
    assert health_start("Sat, 05 Jun 2016 15:10:09 +0200") == datetime(
        2016, 6, 5, 13, 10, 9, tzinfo=UTC
    )
    for unreadable in ("soon", "Sat, 05 Jun 2016 15:10:09", "Sat, 05 Jun 9999 15:10:09 GMT", 7):
        assert health_start(unreadable) is None  # undated, never a refused event


@pytest.mark.parametrize("resize", ["live", "restart"])
def test_the_rule_takes_a_scheduled_change_as_certain(resize: str) -> None:
    """The same node, the same prices: the published prior (p = 0.5) declines a rebalance
    recommendation; a scheduled change is acted on, whatever the prior says."""
    for p in (0.0, 0.5):
        s = state(max_surge_nodes=1, resize=resize, warning_reclaim_probability=p)
        assert not worth_acting(s, s.nodes[1]).act
        sure = worth_acting(s, s.nodes[1], certain=True)
        assert sure.act and sure.cost_usd == 0 and sure.gain_usd > 0


def test_a_scheduled_change_swaps_by_its_own_start_and_shrinks_if_the_replacement_is_late() -> None:
    s = state(max_surge_nodes=1, graceful_shutdown_timeout_s=60)
    plan = make_before_break.on_notice(s, scheduled("i-1", 3600), T0)
    assert plan.action == "order" and plan.swaps[0].deadline == T0 + timedelta(seconds=3600)
    s.swaps = plan.swaps
    # no replacement ready: it waits until the start less the checkpoint time and the margin
    step = make_before_break.next_step(s, T0)
    assert (step.pairs, step.late, step.wake) == ([], [], T0 + timedelta(seconds=3535))
    late = make_before_break.next_step(s, T0 + timedelta(seconds=3535))
    assert [w.node_id for w in late.late] == ["i-1"]
    # undated (Karpenter's tests, NTH in queue mode): an open swap like a rebalance's
    assert (
        make_before_break.on_notice(state(max_surge_nodes=1), scheduled("i-1", None), T0)
        .swaps[0]
        .deadline
        is None
    )
    # no room at max_nodes: it waits for room (a notice would shrink), its start still bounds it
    full = make_before_break.on_notice(state(), scheduled("i-1", 3600), T0)
    assert full.action == "no room" and full.swaps[0].deadline == T0 + timedelta(seconds=3600)


def test_a_scheduled_change_too_close_to_swap_shrinks_and_ignore_ignores_it() -> None:
    s = state(max_surge_nodes=1)
    assert make_before_break.on_notice(s, scheduled("i-1", 30), T0).action == "pass"
    plan = job_planner.reclaim_plan(s, scheduled("i-1", 30), T0)
    assert plan.action == "resize" and plan.grace == 25  # not ignored as a rebalance would be
    assert job_planner.reclaim_plan(s, warning("i-1"), T0).action == "ignore rebalance"
    off = state(early_warning="ignore", reclaim_notice="shrink")
    assert make_before_break.on_notice(off, scheduled("i-1", 3600), T0).action == "pass"
    assert job_planner.reclaim_plan(off, scheduled("i-1", 3600), T0).action == "ignore scheduled"
    shrink = state(early_warning="shrink")
    assert job_planner.reclaim_plan(shrink, scheduled("i-1", 3600), T0).action == "resize"


# --- the whole path ----------------------------------------------------------------------------


class Ec2Cloud(SimulatedCloud):
    """Nodes named as EC2 names instances: an AWS Health event names its instances so, and the
    webhook takes no other name from it."""

    ID_FORMAT = "i-{:017x}"


def health_event(node_id: str, start: datetime) -> dict[str, Any]:
    """aws-node-termination-handler's published AWS Health scheduled change, for `node_id`,
    starting at `start` (RFC 1123, as EventBridge writes it)."""
    event = json.loads((DATA / "eventbridge" / "nth-health-scheduled-change.json").read_text())
    event["id"] = f"health-{node_id}"
    event["resources"] = [node_id]
    event["detail"]["affectedEntities"][0]["entityValue"] = node_id
    event["detail"]["startTime"] = format_datetime(start.astimezone(UTC), usegmt=True)
    return event


def rebalance_event(node_id: str) -> dict[str, Any]:
    """aws-node-termination-handler's published rebalance recommendation, for `node_id`."""
    event = json.loads((DATA / "eventbridge" / "nth-rebalance-recommendation.json").read_text())
    event["id"] = f"rebalance-{node_id}"
    event["detail"]["instance-id"] = node_id
    return event


@pytest.mark.slow
async def test_a_retirement_through_the_webhook_is_swapped_where_a_rebalance_is_declined(
    dev_env: WorkflowEnvironment,
) -> None:
    """One job with make-before-break and the rule's defaults (p = 0.5): a rebalance
    recommendation for one node is declined; an AWS Health scheduled change for another, ten
    minutes ahead, gets a replacement and one swap (4 -> 4), before its start."""
    spec = fast_spec(total_steps=1200, elastic=MBB | SURGE)  # about 30 s at 4 nodes
    async with (
        simulated(dev_env.client, cloud=Ec2Cloud(), runtime=fast_runtime()) as sim,
        running_webhook(dev_env.client) as hook,
    ):
        handle = await sim.start(spec)
        try:  # (a failure ends the job too: nothing left running on the session's server)
            before = await until(sim, handle, lambda s: running_at(4)(s) and s.step > 50)
            rebalanced, retired = ranked(before)[1], ranked(before)[2]
            assert (await hook.post("/v1/events/aws", rebalance_event(rebalanced)))[0] == 200
            await until(
                sim,
                handle,
                lambda s: bool(timeline(s, "rebalance recommendation not worth a replacement")),
            )
            start = datetime.now(UTC) + timedelta(minutes=10)
            status, body = await hook.post("/v1/events/aws", health_event(retired, start))
            assert status == 200, body
            swapped = await until(sim, handle, lambda s: s.swapped == 1 and running_at(4)(s))
            result = await handle.result()
            await record_history(handle, "scheduled_change_swap")
        except BaseException:
            await handle.terminate()
            raise
    assert datetime.now(UTC) < start
    assert timeline(result, "rebalance recommendation not worth a replacement")[0].startswith(
        f"{rebalanced}: expected gain"
    )
    assert timeline(result, "replacement ordered ahead") == [
        f"replacement ordered ahead of {retired}"
    ]
    assert timeline(result, "scheduled change not worth a replacement") == []
    assert retired not in ranked(swapped) and rebalanced in ranked(swapped)
    assert result.resizes == 1 and result.swapped == 1 and result.steps_lost == 0
    assert sim.cloud.nodes[retired].info.reason == "terminated"  # released by the job
