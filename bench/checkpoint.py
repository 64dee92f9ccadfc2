"""Training time blocked per checkpoint: synchronous vs asynchronous DCP saves, to file:// and
to S3 (moto's server on loopback), side by side in one run.

    .venv/bin/python -m bench.checkpoint [--mb 256] [--ranks 2] [--checkpoints 3]
        [--interval-s 15]

Real gloo ranks (subprocesses) hold a model of `--mb` MB (replicated, as under DDP: DCP spreads
the writing over the ranks) and run steps of fixed work (a matmul and an all-reduce). Every
`--interval-s` seconds they checkpoint through spotrain.elastic.checkpoint (an interval longer
than a save, as an asynchronous save needs to pay off). Per checkpoint:
- `blocked`: time inside the save call (sync: the whole save; async: copying the state to
  memory, plus waiting for the previous save if it is still being written);
- `lost`: the interval minus the steps done in it at the step time measured first without
  checkpoints (same ranks): what training really lost, counting the background writer's
  competition for the CPU (2 shared cores here);
- `durable`: from the save call to the checkpoint complete (the library's own record).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import publish, summary

STEP_FLOPS_N = 384  # one step: a 384x384 matmul repeated (about 10-30 ms on these cores)


def rank_main(cfg: dict[str, Any]) -> None:
    """One rank: baseline intervals, then one checkpoint per interval; rank 0 prints JSON."""
    import torch
    import torch.distributed as dist

    from spotrain import elastic
    from spotrain.elastic import checkpoint

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ckpt = checkpoint.Checkpointer(keep=cfg["checkpoints"])  # every record stays for the figures
    n = cfg["mb"] * 2**20 // 4 // 8  # 8 float32 tensors
    gen = torch.Generator().manual_seed(0)
    model = {f"w{i}": torch.randn(n, generator=gen) for i in range(8)}
    a = torch.randn(STEP_FLOPS_N, STEP_FLOPS_N, generator=gen)

    def steps_until(end: float) -> int:
        """Train until `end` (rank 0's clock decides, so every rank takes as many steps)."""
        done = 0
        while True:
            for _ in range(4):
                a.copy_(torch.tanh(a @ a / STEP_FLOPS_N))
            model["w0"][:16] += 1e-3  # training changes the state between checkpoints
            flag = torch.tensor([float(time.perf_counter() < end)])
            dist.broadcast(flag, src=0)
            ckpt.poll()
            done += 1
            if not flag.item():
                return done

    started = time.perf_counter()
    step_s = cfg["interval_s"] / steps_until(started + cfg["interval_s"])
    blocked, lost = [], []
    for k in range(cfg["checkpoints"]):
        state = {"model": model, "step": torch.tensor(k)}
        save = ckpt.save_async if cfg["mode"] == "async" else ckpt.save
        started = time.perf_counter()
        save(state, k + 1, "periodic")
        blocked.append(time.perf_counter() - started)
        done = steps_until(started + cfg["interval_s"])
        lost.append(time.perf_counter() - started - done * step_s)
    ckpt.close()
    dist.barrier()
    if dist.get_rank() == 0:
        records = elastic.store().checkpoints()
        print(json.dumps({"step_s": step_s, "blocked": blocked, "lost": lost}), flush=True)
        print(json.dumps({"records": records}), flush=True)
    os._exit(0)  # gloo's teardown can hang (pytorch/pytorch#75097)


def run_case(cfg: dict[str, Any], uri: str, port: int) -> dict[str, Any]:
    procs = []
    for rank in range(cfg["ranks"]):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(cfg["ranks"]),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "SPOTRAIN_JOB": "bench",
            "SPOTRAIN_GENERATION": "1",
            "SPOTRAIN_CHECKPOINT": uri,
            "SPOTRAIN_TOTAL_STEPS": "1000000",
        }
        command = [sys.executable, "-m", "bench.checkpoint", "--rank-config", json.dumps(cfg)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed in {cfg['mode']} to {uri}")
    lines = [json.loads(line) for line in outputs[0].splitlines() if line.startswith("{")]
    return {**lines[0], **lines[1]}


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="model size in MB (default 256)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints per case")
    p.add_argument("--interval-s", type=float, default=15.0, help="between checkpoints")
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return None

    import boto3
    from moto.server import ThreadedMotoServer

    from spotrain.elastic.job_store import JobStore
    from spotrain.workers.embedded.stack import free_port

    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = dict(os.environ)  # the ranks inherit these; the caller gets its own back
    os.environ.update(AWS_ENDPOINT_URL_S3=endpoint, AWS_DEFAULT_REGION="us-east-1")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    rows, cases = [], {}
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="spotrain-bench")
        with tempfile.TemporaryDirectory(prefix="spotrain-bench-ckpt-") as tmp:
            targets = {"file": f"file://{tmp}", "s3": "s3://spotrain-bench/ckpt"}
            for target, root in targets.items():
                for mode in ("sync", "async"):
                    cfg = vars(args) | {"mode": mode}
                    cfg.pop("out"), cfg.pop("rank_config")
                    out = run_case(cfg, f"{root}/{mode}", free_port())
                    JobStore(f"{root}/{mode}").store.delete_prefix("")  # moto holds it in memory
                    rows.append(row(target, mode, args.mb, out))
                    cases[f"{target}/{mode}"] = out
    finally:
        moto.stop()
        os.environ.clear()
        os.environ.update(saved)
    for target in ("file", "s3"):
        sync, async_ = (r for r in rows if r["target"] == target)
        async_["blocked_vs_sync"] = async_["blocked_median_s"] / sync["blocked_median_s"]
        async_["lost_vs_sync"] = async_["lost_median_s"] / sync["lost_median_s"]
    report = {"setup": vars(args) | {"out": str(args.out)}, "rows": rows, "cases": cases}
    columns = [
        "target",
        "mode",
        "mb",
        "blocked_median_s",
        "blocked_p99_s",
        "lost_median_s",
        "durable_median_s",
        "blocked_vs_sync",
        "lost_vs_sync",
    ]
    publish(report, rows, columns, args.out / "checkpoint.json")
    return report


def row(target: str, mode: str, mb: int, out: dict[str, Any]) -> dict[str, Any]:
    blocked = summary(out["blocked"])
    lost = summary(out["lost"])
    durable = summary([r["duration_s"] for r in out["records"]])
    return {
        "target": target,
        "mode": mode,
        "mb": mb,
        "blocked_median_s": blocked["median"],
        "blocked_p99_s": blocked["p99"],
        "lost_median_s": lost["median"],
        "durable_median_s": durable["median"],
        "step_s": out["step_s"],
    }


if __name__ == "__main__":
    main()
