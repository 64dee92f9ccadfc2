"""The check a job's checkpoint location passes before the job buys its first node: one
every rank runtime registers, since each trains from that location.

A location that refuses spotrain, or that holds a finished job's completion marker (a spec
renamed but pointing at an old job's `checkpoint:`), fails the job with a ConfigError while
nothing is billed yet. `start_generation` checks again (a workflow from before the check).
"""

from __future__ import annotations

import time

from temporalio import activity

from spotrain.elastic.job_store import checked_store
from spotrain.workflows import contract


@activity.defn(name=contract.CHECK_CHECKPOINT)
def check_checkpoint(uri: str) -> None:
    """Idempotent: a probe written and read back, and the completion marker looked for."""
    checked_store(uri, time.time(), generation=1)
