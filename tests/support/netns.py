"""Network partitions for tests: processes in their own network namespaces, cut from the broker and healed.

:class:`Network` puts a broker address on this host (a /32 on ``lo``, in 10.213.0.0/16, a /24 picked at random
among those no interface uses) and makes namespaces that reach it over a veth pair each. A namespace's
:meth:`Namespace.cut` sets the host end of its pair down: packets stop both ways, yet the TCP connections of the
processes inside stay open (nothing resets them), so what they had written arrives after :meth:`Namespace.heal` -
a real partition, not a crash. The kernel here has no ``netem``; latency and blackholes are the TCP fault proxy's
(:mod:`tests.support.fault_proxy`). Everything created is removed on exit, and only that.

Needs root and ``ip netns``; :func:`netns_unavailable` says why not, for a skip.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass, field
from types import TracebackType

IP_TIMEOUT_S = 10.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=check)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be used here (for ``pytest.skip``), or None."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"bl-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` refused: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Namespace:
    """One network namespace, its veth pair, and its link to the broker address."""

    name: str
    host_dev: str
    address: str  # the namespace's own address
    cuts: int = 0

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a process inside the namespace."""
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> None:
        _ip("link", "set", self.host_dev, "down")
        self.cuts += 1

    def heal(self) -> None:
        _ip("link", "set", self.host_dev, "up")


@dataclass
class Network:
    """The broker address and the namespaces made for one test; a context manager that removes them all."""

    subnet: int = field(default_factory=lambda: _free_subnet())
    namespaces: list[Namespace] = field(default_factory=list)
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}{random.randrange(100):02d}")

    @property
    def broker_host(self) -> str:
        return f"10.213.{self.subnet}.1"

    def __enter__(self) -> Network:
        _ip("addr", "add", f"{self.broker_host}/32", "dev", "lo")
        return self

    def namespace(self) -> Namespace:
        """A new namespace whose default route reaches the broker address over its own veth pair."""
        k = len(self.namespaces)
        if k >= 60:
            raise RuntimeError("at most 60 namespaces per network")
        name, host_dev, ns_dev = f"bl{self.tag}n{k}", f"bl{self.tag}h{k}", f"bl{self.tag}i{k}"
        host_ip, ns_ip = f"10.213.{self.subnet}.{4 * k + 5}", f"10.213.{self.subnet}.{4 * k + 6}"
        ns = Namespace(name, host_dev, ns_ip)
        self.namespaces.append(ns)  # removed on exit even if what follows fails
        _ip("netns", "add", name)
        _ip("link", "add", host_dev, "type", "veth", "peer", "name", ns_dev)
        _ip("link", "set", ns_dev, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_dev)
        _ip("link", "set", host_dev, "up")
        for args in (
            ["addr", "add", f"{ns_ip}/30", "dev", ns_dev],
            ["link", "set", ns_dev, "up"],
            ["link", "set", "lo", "up"],
            ["route", "add", "default", "via", host_ip],
        ):
            _ip("netns", "exec", name, "ip", *args)
        return ns

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        for ns in self.namespaces:
            _ip("link", "del", ns.host_dev, check=False)  # deletes its peer too
            _ip("netns", "del", ns.name, check=False)
        _ip("addr", "del", f"{self.broker_host}/32", "dev", "lo", check=False)


def _free_subnet() -> int:
    """A /24 of 10.213.0.0/16 that no interface of this host uses (other tests may hold some)."""
    used = _ip("-4", "addr", "show").stdout
    free = [n for n in range(100, 250) if f"10.213.{n}." not in used]
    if not free:
        raise RuntimeError("no free 10.213.x.0/24 subnet")
    return random.choice(free)
