"""The stack's Dynamo certificates (``common/dynamo_tls.py``): made once, private to the user, and
a server set up as Dynamo's are (its certificate, client certificates of the stack's CA
required) admits the stack's client certificate and nothing else. Plain ``ssl`` on loopback."""

from __future__ import annotations

import socket
import ssl
import stat
import threading

import pytest

from common import dynamo_tls


def test_made_once_private_and_complete(tmp_path):
    d = tmp_path / "tls"
    tls = dynamo_tls.ensure(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in dynamo_tls.FILES:
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
    before = (d / "ca.pem").read_bytes()
    assert dynamo_tls.ensure(d) == tls and (d / "ca.pem").read_bytes() == before  # not made again
    assert dynamo_tls.load(tmp_path / "none") is None
    (d / "client.key").unlink()
    with pytest.raises(ValueError, match="lacks client.key"):
        dynamo_tls.load(d)


def _serve_once(server_ctx: ssl.SSLContext) -> tuple[int, dict]:
    listener = socket.create_server(("127.0.0.1", 0))
    port, out = listener.getsockname()[1], {}

    def run() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True) as tls:
                out["peer"] = tls.getpeercert()
                tls.sendall(b"ok")
        except (ssl.SSLError, OSError) as exc:
            out["error"] = exc
        finally:
            listener.close()

    threading.Thread(target=run, daemon=True).start()
    return port, out


def _reply(port: int, ctx: ssl.SSLContext) -> bytes:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=dynamo_tls.SERVER_NAME) as tls,
    ):
        return tls.recv(2)


def test_only_the_stacks_client_certificate_is_admitted(tmp_path):
    tls = dynamo_tls.ensure(tmp_path / "tls")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tls.path("server.pem"), tls.path("server.key"))
    server.load_verify_locations(tls.path("ca.pem"))
    server.verify_mode = ssl.CERT_REQUIRED  # as Dynamo's --tls-client-ca-cert-path does

    port, out = _serve_once(server)
    assert _reply(port, tls.ssl_context()) == b"ok"
    assert out["peer"]  # the client presented its certificate

    no_cert = ssl.create_default_context(cafile=tls.path("ca.pem"))
    no_cert.check_hostname = False
    stranger = dynamo_tls.ensure(tmp_path / "other").ssl_context()  # another stack's certificate
    stranger.load_verify_locations(tls.path("ca.pem"))
    for ctx in (no_cert, stranger):
        port, out = _serve_once(server)
        with pytest.raises((ssl.SSLError, OSError)):
            assert _reply(port, ctx) == b"ok"
