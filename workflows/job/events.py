"""What the TrainingJob's main loop acts on: one type per kind of event, told apart by `kind`.

Signals, updates and the workflow's own checks only queue events (in `JobState.inbox`, which
continue-as-new carries); the main loop dispatches them with `match`. Every variant ignores
fields it does not know, so an inbox carried from before these types (one model with every
field optional, the unused ones null) still decodes into the right variant.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from spotrain.workflows.contract import PoolGrant


class Reclaim(BaseModel):
    """The cloud will take `node_id` at `deadline` (None: now or unknown). A rebalance is an
    early warning the job acts on only if its policy says so; a scheduled change (retirement,
    stop, reboot, maintenance) is an early warning that is certain, due at `deadline`."""

    kind: Literal["reclaim", "rebalance", "scheduled"] = "reclaim"
    node_id: str
    deadline: datetime | None = None
    shrink: bool = False  # its make-before-break replacement is late: shrink as usual


# The early warnings: a job acts on them per `elastic.early_warning`, not `reclaim_notice`.
WARNINGS = ("rebalance", "scheduled")


class Lost(BaseModel):
    """`node_id` is already gone (a webhook's notice or the capacity check's finding)."""

    kind: Literal["lost"] = "lost"
    node_id: str


class ScaleOut(BaseModel):
    """Add `count` nodes; `seq`: a timed scale-out's number (0: untimed)."""

    kind: Literal["scale_out"] = "scale_out"
    count: int
    timeout_s: float | None = None
    seq: int = 0


class ScaleOutDue(BaseModel):
    """Timed scale-out `seq`'s time is up."""

    kind: Literal["scale_out_due"] = "scale_out_due"
    seq: int


class ScaleIn(BaseModel):
    """Remove `count` nodes (highest rank first) or exactly the named ones."""

    kind: Literal["scale_in"] = "scale_in"
    count: int | None = None
    node_ids: list[str] | None = None


class Pause(BaseModel):
    kind: Literal["pause"] = "pause"


class Resume(BaseModel):
    kind: Literal["resume"] = "resume"


class Grant(BaseModel):
    """The job's pool says how many nodes (and of them on-demand) it may hold now."""

    kind: Literal["grant"] = "grant"
    grant: PoolGrant


Event = Annotated[
    Reclaim | Lost | ScaleOut | ScaleOutDue | ScaleIn | Pause | Resume | Grant,
    Field(discriminator="kind"),
]
