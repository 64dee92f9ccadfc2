"""bench/suite_times.py reads what `.ci/run` printed and the JUnit file it wrote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import suite_times

# The end of a `.ci/run` output (a red run), as it prints it.
LOG = """ci: tests ...
FAILED tests/cli/test_cli.py::test_steer_a_running_job - AssertionError
5 failed, 1026 passed, 2 skipped, 1 error in 2865.40s (0:47:45)
ci: tests took 2871 s (exit 1)
ci: phases
  pip (Python packages)          370 s
  Go builds (rest)               448 s
    Go builds in all             818 s
    Go: control plane            560 s
  ruff                             1 s
  tests                         2871 s
  all                           3690 s
"""
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.cli.test_demo" name="test_demo" time="104.8" />
<testcase classname="tests.aws.test_ec2" name="test_a" time="91.5" />
<testcase classname="tests.aws.test_ec2" name="test_b" time="1.2" />
</testsuite></testsuites>"""


def test_a_run_is_read_from_the_log_and_junit_and_kept_once_per_commit(tmp_path: Path) -> None:
    (tmp_path / "ci.log").write_text(LOG)
    (tmp_path / "junit.xml").write_text(JUNIT)
    out = tmp_path / "suite_times.json"
    command = [sys.executable, "-m", "bench.suite_times", "--log", str(tmp_path / "ci.log")]
    command += ["--junit", str(tmp_path / "junit.xml"), "--beside", "two busy loops"]
    command += ["--out", str(out), "--go-cold"]
    for commit in ("abc1234", "abc1234", "def5678"):
        subprocess.run([*command, "--commit", commit], check=True, capture_output=True)
    runs = json.loads(out.read_text())["runs"]
    assert [r["commit"] for r in runs] == ["abc1234", "def5678"]  # the same run replaced
    run = runs[0]
    assert (run["failed"], run["passed"], run["skipped"], run["error"], run["exit"]) == (
        5,
        1026,
        2,
        1,
        1,
    )
    assert run["phases_s"] == {
        "pip (Python packages)": 370,
        "Go builds (rest)": 448,
        "Go builds in all": 818,
        "Go: control plane": 560,
        "ruff": 1,
        "tests": 2871,
        "all": 3690,
    }
    assert (run["worker_s"], run["over_90_s"], run["slowest_s"]) == (197.5, 2, 104.8)
    assert run["slowest"] == "tests.cli.test_demo::test_demo"
    assert run["beside"] == "two busy loops" and run["go_cold"] is True


def test_a_green_run_has_no_failed_count() -> None:
    green = "1030 passed, 2 skipped, 17 warnings in 1225.32s (0:20:25)\n"
    green += "ci: tests took 1231 s (exit 0)\n"
    assert suite_times.outcome(green) == {"passed": 1030, "skipped": 2, "exit": 0}
