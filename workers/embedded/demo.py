"""`spotrain demo`: real elastic training through two spot reclaims, in a few minutes.

It brings up the embedded stack (on free ports, beside any `spotrain dev`), submits the
example PyTorch DDP job on 4 spot nodes (min 2), reclaims one node with a notice and later
another without, lets the replacements arrive, and prints a live view and a summary. It then
checks that nothing was left behind: no running instance, no worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from spotrain.activities.local import LocalRuntime
from spotrain.activities.local_ranks import job_processes
from spotrain.elastic.job_store import JobStore
from spotrain.workers.cli.support import CliError, query_status
from spotrain.workers.embedded.stack import CHECKPOINT_BUCKET, Stack, StackConfig
from spotrain.workflows.contract import CleanupRequest
from spotrain.workflows.job.checkpoints import describe
from spotrain.workflows.job.state import JobResult, JobStatus, Phase

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SETTLE_STEPS = 10  # trained in a generation before the next reclaim
PROGRESS_EVERY_S = 10.0  # without a terminal: a progress line at least this often
console = Console()


def demo_spec(
    state_dir: Path, steps: int, step_time: float, record: Path | None = None, s3: bool = True
) -> dict[str, Any]:
    """examples/job.yaml (its bare `python` is the interpreter spotrain runs under),
    checkpoints in the stack's S3 bucket (moto), or with `s3=False` in the demo's state dir."""
    spec = yaml.safe_load((EXAMPLES / "job.yaml").read_text())
    spec["name"] = f"demo-{int(time.time())}"
    spec["command"] = [
        "python",
        str(EXAMPLES / "train_ddp.py"),
        "--step-time",
        str(step_time),
    ]
    if record is not None:  # the script's own account of steps, samples and losses (tests)
        spec["command"] += ["--record", str(record)]
    spec["total_steps"] = steps
    spec["checkpoint"] = (
        f"s3://{CHECKPOINT_BUCKET}/{spec['name']}"
        if s3
        else f"file://{state_dir / 'checkpoints' / spec['name']}"
    )
    # (a short scaling timeout: the job grows back onto the replacements within the demo)
    spec["elastic"].update(
        progress_report_interval_s=1, capacity_check_interval_s=10, scaling_timeout_s=3
    )
    return spec


@dataclass
class Script:
    """When to reclaim what: one node with notice at 30%, another without at 55%, each once
    the job runs at full size and has trained a few steps in that generation (not while its
    ranks are still meeting)."""

    total: int
    done: list[str] = field(default_factory=list)
    seen: dict[int, int] = field(default_factory=dict)  # generation -> first step seen in it

    def next_reclaim(self, s: JobStatus) -> tuple[str, float | None] | None:
        ranked = sorted((n for n in s.nodes if n.rank is not None), key=lambda n: n.rank or 0)
        first = self.seen.setdefault(s.generation, s.step)
        if s.phase != Phase.RUNNING or len(ranked) < 4 or s.step < first + SETTLE_STEPS:
            return None
        if not self.done and s.step >= 0.3 * self.total:
            return ranked[1].node_id or "", 20.0
        if len(self.done) == 1 and s.step >= 0.55 * self.total:
            return ranked[2].node_id or "", None
        return None


def view(s: JobStatus, notes: list[str]) -> Group:
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[bold]{s.name}[/]",
        f"phase [bold]{s.phase}[/]",
        f"generation {s.generation}",
        f"world size {s.world_size}",
        f"step {s.step}/{s.total_steps}",
        f"cost ${s.cost_so_far:.4f}",
    )
    nodes = Table("node", "rank", "lifecycle", "type", "zone", "state", box=None)
    for n in s.nodes:
        if n.state.is_alive:
            nodes.add_row(
                n.node_id or "-",
                str(n.rank if n.rank is not None else "-"),
                n.lifecycle,
                n.instance_type,
                n.zone or "-",
                n.state,
            )
    return Group(head, nodes, *notes[-4:])


@dataclass
class Progress:
    """Without a terminal (CI, a pipe, a log file) a live view shows nothing until it ends: a
    line instead for each note, each change of phase, generation or world size, and every
    `every_s` seconds between them."""

    every_s: float = PROGRESS_EVERY_S
    shown: tuple[str, int, int] | None = None
    at: float = float("-inf")
    notes: int = 0

    def lines(self, s: JobStatus, notes: list[str], now: float) -> list[str]:
        out, self.notes = notes[self.notes :], len(notes)
        key = (str(s.phase), s.generation, s.world_size)
        if key != self.shown or now - self.at >= self.every_s:
            out.append(
                f"{time.strftime('%H:%M:%S')} {s.name}: {s.phase}, generation {s.generation},"
                f" world size {s.world_size}, step {s.step}/{s.total_steps},"
                f" cost ${s.cost_so_far:.4f}"
            )
            self.shown, self.at = key, now
        return out


def summary(result: JobResult, elapsed: float, notice_to_durable: list[float]) -> Table:
    t = Table(title=f"{result.name}: {result.phase} in {elapsed:.0f} s", show_header=False)
    sizes = [e.world_size for e in result.timeline if e.event == "generation started"]
    t.add_row("generations", str(result.generations))
    t.add_row("world size over time", " -> ".join(map(str, sizes)))
    t.add_row("reclaims survived", str(result.reclaims))
    t.add_row("steps done / lost", f"{result.steps_done} / {result.steps_lost}")
    t.add_row(
        "node-hours spot / on-demand",
        f"{result.node_hours['spot']:.4f} / {result.node_hours['on-demand']:.4f}",
    )
    t.add_row(
        "cost spot / on-demand", f"${result.cost['spot']:.5f} / ${result.cost['on-demand']:.5f}"
    )
    t.add_row("cost if all on-demand", f"${result.all_on_demand_cost:.5f}")
    t.add_row("savings", f"{result.savings:.1%}")
    t.add_row("checkpoints", describe(result.checkpoints) or "-")
    t.add_row(
        "notice -> checkpoint durable",
        ", ".join(f"{s:.2f} s" for s in notice_to_durable) or "-",
    )
    return t


async def run(args: argparse.Namespace) -> int:
    state = Path(args.state_dir)
    started = time.monotonic()
    console.print(f"starting the embedded stack (state in {state})...")
    async with Stack(StackConfig.ephemeral(state)) as stack:
        console.print(f"Temporal Web UI: http://127.0.0.1:{stack.config.ui_port}")
        spec = demo_spec(state, args.steps, args.step_time, args.record, args.checkpoint == "s3")
        handle = await stack.client.start_workflow(
            "TrainingJob",
            spec,
            id=spec["name"],
            task_queue=stack.config.task_queue,
            result_type=JobResult,
        )
        script, notes, reclaims = Script(args.steps), [], []
        noticed: dict[int, float] = {}  # generation -> when its notice was sent
        live = Live(console=console, refresh_per_second=4) if console.is_terminal else None
        progress = Progress()
        with live or contextlib.nullcontext():
            while True:
                status = await query_status(handle)
                plan = script.next_reclaim(status)
                if plan:
                    node, notice = plan
                    script.done.append(node)
                    if notice:
                        noticed[status.generation] = time.time()
                    notes.append(
                        f"reclaiming {node} "
                        + (f"with {notice:.0f} s notice" if notice else "without notice")
                    )
                    reclaims.append(asyncio.create_task(stack.market.reclaim(node, notice)))
                if live is not None:
                    live.update(view(status, notes))
                else:
                    for line in progress.lines(status, notes, time.monotonic()):
                        console.print(line, markup=False, highlight=False, soft_wrap=True)
                if status.phase.is_final:
                    break
                await asyncio.sleep(0.5)
        result = await handle.result()
        for task in reclaims:
            task.cancel()
        store = JobStore(spec["checkpoint"])
        durable = [  # the last rank's ack: written once the notice's checkpoint was durable
            max(a["time"] for a in acks) - sent
            for g, sent in noticed.items()
            if (acks := store.acks(g))
        ]
        console.print(summary(result, time.monotonic() - started, durable))
        left = stack.running_instances()
        procs = job_processes(spec["name"])
        console.print(f"left running: {len(left)} instance(s), {len(procs)} worker process(es)")
        return 0 if result.phase == Phase.SUCCEEDED and not left and not procs else 1


@contextlib.contextmanager
def state_dir(given: Path | None, keep: bool) -> Iterator[Path]:
    """The directory given (the user's: kept), or a new temporary one that goes afterwards
    with whatever is left in it (rank processes included), unless `keep`."""
    if given is not None:
        yield given
        return
    path = Path(tempfile.mkdtemp(prefix="spotrain-demo-"))
    try:
        yield path
    finally:
        if keep:
            console.print(f"state kept in {path}")
        else:
            runtime = LocalRuntime(path)
            for job in (path / "jobs").glob("*"):
                runtime.cleanup_job(CleanupRequest(job=job.name))
            shutil.rmtree(path, ignore_errors=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spotrain demo",
        description=__doc__.splitlines()[0],
        epilog="examples:\n  spotrain demo\n  spotrain demo --steps 600 --step-time 0.02",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=2000, help="training steps (default 2000)")
    p.add_argument(
        "--step-time", type=float, default=0.03, help="seconds per step (a bigger model)"
    )
    p.add_argument(
        "--state-dir", type=Path, help="default: a new temporary directory, removed at the end"
    )
    p.add_argument(
        "--keep-state", action="store_true", help="keep the temporary state directory (logs)"
    )
    p.add_argument("--record", type=Path, help="the training script records steps and losses here")
    p.add_argument(
        "--checkpoint",
        choices=["s3", "file"],
        default="s3",
        help="checkpoint to the stack's S3 (moto, default) or to files in the state dir",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    with state_dir(args.state_dir, args.keep_state) as args.state_dir:
        try:
            code = asyncio.run(run(args))
        except CliError as e:
            print(f"error: {e}", file=sys.stderr)
            code = e.code
    sys.stdout.flush()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
