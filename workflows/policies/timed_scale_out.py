"""A scale-out with a timeout (`{"count", "timeout_s"}`): if the nodes do not come in time, the
target reverts and the update's answer says so, instead of waiting for capacity for ever.

Pure decisions over the job's state; the workflow applies them (training_job.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from spotrain.workflows.job.state import JobState, NodeRecord, NodeState, PendingScaleOut


def begin(state: JobState, seq: int, count: int, timeout_s: float, now: datetime) -> None:
    """Apply the scale-out and remember how to undo it (called before the target moves)."""
    state.pending_scale_out = PendingScaleOut(
        seq=seq,
        count=count,
        target=state.target + count,
        back_to=state.target,
        ceiling_before=state.ceiling,
        due=now + timedelta(seconds=timeout_s),
    )


def busy(state: JobState) -> str | None:
    """Why another timed scale-out must wait (one at a time, each answered on its own)."""
    if state.pending_scale_out is not None or state.scale_outs > _answered(state):
        return "a timed scale-out is already waiting for its nodes"
    return None


def _answered(state: JobState) -> int:
    return state.scale_out_answer[0] if state.scale_out_answer else 0


def reached(state: JobState) -> bool:
    """Whether the job holds the nodes the pending scale-out asked for (ready ones)."""
    p = state.pending_scale_out
    ready = sum(1 for n in state.nodes if n.state == NodeState.READY)
    return p is not None and ready >= p.target


@dataclass(frozen=True)
class Revert:
    target: int
    ceiling: int
    owed: int
    surplus: list[NodeRecord]  # nodes beyond the old target that do not train: released


def revert(state: JobState) -> Revert:
    """The timed-out scale-out undone: the old target and ceiling, the reclaim debt without
    the nodes asked for, and the nodes beyond the old target that train in no generation
    (ordered ones first, then the newest) to release."""
    p = state.pending_scale_out
    assert p is not None
    alive = [n for n in state.nodes if n.alive]
    idle = [n for n in alive if not (state.running and n.slot in state.members)]
    idle.sort(key=lambda n: (n.state == NodeState.READY, -n.slot))
    extra = max(0, len(alive) - p.back_to)
    return Revert(
        target=p.back_to,
        ceiling=p.ceiling_before,
        owed=max(0, state.owed - p.count),
        surplus=idle[:extra],
    )


def answer(state: JobState, text: str) -> None:
    """Settle the pending scale-out: the update waiting on it returns `text`."""
    p = state.pending_scale_out
    if p is not None:
        state.scale_out_answer = (p.seq, text)
        state.pending_scale_out = None
