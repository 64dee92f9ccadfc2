"""The test suite's own times as `.ci/run` measured them (issue 45): each run's phases, its
tests' wall time and worker-seconds, what ran beside it, and the tests that took over 90 s.

    .venv/bin/python -m bench.suite_times --log CI_LOG --junit JUNIT --commit REV \\
        --beside "two busy loops" [--go-cold] [--out bench/results/suite_times.json]

It reads the output `.ci/run` printed (its `ci: phases` summary, the test phase's exit and
pytest's last line) and the JUnit file it wrote (`.ci/junit.xml`), and adds the run to the
results file; a run of the same commit with the same `--beside` and `--go-cold` replaces the
one there. The README's and docs/development.md's suite times come from this file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "suite_times.json"
LONG_S = 90.0  # issue 45: no test over this on a quiet machine
# `.ci/run`'s summary line: "  pip (Python packages)          370 s"
PHASE = re.compile(r"^ {2,4}(\S.*?)\s+(\d+) s$")
FINAL = re.compile(r"\d+ (passed|failed).* in [\d.]+s")  # pytest's last line


def phases(log: str) -> dict[str, int]:
    """The `ci: phases` block's seconds by phase name (Go's, indented, included)."""
    lines = log.split("ci: phases\n", 1)[-1].splitlines()
    found = {}
    for line in lines:
        if not (m := PHASE.match(line)):
            break
        found[m.group(1).strip()] = int(m.group(2))
    return found


def outcome(log: str) -> dict[str, Any]:
    """Pytest's counts (passed, failed, skipped, error) from its last summary line, and the
    test phase's exit code."""
    last = next((line for line in reversed(log.splitlines()) if FINAL.search(line)), "")
    counts: dict[str, Any] = {}
    for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", last):
        counts["error" if what.startswith("error") else what] = int(n)
    exits = re.findall(r"ci: tests took \d+ s \(exit (\d+)\)", log)
    counts["exit"] = int(exits[-1]) if exits else None
    return counts


def test_times(junit: Path) -> dict[str, float]:
    """Seconds per test (its setup, call and teardown, as JUnit records them)."""
    return {
        f"{case.get('classname')}::{case.get('name')}": float(case.get("time") or 0)
        for case in ET.parse(junit).iter("testcase")
    }


def run_record(log: Path, junit: Path, commit: str, beside: str, go_cold: bool) -> dict[str, Any]:
    text = log.read_text()
    times = test_times(junit)
    slowest = max(times.items(), key=lambda kv: kv[1], default=("", 0.0))
    ended = datetime.fromtimestamp(log.stat().st_mtime, UTC)  # (its last line's time)
    return {
        "commit": commit,
        "ended": ended.strftime("%Y-%m-%d %H:%M UTC"),
        "beside": beside,
        "go_cold": go_cold,
        "cpus": os.cpu_count(),
        **outcome(text),
        "phases_s": phases(text),
        "worker_s": round(sum(times.values()), 1),
        "over_90_s": sum(t > LONG_S for t in times.values()),
        "slowest_s": round(slowest[1], 1),
        "slowest": slowest[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, required=True, help="what .ci/run printed")
    parser.add_argument("--junit", type=Path, required=True, help="the .ci/junit.xml it wrote")
    parser.add_argument("--commit", required=True, help="the commit the clean clone ran")
    parser.add_argument("--beside", required=True, help='what ran beside it: "nothing", ...')
    parser.add_argument("--go-cold", action="store_true", help="every Go build was cold")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    run = run_record(args.log, args.junit, args.commit, args.beside, args.go_cold)
    data = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    key = (run["commit"], run["beside"], run["go_cold"])
    kept = [r for r in data["runs"] if (r["commit"], r["beside"], r["go_cold"]) != key]
    data["runs"] = [*kept, run]
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
