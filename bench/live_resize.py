"""Training pause per resize, restart mode vs live mode, side by side in one run.

    .venv/bin/python -m bench.live_resize [--reclaims 20] [--losses 20] [--step-time 0.02]
        [--runtime local|kubernetes] [--params 100 --step-time 0 --settle-steps 3]
        [--example fsdp --procs-per-node 2 [--full-shard]]

The whole path as a user runs it: the real TrainingJob workflow on the Temporal dev server,
the simulated cloud (always capacity) and the rank runtime starting real PyTorch DDP ranks
(examples/train_ddp.py: gloo, CPU, 3 ranks, 20 ms steps): local processes, or pods on the
real Kubernetes control plane whose commands tests/kube/kube_kubelet.py runs here in place of a
kubelet (each instance a node; a node lost with its instance). The same job runs twice, with
`elastic.resize: restart` and `live`. Each job gets `--reclaims` reclaim notices (a shrink,
then growth back when the replacement is ready) and `--losses` nodes lost without notice (a
shrink at once, then growth back), one at a time, each once the job is back at full size
and has trained a few steps.

- pause: from the last step any rank finished in one generation to the first step of the
  next (the ranks' own step records), by what the resize was (the job's timeline):
  shrink on a notice, growth, loss without notice.
- steps lost per loss without notice: steps the ranks had done in the generation beyond
  where the next one resumed (restart mode: back to the last periodic checkpoint, every
  `--ckpt-every` steps; live mode: at most the step in flight).
- `--example fsdp`: the sharded example instead (examples/train_fsdp.py: a decoder-only
  transformer, FSDP2 as HSDP, AdamW: 12 bytes a parameter, sharded over a node's
  `--procs-per-node` processes); a node is one replica. With `--full-shard`: pure FSDP over
  every rank (no replica), and live mode with `elastic.peer_copy` (each node keeps its ring
  neighbour's shards, stepped with its gradients): every resize reshards in memory, a lost
  or noticed node's shards come from the copy; reported beside the pauses: the copy's cost
  per step (gradient exchange and barrier, and the optimizer's step on the copy) against the
  step, and each reshard's time.
- `--params N`: a model of about N million parameters (the state: 8 bytes a parameter, model
  and momentum). A pause includes the first step after the resize: the step time is
  reported beside it, and "less a step" is the median pause less the median step (the time
  no rank computed). Live mode also times, after each hand-over, a raw `dist.broadcast` of
  the same tensors on the same group (the limit), and reports the notice's checkpoint: how
  long it blocked training, and how long after the notice it was durable.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client as kube_client
from temporalio.client import Client, WorkflowHandle, WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from spotrain.activities.kube import KubeRuntime
from spotrain.activities.kube_live import PORT_SPAN
from spotrain.activities.local import LocalRuntime
from spotrain.activities.simulated import SimulatedCloud
from spotrain.elastic import checkpoint_writer
from spotrain.elastic.job_store import JobStore
from spotrain.workers.embedded.stack import port_block
from spotrain.workers.worker import workflow_worker
from spotrain.workflows.contract import CleanupRequest
from spotrain.workflows.job.state import JobStatus, Phase, TimelineEntry
from tests.kube.k8s_cluster import NAMESPACE, ControlPlane, binaries
from tests.kube.kube_kubelet import LocalKubelet, nodes_follow_instances

from .common import REPO, dev_server, publish, summary

NODES, GLOBAL_BATCH = 3, 48
KINDS = ("shrink on notice", "growth", "loss without notice")
COLUMNS = [
    "kind",
    "mode",
    "n",
    "median",
    "p99",
    "min",
    "max",
    "less a step",
    "restart/live",
    "vs raw",
]


def job_spec(name: str, mode: str, record: Path, root: Path, args: argparse.Namespace) -> dict:
    ddp = args.example == "ddp"
    return {
        "name": name,
        "type": "pytorch",
        "command": [
            sys.executable,
            str(REPO / "examples" / f"train_{args.example}.py"),
            "--record",
            str(record),
            "--step-time",
            str(args.step_time),
            *(["--params", str(args.params)] if args.params else []),
            *(["--oracle"] if args.params and not args.full_shard else []),
            *(["--full-shard"] if args.full_shard else []),
        ],
        "total_steps": 10**7,
        "global_batch_size": GLOBAL_BATCH,
        "procs_per_node": args.procs_per_node,
        "scale_config": {
            n * args.procs_per_node: {"lr": 0.02 if ddp else 3e-3, "ckpt_every": args.ckpt_every}
            for n in range(1, NODES + 1)
        },
        # "live-process": live resize, background checkpoints written by the writer process
        # (spotrain.elastic.checkpoint_writer), for a side-by-side comparison
        "env": {checkpoint_writer.WRITER_ENV: "process"} if mode == "live-process" else {},
        "checkpoint": f"file://{root / 'ckpt' / name}",
        # every notice's checkpoint record stays to be reported: 40 resizes at 20 ms steps
        # write some 200 periodic checkpoints besides (100 lost the oldest notices' records)
        "checkpoint_keep": 1000,
        "elastic": {
            "min_nodes": 1,
            "max_nodes": NODES,
            "resize": mode.removesuffix("-process"),
            "graceful_shutdown_timeout_s": 60,
            "scaling_timeout_s": 1,
            "faulty_scale_down_timeout_s": 0,
            "capacity_check_interval_s": 1,
            "progress_report_interval_s": 0.5,
            "max_restarts": 1000,
            "peer_copy": args.full_shard and mode == "live",
        },
        "spot": {
            "instance_types": [
                {"name": "m5.large", "gpus": 0, "on_demand_price": 0.096, "spot_price": 0.035}
            ],
            "zones": ["us-east-1a"],
        },
        "on_demand": {"fallback": False},
    }


async def status(handle: WorkflowHandle[Any, Any]) -> JobStatus:
    """The job's status. A query the SDK refused because the workflow task took over 2 s of
    CPU (its deadlock detector), or one the server gave up on (its RPC deadline), on a
    starved machine (load above 20 seen here), is asked again: the workflow goes on."""
    while True:
        try:
            return await handle.query("status", result_type=JobStatus)
        except WorkflowQueryFailedError as err:
            if "Potential deadlock" not in str(err):
                raise
        except RPCError as err:
            if err.status not in (RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED):
                raise
        await asyncio.sleep(1)


async def back_at_full_size(
    handle: WorkflowHandle[Any, Any], after: int, steps: int, world: int
) -> JobStatus:
    """Wait until the job runs a generation after `after` at full size (`world` ranks) and has
    trained `steps` steps in it (so the next reclaim never lands in the middle of a resize)."""
    deadline = time.monotonic() + 300
    while True:
        s = await status(handle)
        if s.generation > after and s.world_size == world and s.phase == Phase.RUNNING:
            base = s.step
            while (s := await status(handle)).step < base + steps:
                assert s.generation > after and time.monotonic() < deadline, s.timeline[-5:]
                await asyncio.sleep(0.1)
            return s
        assert time.monotonic() < deadline, f"not back at full size: {s.timeline[-5:]}"
        await asyncio.sleep(0.1)


def step_records(record: Path) -> dict[int, list[dict[str, Any]]]:
    """Generation -> every rank's step records in it."""
    out: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for f in record.glob("gen-*-rank-*.jsonl"):
        generation = int(f.name.split("-")[1])
        out[generation] += [json.loads(line) for line in f.read_text().splitlines()]
    return out


