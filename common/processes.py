"""Detached service processes tracked by pid files: start, check, stop.

Every process the stack starts (Temporal, SeaweedFS, API, worker, gateway, replicas) gets a pid
file and a log file. `rollouts down` stops what the pid files name, and nothing else: a pid file
also records the process start time so a recycled pid is never killed by mistake.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path


def freeze_heap() -> None:
    """Move this process's objects alive now out of the cyclic collector's reach (after a full
    collection), as vLLM does after start-up: a long-lived process holding an object per tensor
    (tens of thousands on an MoE) otherwise pays a full collection walking them all, and every
    module's objects, whenever a hot-load makes as many short-lived ones (~0.2-0.3 s each in a
    replica's agent at 18,867 tensors)."""
    gc.collect()
    gc.freeze()


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


def stop_pids(
    pids: Iterable[int], *, timeout: float = 15.0, group: bool = True, waiting: Callable[[], object] | None = None
) -> list[int]:
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


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone); never reaps it, so a ``Popen`` that owns it
    still reads its exit code."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's: it exists
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True  # no /proc to ask: kill(0) said it exists


def alive(pid: int) -> bool:
    """:func:`pid_alive`, after reaping ``pid`` if it is an exited child of this process."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return pid_alive(pid)


def tail(path: Path | None, lines: int = 30, max_bytes: int = 65536) -> str:
    """The last ``lines`` lines of a log (read from its last ``max_bytes``), or "(no log)"."""
    if path is None:
        return "(no log)"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


async def terminate(proc: subprocess.Popen, timeout: float, every: float = 0.2) -> int:
    """SIGTERM ``proc``, wait up to ``timeout`` for it to exit, then SIGKILL its process group (it
    leads one: :func:`spawn`, ``start_new_session``); returns its exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(every)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait)
    return proc.returncode


async def wait_serving(
    proc: subprocess.Popen | None,
    probe: Callable[[], Awaitable[bool]],
    *,
    name: str,
    url: str,
    log_path: Path | None,
    timeout: float,
    error: type[Exception],
    ready: str = "ready",
    not_yet: tuple[type[BaseException], ...] = (OSError, ValueError),
    every: float = 0.5,
) -> None:
    """Polls ``probe`` until it answers True (an exception of ``not_yet`` counts as not yet).
    Raises ``error`` with the log's tail: naming the exit code when ``proc`` exits first, or
    ``url`` when ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise error(
                f"{name} exited with code {proc.returncode} before it served (log {log_path}):\n{tail(log_path, 60)}"
            )
        try:
            if await probe():
                return
        except not_yet:
            pass
        if time.monotonic() > deadline:
            raise error(f"{name} at {url} not {ready} after {timeout:.0f}s (log {log_path}):\n{tail(log_path, 60)}")
        await asyncio.sleep(every)
