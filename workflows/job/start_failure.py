"""Whether a failed generation means the job's command cannot start at all, so that the job
fails at once with the real reason instead of restarting it `max_restarts` times.

Pure: the job's state and the runtime's account of the failure in, a reason or None out.
"""

from __future__ import annotations

from spotrain.workflows.contract import WatchResult
from spotrain.workflows.job.state import JobState


def cannot_start(state: JobState, w: WatchResult) -> str | None:
    """Why the command cannot start, when the job has not trained a step yet, the generation
    failed before its first step, and every rank exited with the same code and the same last
    line of output (a missing executable, an import error, a bad argument). None otherwise:
    one rank's crash, a rank killed with its node, or a job that trained before (a failure
    then may be transient) is a fault like any other."""
    if w.outcome != "failed" or w.stepped is not False or state.step or state.checkpoint_step:
        return None
    ranks = range(state.world_size)
    codes = {w.exit_codes.get(r) for r in ranks}
    lasts = {w.output.get(r, "").rsplit("\n", 1)[-1] for r in ranks}
    if len(codes) != 1 or len(lasts) != 1:
        return None
    code = codes.pop()
    if code is None or code <= 0:  # still running, exited 0, or killed by a signal
        return None
    why = w.output.get(0) or "(no output)"
    return (
        f"the job's command cannot start: all {state.world_size} rank(s) exited with code "
        f"{code} before their first step; rank 0's output ends:\n{why}"
    )
