"""Hosts with links of their own on one machine: each a Linux network namespace joined to a
bridge by a veth pair, its sending capped by a token bucket (`tc ... tbf`). What loopback cannot
show, since it has no wire: a transfer bound by each node's link (a NIC, or a cloud's cap on
one flow, 5 Gbit/s on EC2 outside a placement group), such as a hand-over striped over several
survivors against one. Needs root and iproute2; everything made is removed on the way out."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

IFNAME = "eth0"  # the host's end of its link, inside its namespace


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    @property
    def env(self) -> dict[str, str]:
        """gloo binds where the host's name resolves unless told: to its link instead."""
        return {"GLOO_SOCKET_IFNAME": IFNAME}


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextmanager
def shaped_hosts(n: int, gbit: float) -> Iterator[list[Host]]:
    """`n` hosts on one bridge, each sending at most `gbit` Gbit/s (receiving uncapped)."""
    tag = os.getpid() % 100_000
    subnet = f"10.231.{tag % 250}"
    bridge = f"spbr{tag}"
    with ExitStack() as made:
        _ip("link", "add", bridge, "type", "bridge")
        made.callback(_ip, "link", "del", bridge)
        _ip("link", "set", bridge, "up")
        hosts = []
        for i in range(n):
            ns, veth = f"spotrain-{tag}-h{i}", f"sp{tag}v{i}"
            _ip("netns", "add", ns)
            made.callback(_ip, "netns", "del", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            # both ends at once: a namespace's own devices outlive its name for a moment
            made.callback(_ip, "link", "del", veth)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            # burst: at least one timer tick's worth at the rate, for the rate to be reached
            shape = ["root", "tbf", "rate", f"{gbit}gbit", "burst", "4mb", "latency", "200ms"]
            _ip("netns", "exec", ns, "tc", "qdisc", "add", "dev", IFNAME, *shape)
            hosts.append(Host(ns, f"{subnet}.{i + 1}"))
        yield hosts
