"""When a long-lived workflow (a job, a capacity pool) should continue as new."""

from temporalio import workflow

# Continue-as-new well before Temporal's limits even where the server does not suggest it, and
# short enough that a worker replaying a whole run (after a restart or a cache eviction) does
# so well inside the 10 s workflow task timeout on a loaded machine. At 8,000: beside two busy
# loops (load 4-11, 2 cores) a 4,100-event replay took 8.5-21.7 s, so each attempt expired and
# the next replayed again (18 attempts in the CI of c9369fb). Replay cost is linear in events.
HISTORY_EVENTS_BEFORE_CONTINUE = 2000


def history_is_long() -> bool:
    """Call from workflow code: the server suggests continuing as new, or the history is past
    our own bound."""
    info = workflow.info()
    return info.is_continue_as_new_suggested() or (
        info.get_current_history_length() > HISTORY_EVENTS_BEFORE_CONTINUE
    )
