"""The goodput harness's wedge check: N consecutive full three-zone runs of `bench.goodput`,
one after another, optionally beside busy loops (issue 30: "zero silent wedges in 10
consecutive full runs beside two busy loops").

    .venv/bin/python -m bench.goodput.wedge_check [--runs 10] [--busy-loops 2] [--out PATH]

Each run is a subprocess (`nice -n 0` by default: beside busy loops at 0, `nice -n 10`
leaves it a tenth of a core; its report in a temporary folder, so the committed
`goodput.json` is left alone); per run it records the exit status, real seconds, the load
average before and after, the rows, the retries the watchdog made and what it printed when it
abandoned a run (`wedged (...)`: the stuck-time detection firing), and spotrain elastic's
goodput. The busy loops are `bash -c 'while :; do :; done'` processes started here and killed
here (by their ids) when the check ends, also on failure; their CPU time is recorded to show
they ran.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ..common import REPO, SHARED_TRACES, cpu_s

RUN_LIMIT_S = 1800  # a run still going after this is a wedge the harness missed
ZONES = ("us-east-2b", "us-west-2a", "us-west-2c")


def traces() -> list[str]:
    """The three shared 16-node traces, as `--trace` arguments."""
    args: list[str] = []
    for zone in ZONES:
        args += [
            "--trace",
            str(SHARED_TRACES / f"availability_16-node_aws-08-27-2023_{zone}_v100_1.json"),
        ]
    return args


def _die_with_parent() -> None:
    """In a busy loop's child before exec: the kernel kills it when this process ends, however
    it ends (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


def one_run(n: int, nice: int, extra: list[str]) -> dict[str, Any]:
    """One full goodput run in a subprocess, and what it showed."""
    with tempfile.TemporaryDirectory(prefix="wedge-check-") as out:
        cmd = ["nice", "-n", str(nice), sys.executable, "-m", "bench.goodput", *traces(), *extra]
        cmd += ["--out", out]
        load_start, began = os.getloadavg(), time.monotonic()
        # its own session: the run and its servers end together if this one ends early
        child = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            _, stderr = child.communicate(timeout=RUN_LIMIT_S)
            proc = subprocess.CompletedProcess(cmd, child.returncode, "", stderr)
        except subprocess.TimeoutExpired:  # a wedge nothing inside caught
            os.killpg(child.pid, signal.SIGKILL)
            _, stderr = child.communicate()
            proc = subprocess.CompletedProcess(cmd, -1, "", stderr + "\n(wedge check: timed out)")
        except BaseException:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        real = time.monotonic() - began
        report: dict[str, Any] = {}
        path = Path(out) / "goodput.json"
        if path.exists():
            report = json.loads(path.read_text())
    rows = report.get("rows", [])
    elastic = [r for r in rows if r["policy"] == "spotrain elastic"]
    wedged = [line for line in proc.stderr.splitlines() if "wedged" in line]
    return {
        "run": n,
        "rc": proc.returncode,
        "real_s": round(real),
        "load_start": [round(x, 2) for x in load_start],
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "rows": len(rows),
        "retries": sum(r.get("retries", 0) for r in rows),
        "watchdog_fired": wedged,
        "spotrain_run_s": {r["policy"]: r["run_s"] for r in rows if r.get("run_s")},
        "elastic_goodput": elastic[0]["goodput"] if elastic else None,
        "stderr_tail": proc.stderr[-2000:] if proc.returncode else "",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        prog="bench.goodput.wedge_check", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--busy-loops", type=int, default=2, help="busy loops beside the runs")
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="the runs' niceness (the loops run at 0: at 10 a run gets a tenth of a core)",
    )
    p.add_argument(
        "--out", type=Path, default=REPO / "bench" / "results" / "goodput_wedge_check_busy.json"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the runs already in --out and go on from the next (its busy loops anew)",
    )
    p.add_argument("extra", nargs="*", help="more bench.goodput arguments (after --)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # (the finally clauses run)
    loops = [
        subprocess.Popen(["bash", "-c", "while :; do :; done"], preexec_fn=_die_with_parent)
        for _ in range(args.busy_loops)
    ]
    report: dict[str, Any] = {
        "command": f"python -m bench.goodput.wedge_check --runs {args.runs} --busy-loops "
        f"{args.busy_loops}: bench.goodput on the three shared 16-node traces "
        f"({', '.join(ZONES)}), defaults otherwise {args.extra or ''}, nice -n {args.nice}, one "
        f"after another, {args.busy_loops} busy loops (bash 'while :; do :; done') beside",
        "date": datetime.now(UTC).date().isoformat(),
        "cores": os.cpu_count(),
        "runs": [],
    }
    if args.resume and args.out.exists():
        report = json.loads(args.out.read_text())
    report.setdefault("starts", []).append(datetime.now(UTC).isoformat(timespec="seconds"))
    try:
        for n in range(len(report["runs"]) + 1, args.runs + 1):
            before = [cpu_s(loop.pid) for loop in loops]
            run = one_run(n, args.nice, args.extra)
            run["busy_loop_cpu_s"] = [
                round(cpu_s(loop.pid) - b) for loop, b in zip(loops, before, strict=True)
            ]
            report["runs"].append(run)
            print(json.dumps(run), flush=True)
            args.out.write_text(json.dumps(report, indent=1))  # each run kept as it ends
    finally:
        for loop in loops:
            loop.send_signal(signal.SIGKILL)
            loop.wait()
    runs = report["runs"]
    report["summary"] = {
        "runs": len(runs),
        "all_exit_0": all(r["rc"] == 0 for r in runs),
        "retries": sum(r["retries"] for r in runs),
        "watchdog_fired": sum(len(r["watchdog_fired"]) for r in runs),
        "real_s": [min(r["real_s"] for r in runs), max(r["real_s"] for r in runs)],
        "load_1min": [
            min(min(r["load_start"][0], r["load_end"][0]) for r in runs),
            max(max(r["load_start"][0], r["load_end"][0]) for r in runs),
        ],
    }
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"]))
    return report


if __name__ == "__main__":
    main()