def kind_of(stop: TimelineEntry) -> str | None:
    detail = stop.detail
    if detail.startswith("reclaim notice"):
        return "shrink on notice"
    if detail.startswith("grow"):
        return "growth"
    if " lost" in detail or detail.startswith("fault"):
        return "loss without notice"
    return None


def pauses(timeline: list[TimelineEntry], record: Path) -> dict[str, Any]:
    """Pause per resize by kind, and steps lost per loss, from the step records."""
    steps = step_records(record)
    stops = [
        e for e in timeline if e.event.startswith("generation ") and e.event != "generation started"
    ]
    out: dict[str, list[float]] = {k: [] for k in KINDS}
    lost: list[int] = []
    slow: list[dict[str, Any]] = []  # pauses over 5 s: the stop as the timeline tells it
    for stop in stops:
        kind, g = kind_of(stop), stop.generation
        before, after = steps.get(g), steps.get(g + 1)
        if kind is None or not before or not after:
            continue  # (the last generation, cancelled at the end)
        pause = min(e["time"] for e in after) - max(e["time"] for e in before)
        out[kind].append(pause)
        if pause > 5:
            slow.append({"generation": g, "pause_s": pause, "stop": f"{stop.event}: {stop.detail}"})
        if kind == "loss without notice":
            lost.append(max(e["step"] for e in before) - (min(e["step"] for e in after) - 1))
    handovers = [json.loads(f.read_text()) for f in sorted(record.glob("gen-*-handover.json"))]
    reshards = [json.loads(f.read_text()) for f in sorted(record.glob("gen-*-reshard.json"))]
    # the peer copy's share of each step (rank 0's records; 0 without a copy)
    copy = [e["copy_s"] for g in steps.values() for e in g if e.get("copy_s") and "loss" in e]
    return {
        "pause_s": out,
        "steps_lost": lost,
        "slow": slow,
        "handovers": handovers,
        "reshards": reshards,
        "copy_s": copy,
        "step_s": summary(step_durations(steps)),
    }


