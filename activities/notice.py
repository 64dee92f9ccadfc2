"""How fast a reclaim notice reaches the workers, recorded by every runtime as it raises the
elastic event: from the workflow acting on the notice to the control file (or pod annotation)
being written. With the webhook's own request-to-signal histogram, that is the whole path from
the cloud's notice to the workers."""

from __future__ import annotations

from datetime import UTC, datetime

from temporalio import activity

from spotrain.workflows.contract import StopRequest

NOTICE_TO_WORKERS = "spotrain_notice_to_workers_seconds"


def elastic_event_raised(req: StopRequest) -> None:
    """Call right after the generation's workers were told to checkpoint and exit."""
    if req.notice_at is None:
        return
    seconds = max(0.0, (datetime.now(UTC) - req.notice_at).total_seconds())
    activity.metric_meter().create_histogram_float(
        NOTICE_TO_WORKERS, "reclaim notice acted on -> workers' elastic event raised", "s"
    ).record(seconds)
