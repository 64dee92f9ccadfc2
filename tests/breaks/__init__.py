"""The breaks tests/test_breaks.py applies, one at a time, to a copy of the repository: each a
behaviour that a unit test guards, the edit that breaks it (text that must occur exactly once
in its file), and the fast tests that must fail with it. Add one when a test guards a new
behaviour; a break that no longer matches the code fails test_every_break_matches_todays_code.
"""

from __future__ import annotations

from tests.breaks.edges import (
    AUTH_BREAKS,
    CLI_BREAKS,
    EC2_BREAKS,
    KUBE_BREAKS,
    NOTICE_BREAKS,
)
from tests.breaks.elastic import HANDOVER_BREAKS, PEER_COPY_BREAKS
from tests.breaks.model import Break
from tests.breaks.suite import SUITE_BREAKS
from tests.breaks.workflows import PLACEMENT_BREAKS, PLANNER_BREAKS, WARNING_RULE_BREAKS

__all__ = ["BREAKS", "Break"]

BREAKS = (
    WARNING_RULE_BREAKS
    + PLANNER_BREAKS
    + PLACEMENT_BREAKS
    + AUTH_BREAKS
    + NOTICE_BREAKS
    + EC2_BREAKS
    + HANDOVER_BREAKS
    + PEER_COPY_BREAKS
    + CLI_BREAKS
    + KUBE_BREAKS
    + SUITE_BREAKS
)