def step_durations(steps: dict[int, list[dict[str, Any]]]) -> list[float]:
    """Seconds between one step's end and the next's within a generation (one rank's record):
    a pause above includes one of them (the first step after the resize)."""
    out = []
    for entries in steps.values():
        times = sorted(e["time"] for e in entries if e.get("loss") is not None)  # (rank 0)
        out += [b - a for a, b in itertools.pairwise(times)]
    return out


@contextmanager
def rank_runtime(
    kind: str, root: Path, cloud: SimulatedCloud
) -> Iterator[tuple[LocalRuntime | KubeRuntime, Callable[[str, str], object]]]:
    """The rank runtime, and how a node is lost without notice on it (job, node)."""
    if kind == "local":
        runtime = LocalRuntime(root / "rt", term_grace_s=2)
        yield runtime, runtime.kill_node
        return
    # Kubernetes: the real control plane; the kubelet stood in for (tests/kube/kube_kubelet.py).
    with ControlPlane.running(binaries(build=True)) as cluster:
        core = kube_client.CoreV1Api(cluster.admin)
        kubelet = LocalKubelet(core, NAMESPACE, root / "kubelet")
        worker = cluster.api_client(cluster.service_account_kubeconfig("spotrain-worker"))
        # (every pod here shares this machine's network: rendezvous ports of the bench's own)
        with (
            port_block(PORT_SPAN) as rendezvous,
            kubelet.serving(),
            nodes_follow_instances(cloud, cluster, kubelet),
        ):
            runtime = KubeRuntime(
                NAMESPACE, worker, master_port=rendezvous, gang_timeout_s=120, ack_poll_s=0.1
            )
            yield runtime, lambda job, node: None  # its node goes with the instance


async def run_mode(
    client: Client, mode: str, root: Path, args: argparse.Namespace
) -> dict[str, Any]:
    cloud = SimulatedCloud(zones=["us-east-1a"])
    name = f"live-bench-{mode}-{uuid.uuid4().hex[:6]}"
    record = root / "records" / name
    spec = job_spec(name, mode, record, root, args)
    if args.runtime == "kubernetes":
        spec["image"] = "bench/none:1"  # (the stand-in kubelet runs the command here)
    full = NODES * args.procs_per_node
    with rank_runtime(args.runtime, root, cloud) as (runtime, lose), ThreadPoolExecutor(8) as pool:
        async with workflow_worker(
            client, name, cloud.activities() + runtime.activities(), activity_executor=pool
        ):
            handle = await client.start_workflow("TrainingJob", spec, id=name, task_queue=name)
            try:
                s = await back_at_full_size(handle, 0, args.settle_steps, full)
                for i in range(args.reclaims + args.losses):
                    members = sorted(
                        (n for n in s.nodes if n.node_id and n.rank is not None),
                        key=lambda n: n.rank,
                    )
                    victim = members[1].node_id  # (the middle node: survivors renumber)
                    if i < args.reclaims:
                        deadline = datetime.now(UTC) + timedelta(seconds=120)
                        await handle.signal("reclaim", {"node_id": victim, "deadline": deadline})
                    else:
                        lose(name, victim)
                        cloud.reclaim(victim)
                        await handle.signal("node_lost", {"node_id": victim, "event_id": victim})
                    s = await back_at_full_size(handle, s.generation, args.settle_steps, full)
                    print(f"{mode}: {i + 1} of {args.reclaims + args.losses} done", file=sys.stderr)
                timeline = await handle.query("timeline", result_type=list[TimelineEntry])
            finally:
                await handle.cancel()
                runtime.cleanup_job(CleanupRequest(job=name))
    notices = [c for c in JobStore(spec["checkpoint"]).checkpoints() if c["kind"] == "notice"]
    return pauses(timeline, record) | {"notice_checkpoints": notices}


async def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="spotrain-live-bench-") as tmp:
        async with dev_server() as env:
            return {mode: await run_mode(env.client, mode, Path(tmp), args) for mode in args.modes}


