"""Detached service processes tracked by pid files: start, check, stop.

Every process the stack starts (Temporal, SeaweedFS, API, worker, gateway, replicas) gets a pid
file and a log file. `rollouts down` stops what the pid files name, and nothing else: a pid file
also records the process start time so a recycled pid is never killed by mistake.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


def _proc_start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (starttime), counted after the parenthesised command name.
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass
class PidFile:
    path: Path

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def write(self, pid: int, **extra: object) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"pid": pid, "start": _proc_start_time(pid), **extra}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(self.path)

    def alive_pid(self) -> int | None:
        """The recorded pid if that very process still runs (not a zombie, not a recycled pid)."""
        data = self.read()
        if not data:
            return None
        pid = int(data["pid"])
        start = _proc_start_time(pid)
        if start is None or (data.get("start") and start != data["start"]):
            return None
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return None
        return None if state == "Z" else pid

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``host:port`` (``host``: an address of this
    machine, IPv4 or IPv6)."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (an address of this machine, or the wildcard ``0.0.0.0`` /
    ``::``): the kernel's pick for a bind to port 0."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_below(limit: int, host: str = "127.0.0.1", low: int = 20000) -> int:
    """A port in ``[low, limit]`` free on ``host`` now, for a server that cannot take the kernel's
    picks (Dynamo reads ``DYN_SYSTEM_PORT`` as a signed 16-bit number: at most 32767)."""
    for port in random.sample(range(low, limit + 1), 200):
        with socket.socket(_family(host), socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {low}..{limit} on {host}")


def spawn(
    argv: list[str],
    *,
    log_path: Path,
    pid_file: PidFile,
    env: dict[str, str] | None = None,
    base_env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    **extra: object,
) -> int:
    """Start `argv` in its own session (it outlives the caller), output appended to `log_path`;
    its environment is `env` laid over `base_env` (default this process's)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**(os.environ if base_env is None else base_env), **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
    pid_file.write(proc.pid, argv=argv[:3], **extra)
    return proc.pid


def stop_pid(pid: int, *, timeout: float = 15.0, group: bool = True) -> bool:
    """SIGTERM the process (and its process group), wait, then SIGKILL. True if it was running."""
    return bool(stop_pids([pid], timeout=timeout, group=group))


def stop_pids(pids: Iterable[int], *, timeout: float = 15.0, group: bool = True,
              waiting: Callable[[], object] | None = None) -> list[int]:
    """:func:`stop_pid` for several processes at once: SIGTERM to each (and its process group),
    one wait of up to ``timeout`` for all of them (``waiting`` is called on each round), then
    SIGKILL to those still running. Returns the pids that were running. Stopped together, a
    deployment's replicas take as long as the slowest of them, not the sum."""

    def _send(pid: int, sig: int) -> None:
        try:
            if group:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            os.kill(pid, sig)

    running = [pid for pid in dict.fromkeys(pids) if _proc_start_time(pid) is not None]
    for pid in running:
        _send(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    left = list(running)
    while left and time.monotonic() < deadline:
        if waiting is not None:
            waiting()
        time.sleep(0.1)
        left = [pid for pid in left if alive(pid)]
    for pid in left:
        _send(pid, signal.SIGKILL)
    for _ in range(50):
        if not any(alive(pid) for pid in left):
            break
        time.sleep(0.1)
    return running


def alive(pid: int) -> bool:
    try:
        # Reap it if it is our child; otherwise this raises ChildProcessError.
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
