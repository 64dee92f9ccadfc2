"""Search attributes the TrainingJob workflow keeps current, so the Temporal UI, `temporal
workflow list --query 'SpotrainPhase="Running"'`, `spotrain list` and the reclaim webhook
(instance id -> job) can find jobs without scanning them all."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from temporalio.common import (
    SearchAttributeKey,
    SearchAttributePair,
    SearchAttributeUpdate,
    TypedSearchAttributes,
)

from spotrain.workflows.job.state import JobState, Phase

JOB = SearchAttributeKey.for_keyword("SpotrainJob")
PHASE = SearchAttributeKey.for_keyword("SpotrainPhase")
WORLD_SIZE = SearchAttributeKey.for_int("SpotrainWorldSize")
SPOT_NODES = SearchAttributeKey.for_int("SpotrainSpotNodes")
ON_DEMAND_NODES = SearchAttributeKey.for_int("SpotrainOnDemandNodes")
NODE_IDS = SearchAttributeKey.for_keyword_list("SpotrainNodeIds")
COST = SearchAttributeKey.for_float("SpotrainCost")

ALL = [JOB, PHASE, WORLD_SIZE, SPOT_NODES, ON_DEMAND_NODES, NODE_IDS, COST]


def at_start(name: str) -> TypedSearchAttributes:
    """What a job's workflow carries from its start, before any worker runs it: its name (so
    gc and release find a job whose workflow id is not its name, as the operator's) and
    Pending."""
    return TypedSearchAttributes(
        [SearchAttributePair(JOB, name), SearchAttributePair(PHASE, Phase.PENDING.value)]
    )


def shown(s: JobState) -> tuple[Any, ...]:
    """What the attributes show of a job, but its cost: when this changes, publish."""
    alive = [n for n in s.nodes if n.alive]
    return (
        str(s.phase),
        s.world_size,
        sum(n.lifecycle == "spot" for n in alive),
        sum(n.lifecycle == "on-demand" for n in alive),
        tuple(sorted(n.node_id for n in alive if n.node_id)),
    )


def updates(s: JobState, now: datetime) -> list[SearchAttributeUpdate[Any]]:
    phase, world_size, spot, on_demand, node_ids = shown(s)
    _, cost, _ = s.costs(now)
    return [
        JOB.value_set(s.spec.name),
        PHASE.value_set(phase),
        WORLD_SIZE.value_set(world_size),
        SPOT_NODES.value_set(spot),
        ON_DEMAND_NODES.value_set(on_demand),
        NODE_IDS.value_set(list(node_ids)),
        COST.value_set(round(sum(cost.values()), 4)),
    ]
