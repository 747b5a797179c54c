"""Addresses a rollouts process binds and advertises: checks and URL pieces, no traffic.

- :func:`check_bind_host` is called where a process is about to bind a configured address (the
  embedded stack's services, ``rollouts api`` / ``gateway``, a replica's engine): a host that
  does not resolve (``socket.getaddrinfo``, nothing is sent to it) is an :class:`AddressError`
  naming it and the setting it came from.
- :func:`host_port` joins a host and a port for a URL or a ``host:port`` address (IPv6 in
  brackets).
- :func:`is_loopback` and :func:`is_wildcard` classify an address literal (a name is neither).
- :func:`interface_of` names the local network interface that holds an IPv4 address (Linux
  ``SIOCGIFADDR``), or None: what ``NCCL_SOCKET_IFNAME`` takes for a node address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct

WILDCARDS = frozenset({"0.0.0.0", "::", ""})
_SIOCGIFADDR = 0x8915


class AddressError(ValueError):
    """A configured address cannot be used (it does not resolve)."""


def check_bind_host(host: str, what: str) -> str:
    """``host`` if it resolves, else AddressError naming it and ``what`` (the setting or flag it
    came from, e.g. ``"ROLLOUTS_HOST (rollouts api)"``). The wildcard passes as it is."""
    if host in WILDCARDS:
        return host
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise AddressError(
            f"{what}: host {host!r} does not resolve ({exc}); use an address of this machine "
            "(an IP literal, or a name that resolves to one)"
        ) from None
    return host


def host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 literal in brackets (``[::1]:80``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """True for an address literal in 127.0.0.0/8 or ::1 (IPv4-mapped included); False for a name."""
    ip = _literal(host)
    if ip is None:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def is_wildcard(host: str) -> bool:
    """True for the any-address (``0.0.0.0``, ``::``) or an empty host."""
    return host in WILDCARDS


def interface_of(address: str) -> str | None:
    """The name of the local interface whose IPv4 address is ``address``; None when no interface
    holds it, or ``address`` is not an IPv4 literal."""
    ip = _literal(address)
    if not isinstance(ip, ipaddress.IPv4Address):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            if socket.inet_ntoa(reply[20:24]) == str(ip):
                return name
    return None
