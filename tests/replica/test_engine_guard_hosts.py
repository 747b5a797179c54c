"""The engine guard's own-host rule (replica/engine/guard.py), on the pure ASGI middleware: control
routes answer only a client on the engine's own host, even one holding the secret; inference
routes answer any client with the secret. No engine, no socket: each request is an ASGI scope
with the client and server addresses a connection would have."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.settings import ENGINE_SECRET_HEADER
from replica.engine.guard import ALLOWED_ROUTES, CONTROL_ROUTES, INFERENCE_ROUTES, NOT_LOCAL, EngineGuard

SECRET = "s3cret-for-tests"

# (client address, server address the connection arrived at)
OWN_HOST = [
    ("127.0.0.1", "127.0.0.1"),
    ("127.0.0.1", "0.0.0.0"),
    ("127.5.6.7", "127.0.0.1"),
    ("::1", "::1"),
    ("::ffff:127.0.0.1", "::"),
    ("10.40.0.2", "10.40.0.2"),
]
OTHER_HOST = [
    ("10.40.0.3", "10.40.0.2"),
    ("10.40.0.3", "0.0.0.0"),
    ("192.0.2.7", "127.0.0.1"),
    ("fd00::9", "fd00::2"),
    ("::ffff:10.40.0.3", "::"),
]


class App:
    """The engine behind the guard: records what reached it."""

    def __init__(self) -> None:
        self.reached: list[tuple[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.reached.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def request(
    guard: EngineGuard,
    method: str,
    path: str,
    client: tuple[str, int] | None,
    server: tuple[str, int] | None,
    secret: str | None = SECRET,
) -> tuple[int, dict[str, Any]]:
    headers = [] if secret is None else [(ENGINE_SECRET_HEADER.encode(), secret.encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "client": client, "server": server}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await guard(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body or b"{}")


async def answered_with_the_secret(routes: set[tuple[str, str]], client: str, server: str) -> tuple[App, EngineGuard]:
    """A guard in front of a fresh app, each of whose ``routes``, asked with the secret by
    ``client`` of ``server``, has answered 200."""
    app = App()
    guard = EngineGuard(app, SECRET)
    for method, path in sorted(routes):
        status, _ = await request(guard, method, path, (client, 40000), (server, 8000))
        assert status == 200, (client, path)
    return app, guard


def test_the_route_lists_split_into_control_and_inference() -> None:
    assert CONTROL_ROUTES | INFERENCE_ROUTES == ALLOWED_ROUTES and not CONTROL_ROUTES & INFERENCE_ROUTES
    assert CONTROL_ROUTES == {
        ("POST", f"/rollouts/{name}")
        for name in (
            "pause",
            "resume",
            "is_paused",
            "reset_prefix_cache",
            "collective_rpc",
            "update_weight_version",
            "weight_info",
            "swap_in_pause",
            "swap_hook",
        )
    }
    assert {path for _, path in INFERENCE_ROUTES} == {
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/metrics",
    }


@pytest.mark.parametrize(("client", "server"), OWN_HOST)
async def test_control_routes_answer_the_engines_own_host(client: str, server: str) -> None:
    app, _ = await answered_with_the_secret(CONTROL_ROUTES, client, server)
    assert sorted(app.reached) == sorted(CONTROL_ROUTES)


@pytest.mark.parametrize(("client", "server"), OTHER_HOST)
async def test_control_routes_refuse_another_host_even_with_the_secret(client: str, server: str) -> None:
    app = App()
    guard = EngineGuard(app, SECRET)
    for secret in (SECRET, None, "wrong"):
        for method, path in sorted(CONTROL_ROUTES):
            status, body = await request(guard, method, path, (client, 40000), (server, 8000), secret)
            assert status == 403, (client, path, secret)
            assert body["error"]["type"] == "permission_denied" and NOT_LOCAL in body["error"]["message"], body
            assert client in body["error"]["message"] and path in body["error"]["message"], body
    assert app.reached == []  # nothing reached the engine


@pytest.mark.parametrize(("client", "server"), OTHER_HOST + OWN_HOST)
async def test_inference_routes_answer_any_host_with_the_secret(client: str, server: str) -> None:
    app, guard = await answered_with_the_secret(INFERENCE_ROUTES, client, server)
    for method, path in sorted(INFERENCE_ROUTES):
        for secret in (None, "wrong"):
            status, body = await request(guard, method, path, (client, 40000), (server, 8000), secret)
            assert status == 401 and body["error"]["type"] == "unauthenticated", (client, path, secret)
    assert sorted(app.reached) == sorted(INFERENCE_ROUTES)


async def test_a_connection_without_a_client_address_gets_no_control() -> None:
    app = App()
    guard = EngineGuard(app, SECRET)
    status, body = await request(guard, "POST", "/rollouts/pause", None, None)
    assert status == 403 and NOT_LOCAL in body["error"]["message"]
    status, _ = await request(guard, "GET", "/v1/models", None, None)
    assert status == 200
    assert app.reached == [("GET", "/v1/models")]


async def test_health_answers_anyone() -> None:
    app = App()
    status, _ = await request(EngineGuard(app, SECRET), "GET", "/health", ("10.40.0.3", 1), ("10.40.0.2", 2), None)
    assert status == 200 and app.reached == [("GET", "/health")]
