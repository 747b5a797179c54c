"""The gRPC ports of a stack's SeaweedFS, chosen so that no other SeaweedFS on the machine shares them.

`weed mini` serves each gRPC service on a port and on a Unix socket whose path depends on the
port alone (``/tmp/seaweedfs-<service>-grpc-<port>.sock``), so two stacks with the same ports
would share sockets (docs/operations.md). Invariants: each chosen port binds on the stack's
address and no live SeaweedFS answers on its socket path; the choice is made and held under a
machine-wide lock in ``/tmp`` until this stack's sockets answer, so two stacks starting at once
never choose the same port; the ports are recorded in the stack's home and kept while free.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from common.processes import free_port

SERVICES = ("s3", "master", "volume", "filer", "admin")
SOCKET_DIR = Path("/tmp")  # fixed by the weed binary, not configurable
LOCK_PATH = SOCKET_DIR / "rollouts-seaweedfs-grpc.lock"
MAX_TRIES = 200


def socket_path(service: str, port: int) -> Path:
    """Where weed serves `service`'s gRPC on a Unix socket for `port` (its binary's rule)."""
    return SOCKET_DIR / f"seaweedfs-{service}-grpc-{port}.sock"


def socket_live(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket at `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _binds(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_free(service: str, port: int, host: str) -> bool:
    """`port` binds on `host` and no SeaweedFS serves its socket path."""
    return _binds(host, port) and not socket_live(socket_path(service, port))


def choose(host: str, recorded: dict[str, int]) -> dict[str, int]:
    """Per service, its recorded port if still free, else a fresh free one (the kernel's pick)."""
    chosen: dict[str, int] = {}
    for service in SERVICES:
        port = recorded.get(service)
        tries = 0
        while port is None or port in chosen.values() or not port_free(service, port, host):
            tries += 1
            if tries > MAX_TRIES:
                raise RuntimeError(f"no free gRPC port for SeaweedFS's {service} on {host} after {MAX_TRIES} tries")
            port = free_port(host)
        chosen[service] = port
    return chosen


def load(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: int(v) for k, v in data.items() if k in SERVICES and isinstance(v, int)}


def save(path: Path, ports: dict[str, int]) -> None:
    path.write_text(json.dumps(ports, indent=2) + "\n")


def all_live(ports: dict[str, int]) -> bool:
    return all(socket_live(socket_path(service, port)) for service, port in ports.items())


@contextlib.contextmanager
def machine_lock(timeout_s: float = 300.0) -> Iterator[None]:
    """Held by one stack at a time on this machine while it chooses ports and starts SeaweedFS."""
    # Read-only: a lock file created by another user (root, say) is still ours to lock.
    fd = os.open(LOCK_PATH, os.O_RDONLY | os.O_CREAT, 0o666)
    with os.fdopen(fd) as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another stack held {LOCK_PATH} for {timeout_s:.0f} s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def flags(ports: dict[str, int]) -> list[str]:
    """`weed mini`'s flags for these ports."""
    return [f"-{service}.port.grpc={port}" for service, port in ports.items()]
