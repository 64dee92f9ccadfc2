"""The pure decisions of a timed scale-out (workflows/policies/timed_scale_out.py), no server."""

from __future__ import annotations

from spotrain.workflows.job.state import NodeState
from spotrain.workflows.policies import timed_scale_out
from tests.workflows.test_planner_job import T0, node, running, state


def test_undo_restores_the_target_and_releases_idle_extras_launching_first() -> None:
    s = running(state(elastic={"min_nodes": 1, "max_nodes": 6, "initial_nodes": 2}), [0, 1])
    s.owed = 2
    timed_scale_out.begin(s, seq=1, count=3, timeout_s=30, now=T0)
    s.target, s.ceiling = 5, 6
    s.nodes = [node(0), node(1), node(2), node(3, state=NodeState.REQUESTED), node(4)]
    undo = timed_scale_out.revert(s)
    assert (undo.target, undo.owed) == (2, 0)
    assert [n.slot for n in undo.surplus] == [3, 4, 2]  # launching first, then the newest
    assert not timed_scale_out.reached(s)
    s.nodes[3].state = NodeState.READY
    s.nodes.append(node(5))
    assert timed_scale_out.reached(s)  # 5 ready: what it asked for


def test_one_timed_scale_out_at_a_time_each_answered_by_number() -> None:
    s = state()
    assert timed_scale_out.busy(s) is None
    s.scale_outs = 1  # asked for, not begun yet
    assert timed_scale_out.busy(s)
    timed_scale_out.begin(s, seq=1, count=1, timeout_s=5, now=T0)
    timed_scale_out.answer(s, "scaled out: 5 nodes ready")
    assert s.scale_out_answer == (1, "scaled out: 5 nodes ready")
    assert s.pending_scale_out is None and timed_scale_out.busy(s) is None
