"""The elastic event as every runtime raises it, and the notices ranks find for themselves.

`raise_elastic_event` writes the generation's control record to the checkpoint store, which
every rank's library polls (workers/elastic/control.py): the same sub-second path on every runtime,
before the runtime's own fallback (a local control file, a pod annotation). It also records how
fast a reclaim notice got there: from the workflow acting on the notice to the record written.
With the webhook's request-to-signal histogram, that is the whole path from the cloud's notice
to the ranks' channel.

`rank_notices` reads the reclaim notices ranks reported from EC2 instance metadata, for the
runtimes' watch to hand to the workflow (which dedupes them by event id).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from temporalio import activity

from spotrain.elastic.job_store import AFTER_RESIZE, JobStore
from spotrain.workflows.contract import ReclaimNotice, StopRequest

NOTICE_TO_RANKS = "spotrain_notice_to_ranks_seconds"


def reset_control(checkpoint: str, generation: int) -> None:
    """Before a generation's ranks start: a 'run' record over whatever an earlier job of the
    same name and checkpoint location left for this generation number, so no rank obeys a
    stale 'stop'."""
    store = JobStore(checkpoint)
    store.write_control(generation, {"kind": "run", "time": time.time()})
    store.write_next(generation, {"generation": None, "ranks": {}})  # no live placement yet


def raise_elastic_event(req: StopRequest, lost: list[str] | None = None) -> dict[str, Any]:
    """Write the control record 'checkpoint and stop' for the generation (idempotent: a retry
    rewrites the same event id); the record, for a runtime's fallback file. `lost` (default:
    the request's): nodes gone without notice, whose peers abort what they wait on at once
    (a frozen or cut-off node closes no connection: live.py)."""
    record = {
        "kind": "stop",
        "event_id": f"stop-{req.job}-{req.generation}",
        "time": time.time(),
        "notice_at": req.notice_at.isoformat() if req.notice_at else None,
        # live resize: the survivors' memory carries the state; a notice still gets a
        # checkpoint, which the survivors write beside training once resized (no pause)
        "checkpoint": True if not req.live else AFTER_RESIZE if req.notice_at else False,
        "lost": sorted(req.lost_node_ids if lost is None else lost),
    }
    JobStore(req.checkpoint).write_control(req.generation, record)
    if req.notice_at is not None and activity.in_activity():
        seconds = max(0.0, (datetime.now(UTC) - req.notice_at).total_seconds())
        activity.metric_meter().create_histogram_float(
            NOTICE_TO_RANKS, "reclaim notice acted on -> ranks' elastic event raised", "s"
        ).record(seconds)
    return record


def rank_notices(store: JobStore, generation: int) -> list[ReclaimNotice]:
    """Reclaim notices the generation's ranks found themselves (malformed ones skipped)."""
    notices = []
    for raw in store.notices(generation):
        try:
            notices.append(ReclaimNotice.model_validate(raw))
        except ValueError:
            continue
    return notices
