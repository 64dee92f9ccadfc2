"""The Temporal servers the scale benchmark runs on: the dev server, or a production-shaped
one, started and stopped in one place (`temporal_server`).

The production-shaped server is `temporal-server` built from its Go module
(`infra/k8s/controlplane/build.sh temporal`, cached under ~/.cache/spotrain/temporal; not in
CI) on PostgreSQL from Debian's packages (`apt-get install postgresql`): its own cluster in a
temporary directory on loopback ports, the `temporal` and `temporal_visibility` databases set
up by `temporal-sql-tool` (SQL visibility, no Elasticsearch), the `default` namespace created
and spotrain's search attributes registered with the `temporal` CLI as docs/cli.md tells
operators to. Every process started is stopped on the way out, however it is left, and dies
with this process if it is killed outright (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from spotrain.workers.embedded.binaries import temporal_cli
from spotrain.workers.embedded.stack import port_block

from .common import REPO, dev_server, stop

BUILD = REPO / "infra/k8s/controlplane/build.sh"
SERVERS = ("dev", "postgres")
PR_SET_PDEATHSIG = 1
SHARDS = 4  # as the server's config/development-postgres12.yaml
# The attributes docs/cli.md tells operators to register, once per namespace. Its commands
# name several attributes of one type at once; CLI 1.9.1 registers only one of them (on this
# server and on the dev server alike), so each is registered on its own here.
SEARCH_ATTRIBUTES = {
    "Keyword": ["SpotrainJob", "SpotrainPhase"],
    "Int": ["SpotrainWorldSize", "SpotrainSpotNodes", "SpotrainOnDemandNodes"],
    "KeywordList": ["SpotrainNodeIds"],
    "Double": ["SpotrainCost"],
}
# port_block offsets: frontend gRPC/HTTP/membership, then each service's gRPC and membership
PORTS = ("frontend", "frontend_http", "frontend_ring", "history", "history_ring")
PORTS += ("matching", "matching_ring", "worker", "worker_ring", "postgres")


class ServerMissing(RuntimeError):
    """The production-shaped server cannot start here: its binaries are not built, or
    PostgreSQL is not installed."""


@dataclass
class RunningServer:
    """A started server: a client on its `default` namespace, and its processes' pids now
    (PostgreSQL's backends come and go), for their CPU."""

    client: Client
    pids: Callable[[], list[int]]


def temporal_binaries() -> Path:
    """build.sh's cache directory of temporal-server, temporal-sql-tool and the schema."""
    env = os.environ | {"SPOTRAIN_K8S_CHECK_ONLY": "1"}
    done = subprocess.run(
        ["bash", str(BUILD), "temporal"], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode:
        raise ServerMissing(f"{done.stderr.strip()} (about 7 min on 2 cores)")
    return Path(done.stdout.strip())


def postgres_binaries() -> Path:
    """The newest Debian PostgreSQL's bin directory."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3])
    )
    if not found:
        raise ServerMissing("PostgreSQL is not installed: apt-get install -y postgresql")
    return found[-1].parent


def _die_with_parent() -> None:
    """In the child: SIGINT when the driver dies (PostgreSQL's fast shutdown; the Temporal
    server stops on it too), so a killed benchmark leaves nothing behind."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGINT)


@dataclass
class Processes:
    """Processes started in order, stopped in reverse: SIGINT, then SIGKILL after 30 s."""

    work: Path
    user: str | None = "postgres" if os.geteuid() == 0 else None  # PostgreSQL refuses root
    started: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    def start(self, name: str, command: list[str], as_user: bool = False) -> None:
        log = (self.work / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            command,
            cwd=self.work,
            stdout=log,
            stderr=subprocess.STDOUT,
            user=self.user if as_user else None,
            preexec_fn=_die_with_parent,  # the child runs no threads
        )
        log.close()
        self.started.append((name, proc))

    def check(self) -> None:
        for name, proc in self.started:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 15) -> str:
        text = (self.work / f"{name}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def pids(self) -> list[int]:
        """The started processes and their children (PostgreSQL's backends)."""
        roots = {proc.pid for _, proc in self.started if proc.poll() is None}
        return sorted(roots | set(children(roots)))

    def stop(self) -> None:
        for _, proc in reversed(self.started):  # (the server before its database)
            stop([proc], signal.SIGINT)


def children(parents: set[int]) -> list[int]:
    """The live processes whose parent is one of `parents`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) in parents:
                found.append(int(stat.parent.name))
    return found


def dev_server_pids() -> list[int]:
    """This process's `temporal server start-dev` child."""
    mine = children({os.getpid()})
    return [p for p in mine if b"start-dev" in Path(f"/proc/{p}/cmdline").read_bytes()]


def run(command: list[str], what: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{what} failed ({done.returncode}): {done.stderr or done.stdout}")
    return done.stdout


def config(ports: dict[str, int], dynamic_config: Path) -> dict[str, object]:
    """The server's configuration: PostgreSQL for history and visibility, every service in
    one process on loopback."""

    def store(database: str, conns: int) -> dict[str, object]:
        sql = {
            "pluginName": "postgres12",
            "databaseName": database,
            "connectAddr": f"127.0.0.1:{ports['postgres']}",
            "connectProtocol": "tcp",
            "user": "temporal",
            "password": "",
            "maxConns": conns,
            "maxIdleConns": conns,
            "maxConnLifetime": "1h",
        }
        return {"sql": sql}

    def service(name: str) -> dict[str, object]:
        rpc = {"grpcPort": ports[name], "membershipPort": ports[f"{name}_ring"]}
        if name == "frontend":
            rpc["httpPort"] = ports["frontend_http"]
        return {"rpc": rpc | {"bindOnLocalHost": True}}

    return {
        "log": {"stdout": True, "level": "warn"},
        "persistence": {
            "defaultStore": "default",
            "visibilityStore": "visibility",
            "numHistoryShards": SHARDS,
            "datastores": {
                "default": store("temporal", 20),
                "visibility": store("temporal_visibility", 10),
            },
        },
        "global": {"membership": {"maxJoinDuration": "30s", "broadcastAddress": "127.0.0.1"}},
        "services": {s: service(s) for s in ("frontend", "history", "matching", "worker")},
        "clusterMetadata": {
            "enableGlobalNamespace": False,
            "failoverVersionIncrement": 10,
            "masterClusterName": "active",
            "currentClusterName": "active",
            "clusterInformation": {
                "active": {
                    "enabled": True,
                    "initialFailoverVersion": 1,
                    "rpcName": "frontend",
                    "rpcAddress": f"127.0.0.1:{ports['frontend']}",
                }
            },
        },
        "dcRedirectionPolicy": {"policy": "noop"},
        "dynamicConfigClient": {"filepath": str(dynamic_config), "pollInterval": "10s"},
    }


def start_postgres(procs: Processes, port: int) -> None:
    """A fresh PostgreSQL cluster in the work directory, superuser `temporal`, trusted on
    loopback only; returns once it accepts connections."""
    pg = postgres_binaries()
    data = procs.work / "pgdata"
    data.mkdir(mode=0o700)
    if procs.user:
        shutil.chown(procs.work, procs.user)
        shutil.chown(data, procs.user)
    init = ["initdb", "-D", str(data), "-U", "temporal", "--auth=trust", "-E", "UTF8"]
    subprocess.run(
        [str(pg / init[0]), *init[1:]],
        cwd=procs.work,
        user=procs.user,
        capture_output=True,
        check=True,
    )
    settings = {"listen_addresses": "127.0.0.1", "port": port, "max_connections": 100}
    settings |= {"unix_socket_directories": str(procs.work)}
    args = [a for k, v in settings.items() for a in ("-c", f"{k}={v}")]
    procs.start("postgres", [str(pg / "postgres"), "-D", str(data), *args], as_user=True)
    ready = [str(pg / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(port)]
    deadline = time.monotonic() + 60
    while subprocess.run(ready, check=False).returncode:
        procs.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"PostgreSQL not ready in 60 s:\n{procs.tail('postgres')}")
        time.sleep(0.2)


def setup_schema(tools: Path, port: int) -> None:
    """Both databases, created and brought to the server's schema version by its sql tool."""
    sql = [str(tools / "temporal-sql-tool"), "--pl", "postgres12", "--ep", "127.0.0.1"]
    sql += ["-p", str(port), "-u", "temporal"]
    for database, schema in (("temporal", "temporal"), ("temporal_visibility", "visibility")):
        versioned = tools / "schema/postgresql/v12" / schema / "versioned"
        for step in (["create-database"], ["setup-schema", "-v", "0.0"]):
            run([*sql, "--db", database, *step], f"temporal-sql-tool {step[0]} {database}")
        run([*sql, "--db", database, "update-schema", "-d", str(versioned)], "update-schema")


async def register(address: str, procs: Processes) -> None:
    """The `default` namespace, then spotrain's search attributes with `temporal operator
    search-attribute create` as docs/cli.md has it (one name a command: see
    SEARCH_ATTRIBUTES); retried while the server is still joining its ring."""
    cli = [temporal_cli(), "operator", "--address", address]
    steps = [["namespace", "create", "--namespace", "default", "--retention", "1d"]]
    for kind, names in SEARCH_ATTRIBUTES.items():
        steps += [["search-attribute", "create", "--name", n, "--type", kind] for n in names]
    deadline = time.monotonic() + 120
    for step in steps:
        while True:
            done = await asyncio.to_thread(
                subprocess.run, [*cli, *step], capture_output=True, text=True, check=False
            )
            if done.returncode == 0:
                break
            procs.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"`temporal operator {' '.join(step)}`: {done.stderr}")
            await asyncio.sleep(1)


async def usable(client: Client, procs: Processes) -> None:
    """Until the new namespace answers a visibility query on every attribute registered."""
    value = {"Keyword": '"x"', "KeywordList": '"x"', "Int": "0", "Double": "0"}
    terms = [f"{n} = {value[kind]}" for kind, names in SEARCH_ATTRIBUTES.items() for n in names]
    deadline = time.monotonic() + 120
    while True:
        try:
            await client.count_workflows(" OR ".join(terms))
            return
        except Exception as err:  # the namespace not cached yet
            procs.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the default namespace never answered: {err}") from None
            await asyncio.sleep(1)


@contextlib.contextmanager
def _work_dir() -> Iterator[Path]:
    """As root, PostgreSQL runs as `postgres`, who must reach its data directory: in /tmp,
    not under a TMPDIR that only root may enter (the test suite's is such)."""
    where = "/tmp" if os.geteuid() == 0 else None
    work = Path(tempfile.mkdtemp(prefix="spotrain-temporal-", dir=where))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@asynccontextmanager
async def postgres_server(dynamic_config: dict[str, int]) -> AsyncIterator[RunningServer]:
    """temporal-server on a fresh PostgreSQL (see the module's docstring)."""
    tools = temporal_binaries()
    postgres_binaries()  # fail before starting anything
    with ExitStack() as stack:
        work = stack.enter_context(_work_dir())
        base = stack.enter_context(port_block(len(PORTS)))
        ports = {name: base + i for i, name in enumerate(PORTS)}
        procs = Processes(work)
        stack.callback(procs.stop)
        await asyncio.to_thread(start_postgres, procs, ports["postgres"])
        await asyncio.to_thread(setup_schema, tools, ports["postgres"])
        dynamic = {k: [{"value": v, "constraints": {}}] for k, v in dynamic_config.items()}
        dynamic["system.forceSearchAttributesCacheRefreshOnRead"] = [{"value": True}]
        (work / "dynamic.yaml").write_text(yaml.safe_dump(dynamic))
        (work / "config.yaml").write_text(yaml.safe_dump(config(ports, work / "dynamic.yaml")))
        server = [str(tools / "temporal-server"), "--config-file", str(work / "config.yaml")]
        procs.start("temporal-server", [*server, "--allow-no-auth", "start"])
        address = f"127.0.0.1:{ports['frontend']}"
        await register(address, procs)
        client = await Client.connect(address, data_converter=pydantic_data_converter)
        await usable(client, procs)
        yield RunningServer(client, procs.pids)


@asynccontextmanager
async def temporal_server(
    kind: str, dynamic_config: dict[str, int]
) -> AsyncIterator[RunningServer]:
    """`dev` (`temporal server start-dev`, SQLite in memory) or `postgres` (above), with
    `dynamic_config` (e.g. limit.historyCount.suggestContinueAsNew) set."""
    if kind == "postgres":
        async with postgres_server(dynamic_config) as running:
            yield running
        return
    settings = [f"{k}={v}" for k, v in dynamic_config.items()]
    async with dev_server(*settings) as env:
        yield RunningServer(env.client, dev_server_pids)
