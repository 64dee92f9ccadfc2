"""Run the chaos suite (tests/chaos) and print its figures: per scenario, crash points (or
runs) survived / tried, duplicate nodes, leaks (instances or rank processes left running) and
steps lost, as a table and as JSON.

    .venv/bin/python bench/chaos_report.py            # the CI size (~4 min on 2 cores)
    .venv/bin/python bench/chaos_report.py --full     # more crash points, runs and examples
    .venv/bin/python bench/chaos_report.py --json out.json

Exit status: pytest's (non-zero when any scenario failed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
GROUPS = {"crash at ": "worker SIGKILL at crash points", "cancel ": "cancel at random points"}
GROUPS["terminate "] = "terminate at random points (+ gc)"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per scenario; the crash sweep and the random stops folded into one each."""
    table: dict[str, dict[str, Any]] = {}
    for row in rows:
        name = next((g for p, g in GROUPS.items() if row["scenario"].startswith(p)), None)
        line = table.setdefault(
            name or row["scenario"],
            {"scenario": name or row["scenario"], "tried": 0, "survived": 0, "duplicates": 0}
            | {"leaks": 0, "lost_steps": 0, "failures": []},
        )
        for key in ("tried", "survived", "duplicates", "leaks", "lost_steps"):
            line[key] += row[key]
        line["failures"] += [f"{row['scenario']}: {p}" for p in row["problems"]]
    return list(table.values())


ROW = "{:<42} {:>14} {:>10} {:>6} {:>10}"


def render(lines: list[dict[str, Any]], seconds: float) -> str:
    head = ROW.format("scenario", "survived/tried", "duplicates", "leaks", "lost steps")
    out = [head, "-" * len(head)]
    for r in lines:
        ok = f"{r['survived']}/{r['tried']}"
        out.append(ROW.format(r["scenario"], ok, r["duplicates"], r["leaks"], r["lost_steps"]))
    out.append(f"({seconds:.0f} s)")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--full", action="store_true", help="the bigger sweep (CHAOS_FULL=1)")
    p.add_argument("--json", type=Path, help="also write the figures to this file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.jsonl"
        env = {**os.environ, "CHAOS_RESULTS": str(results), "CHAOS_FULL": str(int(args.full))}
        started = time.monotonic()
        code = subprocess.run(
            [sys.executable, "-m", "pytest", "tests/chaos", "-q", "-p", "no:logging"],
            cwd=REPO,
            env=env,
            check=False,
        ).returncode
        seconds = time.monotonic() - started
        rows = (
            [json.loads(line) for line in results.read_text().splitlines()]
            if results.exists()
            else []
        )
    lines = summarize(rows)
    report = {"seconds": round(seconds, 1), "full": args.full, "scenarios": lines, "runs": rows}
    print(json.dumps(report["scenarios"], indent=1))
    print(render(lines, seconds))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
