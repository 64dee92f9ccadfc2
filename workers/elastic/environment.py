"""The rank contract's environment, identical for local processes and Kubernetes pods.

torchrun-compatible variables plus spotrain's own, so a training script (through
`spotrain.elastic`) knows its job, generation, checkpoint store, control file,
scale_config and its share of an uneven global batch.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from spotrain.workflows.job.planner import local_batch_size

if TYPE_CHECKING:  # keeps pydantic out of every training process's start-up
    from spotrain.workflows.contract import GenerationPlan

JOB = "SPOTRAIN_JOB"
GENERATION = "SPOTRAIN_GENERATION"
NODE_ID = "SPOTRAIN_NODE_ID"
CHECKPOINT = "SPOTRAIN_CHECKPOINT"
CONTROL_FILE = "SPOTRAIN_CONTROL_FILE"
SCALE_CONFIG = "SPOTRAIN_SCALE_CONFIG"
TOTAL_STEPS = "SPOTRAIN_TOTAL_STEPS"
CHECKPOINT_KEEP = "SPOTRAIN_CHECKPOINT_KEEP"
GLOBAL_BATCH_SIZE = "SPOTRAIN_GLOBAL_BATCH_SIZE"
LOCAL_BATCH_SIZE = "SPOTRAIN_LOCAL_BATCH_SIZE"
COLLECTIVE_TIMEOUT = "SPOTRAIN_COLLECTIVE_TIMEOUT_S"
# Live resize (live.py), set by a runtime that supports it:
RESIZE = "SPOTRAIN_RESIZE"  # "live"
STATE_FROM = "SPOTRAIN_STATE_FROM"  # "peers": a joiner takes the survivors' state
PARK_TIMEOUT = "SPOTRAIN_PARK_TIMEOUT_S"
PEER_COPY = "SPOTRAIN_PEER_COPY"  # "1": keep a ring neighbour's shards in memory (sharded.py)


def rank_env(
    plan: GenerationPlan,
    node_index: int,
    local_rank: int,
    *,
    master_port: int,
    control_file: str,
) -> dict[str, str]:
    """Environment of one process: `local_rank` of the node at `node_index` in rank order."""
    member = plan.members[node_index]
    rank = sum(m.procs for m in plan.members[:node_index]) + local_rank
    env = dict(plan.env)
    env.update(
        {
            "WORLD_SIZE": str(plan.world_size),
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(member.procs),
            "NODE_RANK": str(node_index),
            "GROUP_RANK": str(node_index),
            "MASTER_ADDR": plan.members[0].address,
            "MASTER_PORT": str(master_port),
            JOB: plan.job,
            GENERATION: str(plan.generation),
            NODE_ID: member.node_id,
            CHECKPOINT: plan.checkpoint,
            CONTROL_FILE: control_file,
            SCALE_CONFIG: json.dumps(plan.scale_config, sort_keys=True),
            TOTAL_STEPS: str(plan.total_steps),
            CHECKPOINT_KEEP: str(plan.checkpoint_keep),
            COLLECTIVE_TIMEOUT: str(plan.collective_timeout_s),
        }
    )
    if plan.peer_copy:
        env[PEER_COPY] = "1"
    if plan.global_batch_size is not None:
        env[GLOBAL_BATCH_SIZE] = str(plan.global_batch_size)
        env[LOCAL_BATCH_SIZE] = str(local_batch_size(plan.global_batch_size, plan.world_size, rank))
    return env
