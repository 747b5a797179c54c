"""What a node offers: its GPU devices, its CPU replica slots, its /dev/shm, and its address.

GPUs are the devices CUDA finds (``torch.cuda.device_count()``, within the node agent's own
``CUDA_VISIBLE_DEVICES``) unless the operator says how many; a node without GPUs runs one replica
by default (``--slots``). The host copy of every replica's weights and the engines' staging live
in /dev/shm, so its free bytes are reported with every heartbeat.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

import torch

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class NodeConfigError(ValueError):
    """A node agent's configuration that cannot work; the message names the setting."""


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def capacity(gpus: int | None, slots: int | None) -> tuple[int, int]:
    """(GPUs, CPU slots) this node offers."""
    found = cuda_devices()
    if gpus is None:
        gpus = found
    elif gpus < 0:
        raise NodeConfigError(f"--gpus must be >= 0, got {gpus}")
    elif gpus > found:
        raise NodeConfigError(f"--gpus {gpus}: CUDA finds only {found} device(s) on this host")
    if slots is None:
        slots = 0 if gpus else 1
    elif slots < 0:
        raise NodeConfigError(f"--slots must be >= 0, got {slots}")
    if gpus == 0 and slots == 0:
        raise NodeConfigError("this node offers no capacity: no GPU found or given (--gpus) and --slots 0")
    return gpus, slots


def shm_bytes(path: str = "/dev/shm") -> tuple[int, int]:
    """(free, total) bytes of the shared-memory filesystem."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def check_name(name: str) -> str:
    if not NAME_RE.match(name or ""):
        raise NodeConfigError(
            f"node name {name!r}: use letters, digits, '.', '_' or '-' (at most 63, starting with a letter or digit)"
        )
    return name


def resolve_address(address: str, what: str = "node address") -> str:
    """The IP address `address` (an IP or a host name) stands for; a clear error naming `what`
    (the setting it came from) if it does not resolve."""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise NodeConfigError(f"{what} {address!r} does not resolve: {exc.strerror}") from None
    return str(infos[0][4][0])


def check_advertised(address: str) -> str:
    """`address` (an IP) if other hosts can reach this node at it; the wildcard is refused."""
    if ipaddress.ip_address(address).is_unspecified:
        raise NodeConfigError(
            f"node address {address!r} is the wildcard, which no other host can reach: give this host's "
            "address (--address or ROLLOUTS_NODE_ADDRESS; --engine-bind 0.0.0.0 makes engines bind every address)"
        )
    return address


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address).is_loopback
