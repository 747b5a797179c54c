"""Separate hosts on one machine for multi-host tests: network namespaces on a bridge, each with its
own mount namespace.

``with Cluster(3) as cluster:`` (needs root; ``unavailable_reason()`` says why not otherwise)

- sweeps the leftovers of dead earlier runs (runs.py), then makes one bridge in the root namespace
  with ``cluster.gateway`` = ``.254`` of a /24 in 10.0.0.0/8 that no interface or route of this
  machine uses (``cluster.network``);
- per host K = 1..N (``cluster[K - 1]``): a network namespace with ``lo`` up and ``eth0`` at
  ``10.X.0.K/24`` (a veth whose root end is on the bridge; no default route), and a holder process
  (``ip netns exec NS unshare -m --propagation private``) owning the host's mount namespace: a
  private tmpfs of ``shm_bytes`` at ``/dev/shm`` (default 2 GiB), and ``/run/netns`` unmounted (no
  host holds a reference to another's namespace). Every process of the host enters the holder's network and mount
  namespaces (``nsenter -t HOLDER -m -n``), so they share its ``/dev/shm`` and address;
- on exit, always (an exception or KeyboardInterrupt included): kills every process in each
  namespace, deletes veths, namespaces and the bridge, and raises ``LeftoverError`` if any of its
  names is still listed by ``ip netns list`` / ``ip link``. A failure while entering tears down
  what was made before re-raising.

The root namespace is on the bridge too: the test process reaches ``host.address`` directly.

``Host``: ``name`` (``host1``...), ``address``, ``netns``, ``veth`` (root end), ``home`` and ``logs``
(directories on the machine's file system, under the cluster's ``base_dir``; ``home`` is ``$HOME``
of the host's processes), ``shm`` (its ``/dev/shm`` seen from the root namespace), ``spawn`` (a
detached process group logging to a file; env merged onto ``os.environ`` without another
stack's variables, ``common.settings.without_stack_env``: a host is another machine, where the
runner's sourced ``stack.env`` is not), ``run`` (a short command,
output captured), ``pids``, ``kill_all`` (kill -9 every process in the namespace, holder included:
a host death, its ``/dev/shm`` gone), ``boot`` (a fresh holder after a death: an empty ``/dev/shm``),
``link_down`` / ``link_up`` (the root-end veth: a partition from every other host and the root).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from common.settings import without_stack_env
from tests.multihost.iproute import (
    IprouteError,
    ip,
    ipv4_networks_in_use,
    kill_netns_processes,
    link_names,
    netns_names,
    netns_pids,
)
from tests.multihost.runs import MAX_HOSTS, RunTag, begin_run, end_run, state_lock, sweep_dead_runs

DEFAULT_SHM_BYTES = 2 * 1024**3
REQUIRED_TOOLS = ("ip", "unshare", "nsenter", "mount", "umount", "sh", "sleep")
BOOT_TIMEOUT = 10.0  # seconds for a holder to mount its /dev/shm; a guard, not a measurement
HOLDER_SCRIPT = (
    "mount -t tmpfs -o size=$1,mode=1777 tmpfs /dev/shm"
    # /run/netns mounts copied into this namespace would keep other hosts' namespaces alive after
    # their deletion; this host has no business with them anyway.
    " && { umount -l /run/netns 2>/dev/null; true; }"
    " && exec sleep infinity"
)


def unavailable_reason() -> str | None:
    """Why this machine cannot make hosts (not root, a tool missing); None if it can."""
    if os.geteuid() != 0:
        return f"multi-host tests need root for network and mount namespaces (running as uid {os.geteuid()})"
    missing = [tool for tool in REQUIRED_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"multi-host tests need {', '.join(missing)} on PATH"
    return None


class HostError(RuntimeError):
    """A host could not boot, is down, or a command in it failed; the message names the host."""


class LeftoverError(RuntimeError):
    """Teardown left namespaces or links of the cluster behind; the message names them."""


def choose_network(in_use: Sequence[ipaddress.IPv4Network]) -> ipaddress.IPv4Network:
    """The first 10.X.0.0/24 (X from 200 up, then below) overlapping no network in use."""
    for x in [*range(200, 255), *range(1, 200)]:
        candidate = ipaddress.IPv4Network(f"10.{x}.0.0/24")
        if not any(candidate.overlaps(used) for used in in_use):
            return candidate
    raise RuntimeError("no free 10.X.0.0/24 for the multi-host bridge: every one overlaps an interface or route")


class Host:
    def __init__(
        self, name: str, address: ipaddress.IPv4Interface, netns: str, veth: str, root: Path, shm_bytes: int
    ) -> None:
        self.name = name
        self.interface = address
        self.address = str(address.ip)
        self.netns = netns
        self.veth = veth
        self.home = root / "home"
        self.logs = root / "logs"
        self.shm_bytes = shm_bytes
        self.holder: subprocess.Popen | None = None
        self.spawned: list[subprocess.Popen] = []
        self._log_count = 0

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address}, netns={self.netns})"

    # --- lifecycle -------------------------------------------------------------------------
    def boot(self) -> None:
        """Start the holder (a fresh mount namespace, empty /dev/shm); returns once /dev/shm is mounted."""
        if self.alive:
            raise HostError(f"{self.name} is already up (holder pid {self.holder_pid})")
        self.home.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / "holder.log"
        with open(log, "ab") as out:
            self.holder = subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.netns,
                    "unshare",
                    "-m",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    HOLDER_SCRIPT,
                    "holder",
                    str(self.shm_bytes),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + BOOT_TIMEOUT
        cmdline = Path(f"/proc/{self.holder.pid}/cmdline")
        while True:
            if self.holder.poll() is not None:
                raise HostError(
                    f"{self.name}: holder exited with {self.holder.returncode} before mounting "
                    f"/dev/shm: {log.read_text().strip()!r}"
                )
            try:
                if cmdline.read_bytes().startswith(b"sleep\0infinity"):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise HostError(
                    f"{self.name}: holder (pid {self.holder.pid}) did not mount /dev/shm within "
                    f"{BOOT_TIMEOUT} s; see {log}"
                )
            time.sleep(0.005)

    @property
    def alive(self) -> bool:
        return self.holder is not None and self.holder.poll() is None

    @property
    def holder_pid(self) -> int:
        if not self.alive:
            raise HostError(f"{self.name} is down (no holder process): boot() it first")
        assert self.holder is not None
        return self.holder.pid

    @property
    def shm(self) -> Path:
        """This host's /dev/shm as the root namespace sees it (through the holder's /proc root)."""
        return Path(f"/proc/{self.holder_pid}/root/dev/shm")

    def pids(self) -> list[int]:
        """Pids of every live process in this host's network namespace, holder included."""
        return netns_pids(self.netns)

    def kill_all(self, timeout: float = 10.0) -> list[int]:
        """A host death: SIGKILL every process in the namespace (holder included); the pids killed.
        The processes this object started are reaped; /dev/shm goes with the holder."""
        killed = kill_netns_processes(self.netns, timeout=timeout)
        for proc in [*self.spawned, *([self.holder] if self.holder else [])]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)  # in the namespace but not listed (still exiting)
            proc.wait(timeout=timeout)
        self.spawned.clear()
        return killed

    # --- network -----------------------------------------------------------------------------
    def link_down(self) -> None:
        """Partition: this host's link to the bridge goes down (its root-end veth)."""
        ip("link", "set", self.veth, "down")

    def link_up(self) -> None:
        """Heal the partition."""
        ip("link", "set", self.veth, "up")

    # --- processes ---------------------------------------------------------------------------
    def _argv(self, argv: Sequence[str], cwd: Path | str | None) -> list[str]:
        if not argv:
            raise HostError(f"{self.name}: empty command")
        return ["nsenter", "-t", str(self.holder_pid), "-m", "-n", f"--wd={cwd or self.home}", "--", *map(str, argv)]

    def _env(self, env: Mapping[str, str] | None) -> dict[str, str]:
        return {**without_stack_env(os.environ), "HOME": str(self.home), **(env or {})}

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log_path: Path | str | None = None,
        cwd: Path | str | None = None,
    ) -> subprocess.Popen:
        """Start ``argv`` in this host, in a new session (its own process group), stdout and stderr
        appended to ``log_path`` (default: ``logs/<program>-<n>.log``). nsenter execs the program, so
        the Popen's pid is the program's."""
        if log_path is None:
            self._log_count += 1
            log_path = self.logs / f"{Path(str(argv[0])).name}-{self._log_count}.log"
        argv = self._argv(argv, cwd)
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                argv,
                env=self._env(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.spawned.append(proc)
        return proc

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess:
        """Run a short command in this host; stdout and stderr captured as text. With ``check``, a
        non-zero exit raises HostError naming the host, the command and its output."""
        proc = subprocess.run(
            self._argv(argv, cwd),
            env=self._env(env),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise HostError(
                f"{self.name}: {list(argv)} exited with {proc.returncode}: "
                f"stdout {proc.stdout.strip()!r}, stderr {proc.stderr.strip()!r}"
            )
        return proc


class Cluster:
    def __init__(self, count: int = 3, shm_bytes: int = DEFAULT_SHM_BYTES, base_dir: Path | str | None = None) -> None:
        if not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"count: a cluster has 1 to {MAX_HOSTS} hosts, not {count}")
        if shm_bytes <= 0:
            raise ValueError(f"shm_bytes: must be positive, not {shm_bytes}")
        self.count = count
        self.shm_bytes = shm_bytes
        self._given_base = Path(base_dir) if base_dir is not None else None
        self.base_dir: Path | None = None
        self.tag: RunTag | None = None
        self.network: ipaddress.IPv4Network | None = None
        self.gateway = ""
        self.bridge = ""
        self.hosts: list[Host] = []

    def __enter__(self) -> Cluster:
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def names(self) -> list[str]:
        """Every namespace and link name this cluster creates."""
        if self.tag is None:
            return []
        return [self.tag.bridge, *(h.veth for h in self.hosts), *(h.netns for h in self.hosts)]

    def _up(self) -> None:
        if reason := unavailable_reason():
            raise HostError(reason)
        if self._given_base is not None:
            self._given_base.mkdir(parents=True, exist_ok=True)
            self.base_dir = self._given_base
        with state_lock():
            sweep_dead_runs()
            self.tag = tag = begin_run()
            if self.base_dir is None:
                self.base_dir = Path(tempfile.mkdtemp(prefix=f"rollouts-multihost-{tag.text}-"))
            self.network = choose_network(ipv4_networks_in_use())
            self.bridge = tag.bridge
            self.gateway = str(self.network[254])
            self.hosts = [
                Host(
                    f"host{k}",
                    ipaddress.IPv4Interface(f"{self.network[k]}/{self.network.prefixlen}"),
                    tag.netns(k),
                    tag.veth(k),
                    self.base_dir / f"host{k}",
                    self.shm_bytes,
                )
                for k in range(1, self.count + 1)
            ]
            ip("link", "add", self.bridge, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/{self.network.prefixlen}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                ip("netns", "add", host.netns)
                ip("-n", host.netns, "link", "set", "lo", "up")
                ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                ip("link", "set", host.veth, "master", self.bridge)
                ip("link", "set", host.veth, "up")
                ip("-n", host.netns, "addr", "add", str(host.interface), "dev", "eth0")
                ip("-n", host.netns, "link", "set", "eth0", "up")
        for host in self.hosts:
            host.boot()

    def close(self) -> None:
        """Tear everything down (idempotent); LeftoverError if a name survives."""
        if self.tag is None:
            return
        tag, errors = self.tag, []
        present = set(netns_names())
        for host in self.hosts:
            if host.netns in present:
                try:
                    host.kill_all()
                except (IprouteError, subprocess.TimeoutExpired) as exc:
                    errors.append(f"{host.name}: {exc}")
        for host in self.hosts:
            ip("link", "delete", host.veth, check=False)
            ip("netns", "delete", host.netns, check=False)
        ip("link", "delete", self.bridge or tag.bridge, check=False)
        left = [name for name in [*netns_names(), *link_names()] if tag.owns(name)]
        end_run(tag)
        self.tag = None
        if self._given_base is None and self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)
        if left or errors:
            raise LeftoverError(
                f"multi-host cluster {tag.text} teardown left {left or 'no names'}"
                + (f"; errors: {'; '.join(errors)}" if errors else "")
            )
