"""Search attributes the TrainingJob workflow keeps current, so the Temporal UI, `temporal
workflow list --query 'SpotrainPhase="Running"'`, `spotrain list` and the reclaim webhook
(instance id -> job) can find jobs without scanning them all."""

from temporalio.common import SearchAttributeKey

JOB = SearchAttributeKey.for_keyword("SpotrainJob")
PHASE = SearchAttributeKey.for_keyword("SpotrainPhase")
WORLD_SIZE = SearchAttributeKey.for_int("SpotrainWorldSize")
SPOT_NODES = SearchAttributeKey.for_int("SpotrainSpotNodes")
ON_DEMAND_NODES = SearchAttributeKey.for_int("SpotrainOnDemandNodes")
NODE_IDS = SearchAttributeKey.for_keyword_list("SpotrainNodeIds")
COST = SearchAttributeKey.for_float("SpotrainCost")

ALL = [JOB, PHASE, WORLD_SIZE, SPOT_NODES, ON_DEMAND_NODES, NODE_IDS, COST]