def report(measured: dict[str, dict[str, Any]], args: argparse.Namespace) -> tuple[dict, list]:
    rows = []
    for kind in KINDS:
        stats = {m: summary(measured[m]["pause_s"][kind]) for m in measured}
        for mode, st in stats.items():
            ratio = None
            if mode == "live" and stats.get("restart", {}).get("n") and st.get("n"):
                ratio = stats["restart"]["median"] / st["median"]
            # (a pause ends with the first step after the resize: the median less one step is
            # the time no rank computed)
            net = st["median"] - measured[mode]["step_s"]["median"] if st.get("n") else None
            rows.append(
                {"kind": kind, "mode": mode, **st, "less a step": net, "restart/live": ratio}
            )
    for mode in measured:
        lost = [float(v) for v in measured[mode]["steps_lost"]]
        rows.append({"kind": "steps lost per loss", "mode": mode, **summary(lost)})
    for mode in measured:  # the pauses above include one such step
        rows.append({"kind": "step (for scale)", "mode": mode, **measured[mode]["step_s"]})
    for mode in measured:  # the notice's checkpoint: training blocked, and durable after
        notices = measured[mode].get("notice_checkpoints", [])
        if not notices:  # (a job cancelled before its last notice's checkpoint completed)
            continue
        blocked = summary([c["blocked_s"] for c in notices])
        rows.append({"kind": "notice checkpoint: blocked", "mode": mode, **blocked})
        if after := [c["after_notice_s"] for c in notices if "after_notice_s" in c]:
            rows.append(
                {"kind": "notice checkpoint: durable after", "mode": mode, **summary(after)}
            )
    handovers = measured.get("live", {}).get("handovers", [])
    if handovers:  # the joiner's hand-over beside a raw broadcast of the same tensors
        took = summary([h["handover_s"] for h in handovers])
        raw = summary([h["raw_s"] for h in handovers])
        rows.append({"kind": "raw broadcast (limit)", "mode": "live", **raw})
        ratio = took["median"] / raw["median"] if raw.get("median") else None
        rows.append({"kind": "hand-over", "mode": "live", **took, "vs raw": ratio})
    live = measured.get("live", {})
    if live.get("copy_s"):  # the peer copy's cost per step, against the step
        copy = summary(live["copy_s"])
        rows.append({"kind": "peer copy per step", "mode": "live", **copy})
        share = copy["median"] / live["step_s"]["median"]
        rows.append({"kind": "peer copy / step", "mode": "live", "n": copy["n"], "median": share})
    for kind, picked in (("reshard: growth", False), ("reshard: from a peer copy", True)):
        took = [r["reshard_s"] for r in live.get("reshards", []) if (r["from_copy"] > 0) == picked]
        if took:
            rows.append({"kind": kind, "mode": "live", **summary(took)})
    if boot := [r["bootstrap_s"] for r in live.get("reshards", [])]:
        rows.append({"kind": "peer copy taken (new generation)", "mode": "live", **summary(boot)})
    out = {
        "benchmark": "live_resize",
        "settings": {
            "runtime": args.runtime,
            "example": args.example,
            "nodes": NODES,
            "procs_per_node": args.procs_per_node,
            "full_shard": args.full_shard,
            "step_time_s": args.step_time,
            "ckpt_every": args.ckpt_every,
            "reclaims": args.reclaims,
            "losses": args.losses,
            "params_m": args.params,
            "state_mb": (handovers[0]["bytes"] / 1e6) if handovers else None,
        },
        "load_average": os.getloadavg(),
        "rows": rows,
        "raw": measured,
    }
    return out, rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reclaims", type=int, default=20, help="reclaim notices per mode")
    parser.add_argument("--losses", type=int, default=20, help="losses without notice per mode")
    parser.add_argument("--step-time", type=float, default=0.02, help="sleep per step (s)")
    parser.add_argument("--ckpt-every", type=int, default=50, help="periodic checkpoint (steps)")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["restart", "live", "live-process"],
        default=["restart", "live"],
        help="live-process: live, background checkpoints written by a process of their own",
    )
    parser.add_argument(
        "--params",
        type=float,
        default=0,
        help="model size in millions of parameters (default: the example's tiny MLP); live "
        "mode then also times a raw broadcast of the same tensors after each hand-over",
    )
    parser.add_argument(
        "--settle-steps", type=int, default=10, help="steps at full size between resizes"
    )
    parser.add_argument(
        "--runtime",
        choices=["local", "kubernetes"],
        default="local",
        help="kubernetes: pods on the real control plane (infra/k8s/controlplane/build.sh)",
    )
    parser.add_argument(
        "--example",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="the replicated MLP (train_ddp.py) or the sharded transformer (train_fsdp.py)",
    )
    parser.add_argument(
        "--procs-per-node", type=int, default=1, help="ranks per node (fsdp: the shard group)"
    )
    parser.add_argument(
        "--full-shard",
        action="store_true",
        help="fsdp: pure FSDP over every rank (no replica), with elastic.peer_copy in live mode",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args(argv)
    out, rows = report(asyncio.run(run(args)), args)
    suffix = "" if args.runtime == "local" else f"_{args.runtime}"
    suffix += "" if args.example == "ddp" else f"_{args.example}"
    suffix += "_full_shard" if args.full_shard else ""
    suffix += f"_{args.params:g}m" if args.params else ""
    publish(out, rows, COLUMNS, args.out / f"live_resize{suffix}.json")
    return out


if __name__ == "__main__":
    main()
