"""Determinism guard: every recorded history under tests/replay/histories replays against the
current TrainingJob, CapacityPool and ReleaseJob code. A change that breaks replay must be
versioned with `workflow.patched` or the histories re-recorded on purpose
(tests/replay/record_histories.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from spotrain.workers.worker import WORKFLOW_RUNNER, WORKFLOWS

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def test_histories_were_recorded() -> None:
    """The scenarios whose histories guard determinism: each was recorded, and some crossed
    continue-as-new (run2 and later)."""
    scenarios = {p.stem.rsplit("-run", 1)[0] for p in HISTORIES}
    required = {
        "reclaim_with_notice",
        "node_lost",
        "fault_recovers",
        "scale_in_out",
        "cancel",
        "pool_entity",
        "pool_shrunk_job",
        "pool_preempted_job",
        "make_before_break_swap",
        "live_resize",
        "live_resize_kubernetes",
        "deadline_switch",
        "budget_pause",
        "straggler_replace",
        "straggler_lockstep_hang",
        "scheduled_change_swap",
        "finished_in_stop",
        "release_job_0",
    }
    assert required <= scenarios, (
        f"missing {required - scenarios}: tests/replay/record_histories.py"
    )
    assert any(p.stem.endswith("-run2") for p in HISTORIES)  # continue-as-new was replayed


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(path.stem, path.read_text())
    replayer = Replayer(
        workflows=WORKFLOWS,
        workflow_runner=WORKFLOW_RUNNER,
        data_converter=pydantic_data_converter,
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=True)
    assert result.replay_failure is None
