"""`spotrain`: start, watch, steer and explain training jobs from a terminal.

Every job is a `TrainingJob` workflow whose id is the job name, so each command is a thin
Temporal call: start, query `status`, updates, cancel, visibility list. Reads take `--json`
for scripts. Exit codes: 0 ok, 1 the operation failed or was rejected, 2 bad usage or invalid
input, 3 Temporal cannot be reached or did not answer in time. Expected errors print one clear
message, never a traceback. The process leaves through `os._exit` after flushing: the
Temporal client can abort the interpreter's shutdown (see DESIGN.md, "Process exit").

This module is the parser and the dispatch; the commands live by what they do:
jobs.py (start and steer), views.py (list, status, report), pools.py (capacity pools),
housekeeping.py (gc, logs), and what they share in support.py, all in this package.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from temporalio.service import RPCError

from spotrain.workers.cli.housekeeping import cmd_gc, cmd_logs, cmd_release
from spotrain.workers.cli.jobs import (
    cmd_budget,
    cmd_cancel,
    cmd_pause,
    cmd_reclaim,
    cmd_resume,
    cmd_scale,
    cmd_submit,
)
from spotrain.workers.cli.pools import (
    POOL_LIMITS,
    cmd_pool_create,
    cmd_pool_list,
    cmd_pool_set,
    cmd_pool_status,
)
from spotrain.workers.cli.support import OK, USAGE, CliError, err, rpc_error
from spotrain.workers.cli.views import cmd_list, cmd_report, cmd_status
from spotrain.workers.connect import TASK_QUEUE
from spotrain.workflows.job.state import Phase
from spotrain.workflows.policies import budget
from spotrain.workflows.spec import MAX_DURATION_S

PHASES = [p.value for p in Phase]
Command = Callable[[argparse.Namespace], Awaitable[int]]
DELEGATED = {
    "dev": (
        "spotrain.workers.embedded.stack",
        "run the local stack: Temporal, moto, worker, webhook",
    ),
    "demo": (
        "spotrain.workers.embedded.demo",
        "a real elastic training run with reclaims, end to end",
    ),
    "worker": ("spotrain.workers.worker", "run the Temporal worker"),
    "webhook": ("spotrain.workers.webhook.server", "run the reclaim webhook service"),
}
CONNECTION = (
    "Temporal connection: TEMPORAL_ADDRESS (default localhost:7233), TEMPORAL_NAMESPACE, "
    "TEMPORAL_API_KEY, TLS settings and TEMPORAL_PROFILE, as for the temporal CLI.\n"
    "Exit codes: 0 ok, 1 failed or rejected, 2 bad usage or invalid input, "
    "3 Temporal unreachable."
)


def team_budget(text: str) -> tuple[str, float]:
    team, _, value = text.partition("=")
    try:
        return team, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TEAM=USD_PER_HOUR, got {text!r}") from None


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def seconds(text: str) -> float:
    """A finite span: a negative notice deadline or an infinite wait is a mistake, not a wish."""
    value = float(text)
    if not 0 < value <= MAX_DURATION_S:  # NaN too
        raise argparse.ArgumentTypeError(
            f"must be > 0 and <= {MAX_DURATION_S:,} seconds (30 days), got {text}"
        )
    return value


def usd(text: str) -> float:
    value = float(text)
    if error := budget.set_error(value):
        raise argparse.ArgumentTypeError(error)
    return value


def runtime_option(c: argparse.ArgumentParser) -> None:
    c.add_argument(
        "--runtime",
        choices=("local", "kubernetes"),
        help="the jobs' workers' runtime (default: SPOTRAIN_RUNTIME, else local); kubernetes "
        "also covers pods, Services, ConfigMaps and Secrets labelled with the job in "
        "SPOTRAIN_K8S_NAMESPACE, as the kubeconfig's identity",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spotrain",
        description="Elastic training on spot capacity, orchestrated by Temporal.",
        epilog="examples:\n  spotrain submit job.yaml --wait\n  spotrain list --phase Running\n"
        "  spotrain status my-job --watch\n\n" + CONNECTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, func: Command, help: str, examples: str) -> argparse.ArgumentParser:
        c = sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=f"examples:\n{examples}\n\n{CONNECTION}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        c.set_defaults(func=func)
        return c

    def named(name: str, func: Command, help: str, examples: str) -> argparse.ArgumentParser:
        c = command(name, func, help, examples)
        c.add_argument("name", help="job name (= workflow id)")
        return c

    c = command(
        "submit",
        cmd_submit,
        "validate a job spec (YAML or JSON) and start it",
        "  spotrain submit job.yaml\n  spotrain submit job.json --wait --task-queue gpu",
    )
    c.add_argument("file", type=Path, help="the job spec: YAML, or JSON for a .json file")
    c.add_argument(
        "--task-queue",
        default=os.environ.get("SPOTRAIN_TASK_QUEUE", TASK_QUEUE),
        metavar="Q",
        help="the workers' task queue (default: SPOTRAIN_TASK_QUEUE, else spotrain)",
    )
    c.add_argument("--wait", action="store_true", help="show progress until the job ends")
    c.add_argument(
        "--resume",
        action="store_true",
        help="continue a job of this name that ran before, from its checkpoints",
    )
    c.add_argument("--interval", type=seconds, default=1.0, help=argparse.SUPPRESS)

    c = command(
        "list",
        cmd_list,
        "list jobs (visibility query)",
        "  spotrain list\n  spotrain list --phase Running --json",
    )
    c.add_argument("--phase", choices=PHASES, help="only jobs in this phase")
    c.add_argument("--limit", type=positive, default=100, help="at most this many jobs (100)")
    c.add_argument("--json", action="store_true", help="one JSON array, for scripts")

    c = named(
        "status",
        cmd_status,
        "a job's nodes, generation, world size, progress and cost so far",
        "  spotrain status my-job\n  spotrain status my-job --watch",
    )
    c.add_argument("--watch", action="store_true", help="refresh until the job ends")
    c.add_argument("--interval", type=seconds, default=2.0, help="seconds between refreshes")
    c.add_argument("--json", action="store_true", help="with --watch: one object per line")

    c = named(
        "scale",
        cmd_scale,
        "grow or shrink a running job",
        "  spotrain scale my-job --out 2\n  spotrain scale my-job --out 2 --timeout 600\n"
        "  spotrain scale my-job --in 1\n  spotrain scale my-job --node i-0abc i-0def",
    )
    how = c.add_mutually_exclusive_group(required=True)
    how.add_argument("--out", type=positive, metavar="N", help="add N nodes")
    c.add_argument(
        "--timeout",
        type=seconds,
        metavar="S",
        help="with --out: wait for the nodes this long; if they do not come, the target goes "
        "back (exit 1)",
    )
    how.add_argument("--in", dest="in_", type=positive, metavar="N", help="remove N nodes")
    how.add_argument("--node", nargs="+", metavar="ID", help="remove exactly these nodes")

    named("pause", cmd_pause, "checkpoint and release every node", "  spotrain pause my-job")
    named("resume", cmd_resume, "order nodes again and continue", "  spotrain resume my-job")
    c = named(
        "budget",
        cmd_budget,
        "set a job's total spend cap (a job paused at its cap resumes once it is raised)",
        "  spotrain budget my-job --usd 250\n  spotrain budget my-job --usd 400 && "
        "spotrain resume my-job",
    )
    c.add_argument("--usd", type=usd, required=True, metavar="USD", help="the new cap in USD")
    named("cancel", cmd_cancel, "stop a job and release all it owns", "  spotrain cancel my-job")

    c = named(
        "reclaim",
        cmd_reclaim,
        "simulate a spot reclaim notice through the webhook",
        "  spotrain reclaim my-job --node i-0abc\n"
        "  spotrain reclaim my-job --node i-0abc --no-notice\n\n"
        "webhook: SPOTRAIN_WEBHOOK_URL (default http://127.0.0.1:8080), SPOTRAIN_WEBHOOK_TOKEN, "
        "SPOTRAIN_WEBHOOK_HMAC_SECRET",
    )
    c.add_argument("--node", required=True, metavar="ID", help="the instance id to reclaim")
    c.add_argument("--no-notice", action="store_true", help="the node is already gone")
    c.add_argument(
        "--deadline-s",
        type=seconds,
        default=120.0,
        metavar="S",
        help="seconds until it is taken (> 0)",
    )

    c = command(
        "gc",
        cmd_gc,
        "find (and with --apply reap) instances, placement groups, local rank processes and "
        "Kubernetes pods whose job is not running",
        "  spotrain gc\n  spotrain gc --apply --region us-east-1 --region us-west-2",
    )
    c.add_argument("--apply", action="store_true", help="terminate (default: dry run)")
    c.add_argument(
        "--region",
        action="append",
        help="a region to search; repeat for more (default: boto3's, e.g. AWS_REGION)",
    )
    c.add_argument("--state-dir", type=Path, help="local runtime's (default ~/.spotrain)")
    runtime_option(c)
    c.add_argument(
        "--checkpoints",
        action="append",
        metavar="URI",
        help="a root holding jobs' stores (<URI>/<job>/...): also reap those of jobs Temporal "
        "no longer knows; repeat for more",
    )
    c.add_argument("--json", action="store_true", help="what was found, as one JSON object")

    c = named(
        "release",
        cmd_release,
        "for a STUCK job (its workflow task keeps failing): terminate it and release what it "
        "owns by its ownership tags (EC2 instances and placement groups in each region, local "
        "rank processes, or its pods and objects on Kubernetes); safe to repeat",
        "  spotrain release my-job\n  spotrain release my-job --region us-east-1 --region "
        "us-west-2 --json\n  spotrain release my-job --runtime kubernetes",
    )
    c.add_argument(
        "--force", action="store_true", help="a job that is not stuck too (no checkpoint first)"
    )
    c.add_argument("--region", action="append", help="a region to search; repeat for more")
    c.add_argument("--state-dir", type=Path, help="local runtime's (default ~/.spotrain)")
    runtime_option(c)
    c.add_argument("--json", action="store_true", help="what was released, as one JSON object")

    c = named(
        "logs",
        cmd_logs,
        "a rank's log (local runtime)",
        "  spotrain logs my-job\n  spotrain logs my-job --rank 1 --generation 3 --follow",
    )
    c.add_argument("--rank", type=int, default=0, help="whose log (default rank 0)")
    c.add_argument("--generation", type=int, default=None, help="default: the latest")
    c.add_argument("--follow", "-f", action="store_true", help="keep printing as it grows")
    c.add_argument("--state-dir", type=Path, help="default: the worker's (~/.spotrain)")

    c = named(
        "report",
        cmd_report,
        "timeline and cost of a running or finished job",
        "  spotrain report my-job\n  spotrain report my-job --plot job.png --html job.html",
    )
    c.add_argument("--plot", type=Path, metavar="FILE.png", help="draw it (needs matplotlib)")
    c.add_argument(
        "--html", type=Path, metavar="FILE", help="a self-contained page: the picture and tables"
    )
    c.add_argument("--json", action="store_true", help="the report as one JSON object")

    pool = sub.add_parser(
        "pool",
        help="capacity pools: shared quotas, priorities, queueing and budgets",
        description="A pool shares a quota of nodes, GPUs and USD/h among the jobs that name "
        "it in their spec (pool: {name: ...}): higher priority first, FIFO within a priority, "
        "lower-priority elastic jobs shrink gracefully to make room.",
        epilog="examples:\n  spotrain pool create gpus --max-nodes 16 --team-budget vision=20\n"
        "  spotrain pool status gpus\n  spotrain pool set gpus --max-nodes 24\n\n" + CONNECTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pools = pool.add_subparsers(dest="pool_command", required=True, metavar="SUBCOMMAND")

    def pool_command(name: str, func: Command, help: str) -> argparse.ArgumentParser:
        c = pools.add_parser(name, help=help, description=help, epilog=CONNECTION)
        c.set_defaults(func=func)
        return c

    def limits(c: argparse.ArgumentParser) -> None:
        c.add_argument("name", help="pool name (jobs name it in spec.pool.name)")
        for field, kind in POOL_LIMITS.items():
            c.add_argument(
                "--" + field.replace("_", "-"),
                dest=field,
                type=lambda text, kind=kind: text if text == "none" else kind(text),
                metavar="N|none",
                help="'none' lifts the limit",
            )
        c.add_argument(
            "--team-budget",
            action="append",
            type=team_budget,
            metavar="TEAM=USD_PER_HOUR",
            help="cap a team's growth (repeatable)",
        )

    c = pool_command("create", cmd_pool_create, "start a capacity pool with its limits")
    limits(c)
    c.add_argument(
        "--task-queue",
        default=os.environ.get("SPOTRAIN_TASK_QUEUE", TASK_QUEUE),
        metavar="Q",
        help="the workers' task queue (default: SPOTRAIN_TASK_QUEUE, else spotrain)",
    )
    limits(pool_command("set", cmd_pool_set, "change a pool's limits (others are kept)"))
    c = pool_command("status", cmd_pool_status, "usage against limits, and the pool's jobs")
    c.add_argument("name", help="pool name")
    c.add_argument("--json", action="store_true", help="the pool's status as one JSON object")
    c = pool_command("list", cmd_pool_list, "running capacity pools")
    c.add_argument("--json", action="store_true", help="one JSON array, for scripts")

    for name, (_, help) in DELEGATED.items():
        c = sub.add_parser(name, help=help, add_help=False)
        c.add_argument("rest", nargs=argparse.REMAINDER)
    return p


def delegate(command: str, rest: list[str]) -> int:
    """Hand the remaining arguments (`--help` too) to the command's own module, imported only
    now; its exit status is the command's."""
    try:
        importlib.import_module(DELEGATED[command][0]).main(rest)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (OK if e.code is None else USAGE)
    return OK


def run(argv: list[str]) -> int:
    if argv and argv[0] in DELEGATED:
        return delegate(argv[0], argv[1:])
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # argparse: --help (0), bad usage (2)
        return e.code if isinstance(e.code, int) else USAGE
    try:
        return asyncio.run(args.func(args))
    except CliError as e:
        err.print(f"error: {e}", markup=False, soft_wrap=True)
        return e.code
    except RPCError as e:
        error = rpc_error(e, getattr(args, "name", None))
        err.print(f"error: {error}", markup=False, soft_wrap=True)
        return error.code
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> None:
    code = run(sys.argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
