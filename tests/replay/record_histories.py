"""Re-record the replay histories under tests/replay/histories, on purpose, then replay them.

    .venv/bin/python tests/replay/record_histories.py

Runs every test that records a history (workflow scenarios, capacity pools, the chaos suite)
with SPOTRAIN_RECORD=1, so each scenario's files are replaced by a fresh run of the current
code, then runs tests/replay/test_replay.py. Do this when a workflow change is meant to change what
the workflows do and no running workflow needs the old behaviour (otherwise guard the change
with `workflow.patched` and keep the old histories), and say so in the commit message.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORDING = [
    "tests/workflows/test_workflow_scenarios.py",
    "tests/workflows/test_workflow_basic.py",
    "tests/workflows/test_make_before_break.py",
    "tests/workflows/test_pools.py",
    "tests/chaos/test_crash_points.py",
    "tests/chaos/test_faults.py",
    "tests/workflows/test_cannot_start.py",
    "tests/workflows/test_deadline.py",
    "tests/elastic/test_live_resize.py",
    "tests/workflows/test_budget.py",
    "tests/workflows/test_stragglers.py",
    "tests/workflows/test_scheduled_change.py",
    "tests/kube/operator/test_k8s_operator_ended.py",
]


def main() -> int:
    env = os.environ | {"SPOTRAIN_RECORD": "1"}
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    recorded = subprocess.run([*pytest, *RECORDING], cwd=REPO, env=env, check=False)
    if recorded.returncode:
        return recorded.returncode
    return subprocess.run(
        [*pytest, "tests/replay/test_replay.py"], cwd=REPO, check=False
    ).returncode


if __name__ == "__main__":
    sys.exit(main())
