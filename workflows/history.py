"""When a long-lived workflow (a job, a capacity pool) should continue as new."""

from temporalio import workflow

# Continue-as-new well before Temporal's limits even where the server does not suggest it.
HISTORY_EVENTS_BEFORE_CONTINUE = 8000


def history_is_long() -> bool:
    """Call from workflow code: the server suggests continuing as new, or the history is past
    our own bound."""
    info = workflow.info()
    return info.is_continue_as_new_suggested() or (
        info.get_current_history_length() > HISTORY_EVENTS_BEFORE_CONTINUE
    )
