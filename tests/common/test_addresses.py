"""common/addresses.py: address literals classified, URL pieces, the interface holding an
address. Nothing is resolved over the network (literals and /etc/hosts' localhost only)."""

from __future__ import annotations

import socket

from common.addresses import check_bind_host, host_port, interface_of, is_loopback, is_wildcard


def test_loopback_and_wildcard() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "::ffff:127.0.0.1", "[::1]"))
    assert not any(is_loopback(h) for h in ("10.0.0.1", "fd00::1", "::ffff:10.0.0.1", "localhost", "0.0.0.0"))
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", ""))
    assert not is_wildcard("127.0.0.1")


def test_host_port_brackets_ipv6() -> None:
    assert host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert host_port("fd00::1", 80) == "[fd00::1]:80"


def test_literals_and_the_wildcard_pass_the_bind_check() -> None:
    for host in ("127.0.0.1", "::1", "0.0.0.0", "10.99.0.1"):
        assert check_bind_host(host, "test") == host


def test_the_interface_of_an_address() -> None:
    lo = next(name for _, name in socket.if_nameindex() if name == "lo")
    assert interface_of("127.0.0.1") == lo
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: on no interface here
    assert interface_of("fd00::1") is None and interface_of("localhost") is None
