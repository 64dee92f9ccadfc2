"""Signal payloads, read by the workflow itself.

A signal has no answer. When the SDK cannot decode one (a typo'd or unknown field, sent
with the Temporal CLI), it drops it with a 30-line traceback in the worker's log, and the
sender saw "Signal workflow succeeded". Read here, a payload that does not parse is refused
with one line in the log and one entry in the job's timeline (`spotrain report` shows it),
naming the fields at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel, ValidationError
from temporalio import workflow
from temporalio.common import RawValue

with workflow.unsafe.imports_passed_through():
    from spotrain.workflows.contract import NodeLost, PoolGrant, ReclaimNotice
    from spotrain.workflows.job.state import JobState

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class SignalInput(Generic[M]):
    """A signal's name and the model its payload must parse as (the reference docs read the
    model here: the handler itself takes the raw payload)."""

    name: str
    model: type[M]

    def read(self, raw: RawValue, state: JobState | None) -> M | None:
        """The payload as the model, or None once its refusal is logged and recorded."""
        try:
            return workflow.payload_converter().from_payload(raw.payload, self.model)
        except Exception as err:  # (ValidationError, or bytes that are no JSON)
            why = refusal(err)
        workflow.logger.warning(f"signal {self.name} refused: {why}")
        if state is not None:
            state.record(workflow.now(), "signal refused", f"{self.name}: {why}")
        return None


RECLAIM = SignalInput("reclaim", ReclaimNotice)
NODE_LOST = SignalInput("node_lost", NodeLost)
GRANT = SignalInput("grant", PoolGrant)
INPUTS: dict[str, type[BaseModel]] = {s.name: s.model for s in (RECLAIM, NODE_LOST, GRANT)}


def refusal(err: Exception) -> str:
    """One line naming each field at fault and why (pydantic's own text is a block)."""
    cause = err if isinstance(err, ValidationError) else err.__cause__
    if not isinstance(cause, ValidationError):
        return str(err).splitlines()[0] if str(err) else type(err).__name__
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'payload'}: {e['msg']}" for e in cause.errors()
    )
