"""iproute2 as the multi-host harness uses it (root only).

- ``ip(...)`` runs ``ip`` and returns its stdout; a non-zero exit raises ``IprouteError`` naming the
  command line and its stderr.
- ``netns_names()`` / ``link_names()``: the names ``ip netns list`` / ``ip -o link show`` print (a
  link's ``@peer`` suffix removed).
- ``netns_pids(netns)``: the pids whose network namespace is ``netns`` (``ip netns pids``; exited
  processes not yet reaped are not listed).
- ``kill_netns_processes(netns)``: SIGKILL every such pid until none is left (a process forking while
  it is killed is killed in the next round); ``IprouteError`` naming the survivors after ``timeout``.
- ``ipv4_networks_in_use()``: every IPv4 network on an interface or in a route of the root
  namespace (any table; the default route excluded), to pick a free one for the bridge.

Nothing here decides what to create or remove: that is hosts.py and runs.py.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import time

# Route types `ip route` prints before the destination (ip-route(8)).
ROUTE_TYPES = frozenset(
    {"unicast", "local", "broadcast", "multicast", "throw", "unreachable", "prohibit", "blackhole", "nat", "anycast"}
)


class IprouteError(RuntimeError):
    """An `ip` command failed, or processes survived in a namespace; the message names which."""


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS`; its stdout. With ``check``, a non-zero exit raises IprouteError."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise IprouteError(f"`ip {' '.join(args)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def netns_names() -> list[str]:
    """Named network namespaces (`ip netns list` prints `NAME` or `NAME (id: N)`)."""
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def link_names() -> list[str]:
    """Links of the root namespace (`ip -o link show`: `N: NAME[@PEER]: <FLAGS> ...`)."""
    names = []
    for line in ip("-o", "link", "show").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            names.append(parts[1].strip().split("@", 1)[0])
    return names


def netns_pids(netns: str) -> list[int]:
    """Pids of the live processes in the network namespace ``netns``."""
    return [int(token) for token in ip("netns", "pids", netns).split()]


def kill_netns_processes(netns: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in ``netns`` until none is left; the pids killed. IprouteError on survivors."""
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while pids := netns_pids(netns):
        if time.monotonic() > deadline:
            raise IprouteError(f"processes still in network namespace {netns} after {timeout} s of SIGKILL: {pids}")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    return killed


def ipv4_networks_in_use() -> list[ipaddress.IPv4Network]:
    """IPv4 networks on the root namespace's interfaces and in its routes (all tables), default excluded."""
    networks = []
    for line in ip("-o", "-4", "addr", "show").splitlines():
        tokens = line.split()
        if "inet" in tokens:
            networks.append(ipaddress.IPv4Interface(tokens[tokens.index("inet") + 1]).network)
    for line in ip("-4", "route", "show", "table", "all").splitlines():
        tokens = line.split()
        if tokens and tokens[0] in ROUTE_TYPES:
            tokens = tokens[1:]
        if not tokens or tokens[0] == "default":
            continue
        networks.append(ipaddress.IPv4Network(tokens[0], strict=False))
    return networks
