"""Where the suite's time went: `python -m tests.durations .ci/junit.xml [--top N]` reads the
JUnit report `.ci/run` writes and prints the worker-seconds and CPU-seconds by folder and by
file, and the slowest and costliest tests (call, setup and teardown together, as
pytest-xdist's workers spent them; CPU: the test process's and its reaped children's, the
`cpu_s` property tests/conftest.py records, and apart what each test process reaped at its
end), and each test process's timeline: when it finished, how busy it was, and the tail, in
which some processes sat idle while the last ones ran."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def durations(report: Path, what: str = "time") -> dict[str, float]:
    """Seconds per test id (`tests/x/test_y.py::test_z[...]`): wall (`time`) or `cpu_s`."""
    found: dict[str, float] = {}
    for case in ET.parse(report).iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is the dotted module (and class); the file is its first parts that exist
        path = "/".join(module)
        while module and not Path(f"{path}.py").exists():
            module.pop()
            path = "/".join(module)
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        value = case.get("time") if what == "time" else props.get(what)
        found[f"{path}.py::{case.get('name')}"] = float(value or 0)
    return found


def timeline(report: Path) -> dict[str, tuple[float, float, float]]:
    """Per test process (xdist worker): its first test's start and its last test's end, in
    seconds from the run's first start, and the seconds its tests took."""
    spans: dict[str, list[tuple[float, float]]] = {}
    for case in ET.parse(report).iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "ended_at" not in props:
            continue  # (a report from before the timeline was recorded)
        end = float(props["ended_at"] or 0)
        spans.setdefault(props.get("worker") or "main", []).append(
            (end - float(case.get("time") or 0), end)
        )
    if not spans:
        return {}
    zero = min(start for runs in spans.values() for start, _ in runs)
    return {
        worker: (
            min(s for s, _ in runs) - zero,
            max(e for _, e in runs) - zero,
            sum(e - s for s, e in runs),
        )
        for worker, runs in sorted(spans.items())
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    for what, unit in (("time", "worker-seconds"), ("cpu_s", "CPU-seconds")):
        seconds = durations(args.report, what)
        by_file: Counter[str] = Counter()
        by_folder: Counter[str] = Counter()
        for test, s in seconds.items():
            file = test.split("::")[0]
            by_file[file] += s
            by_folder["/".join(file.split("/")[:2])] += s
        print(f"\n== {len(seconds)} tests, {sum(seconds.values()):.0f} {unit}")
        for title, counts in (("by folder", by_folder), ("by file", by_file)):
            print(f"\n{title}")
            for name, s in counts.most_common(args.top):
                print(f"{s:8.0f} s  {name}")
        print(f"\ntests, most {unit} first")
        for test, s in sorted(seconds.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"{s:8.1f} s  {test}")
    if lines := timeline(args.report):
        print("\ntimeline: test process, first start .. last end (s from the run's start), busy")
        for worker, (first, last, busy) in lines.items():
            print(f"{worker:>8}  {first:6.0f} .. {last:6.0f}  {busy:6.0f} s busy")
        ends = sorted(last for _, last, _ in lines.values())
        print(f"    tail  {ends[-1] - ends[0]:6.0f} s from the first process done to the last")
    ends = sum(durations(args.report, "session_end_cpu_s").values())
    print(f"\n{ends:8.0f} CPU-seconds at the test processes' ends: the shared servers and")
    print("         the warm forks they reaped, for the whole run (in no test above)")


if __name__ == "__main__":
    main()
