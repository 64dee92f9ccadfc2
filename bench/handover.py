"""Live resize's state hand-over against its limit, side by side in one run.

    .venv/bin/python -m bench.handover [--params 10 100 300] [--survivors 1 3] [--repeats 3]
                                       [--link-gbit R]

Real processes on this machine (gloo over loopback, CPU; with `--link-gbit`, each on a host of
its own whose sending is capped at R Gbit/s: bench/netns.py): S survivors hold an MLP of P million
parameters and its SGD momentum (the state: 8 bytes a parameter), and one joiner holds a
model of the same shape with other values. Each repeat measures, on the same process group:

- raw: `dist.broadcast` of the same tensors from a survivor to every rank (the wire's limit:
  no pickling, no packing; survivors receive too, as a broadcast does);
- handover: `spotrain.elastic.handover.transfer`, what `live.sync` runs (striped over the
  survivors, point to point to the joiner);
- pickled (`--pickled`, 1 survivor, at most 100M): `broadcast_object_list` of the state
  dicts, what `live.sync` did before.

Each repeat checks the joiner's state equals the survivors'. Memory: the source's RSS peak
during the hand-over above its RSS just before (sampled every 2 ms), against the state size.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from spotrain.workers.embedded.stack import free_port

from .common import REPO, publish, summary
from .netns import Host, shaped_hosts

COLUMNS = ["params_M", "survivors", "method", "n", "median", "p99", "vs_raw", "gb_s", "rss_x"]


def run_case(
    params_m: float, survivors: int, repeats: int, pickled: bool, link_gbit: float | None = None
) -> dict[str, Any]:
    """One process group of `survivors` + 1 ranks; rank 0's measurements. `link_gbit`: each
    rank on a host of its own whose sending is capped at that rate (bench/netns.py)."""
    world = survivors + 1
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(shaped_hosts(world, link_gbit)) if link_gbit else None
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="spotrain-handover-"))
        return _run_ranks(world, json.dumps([params_m, survivors, repeats, pickled]), tmp, hosts)


def _run_ranks(world: int, arg: str, tmp: str, hosts: list[Host] | None) -> dict[str, Any]:
    port, procs = free_port(), []
    try:
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world)}
            env["MASTER_ADDR"] = hosts[0].address if hosts else "127.0.0.1"
            env |= {"MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}
            command = [sys.executable, "-m", "bench.handover_rank", arg]
            if hosts:
                env |= hosts[rank].env
                command = hosts[rank].command(command)
            log = open(Path(tmp) / f"rank-{rank}.log", "w")  # noqa: SIM115 (closed below)
            procs.append(
                (subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log)
            )
        for proc, _ in procs:
            proc.wait(timeout=1800)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    text = (Path(tmp) / "rank-0.log").read_text()
    if procs[0][0].returncode != 0 or "RESULT " not in text:
        logs = "\n".join((Path(tmp) / f"rank-{r}.log").read_text()[-2000:] for r in range(world))
        raise RuntimeError(f"case {arg} failed:\n{logs}")
    return json.loads(text.split("RESULT ", 1)[1].splitlines()[0])


def rows_of(params_m: float, survivors: int, measured: dict[str, Any]) -> list[dict[str, Any]]:
    state = measured["state_bytes"]
    raw = summary([r["raw"] for r in measured["rows"]])
    out = []
    for method in ("raw", "handover", "pickled"):
        values = [r[method] for r in measured["rows"] if method in r]
        if not values:
            continue
        st = summary(values)
        row = {"params_M": params_m, "survivors": survivors, "method": method, **st}
        row["state_MB"] = state / 1e6
        row["vs_raw"] = st["median"] / raw["median"]
        row["gb_s"] = state / st["median"] / 1e9
        if method == "handover":
            row["rss_x"] = max(r["rss"] for r in measured["rows"]) / state
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--params",
        type=float,
        nargs="+",
        default=[10, 100, 300],
        help="model sizes, millions of parameters",
    )
    parser.add_argument(
        "--survivors",
        type=int,
        nargs="+",
        default=[1, 3],
        help="ranks holding the state (one joiner takes it)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="measurements per case")
    parser.add_argument(
        "--pickled",
        action="store_true",
        help="also time the old pickled hand-over (1 survivor, <= 100M)",
    )
    parser.add_argument(
        "--link-gbit",
        type=float,
        help="each rank on a host of its own sending at most this many Gbit/s (a network "
        "namespace: needs root and iproute2); else all on loopback",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    rows, raw = [], {}
    for params_m in args.params:
        for survivors in args.survivors:
            pickled = args.pickled and survivors == 1 and params_m <= 100
            measured = run_case(params_m, survivors, args.repeats, pickled, args.link_gbit)
            raw[f"{params_m}M x{survivors}"] = measured
            rows += rows_of(params_m, survivors, measured)
            print(f"{params_m}M x{survivors}: done", file=sys.stderr, flush=True)
    out = {
        "benchmark": "handover",
        "settings": {**vars(args), "out": None, "cpus": os.cpu_count()},
        "load_average": os.getloadavg(),
        "rows": rows,
        "raw": raw,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    name = f"handover_link_{args.link_gbit:g}gbit.json" if args.link_gbit else "handover.json"
    publish(out, rows, COLUMNS, args.out / name)
    return out


if __name__ == "__main__":
    main()
