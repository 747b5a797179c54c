"""The API and the gateway keep an idle client connection open longer than clients keep theirs
(workers/commands KEEP_ALIVE_S): a connection that served a request and then sat idle 6 s (past
uvicorn's default of 5 s and httpx's own pool expiry) is still open, and serves the next
request. With the default, the server closed it at 5 s, and a pooled request sent at that moment
met a reset."""

from __future__ import annotations

import socket
import time

import pytest

pytestmark = pytest.mark.stack

IDLE_S = 6.0


def _get(sock: socket.socket, host: str) -> bytes:
    sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("service", ["api", "gateway"])
def test_an_idle_connection_outlives_the_clients_pool_expiry(stack, service: str) -> None:
    host, port = stack.host, stack.ports[service]
    with socket.create_connection((host, port), timeout=30) as sock:
        assert _get(sock, host).startswith(b"HTTP/1.1 200"), service
        time.sleep(IDLE_S)
        sock.setblocking(False)
        try:
            closed = sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            closed = False  # nothing to read: still open
        sock.setblocking(True)
        assert not closed, f"the {service} closed an idle connection within {IDLE_S:.0f} s"
        assert _get(sock, host).startswith(b"HTTP/1.1 200"), service
