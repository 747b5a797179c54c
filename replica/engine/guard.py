"""The gate in front of every replica engine's HTTP routes: who may call which route.

:class:`EngineGuard` (pure ASGI, the outermost middleware of ``replica/engine/server.py``) lets
a request through only when: a control route (:data:`CONTROL_ROUTES`) comes from the engine's own
host (:func:`is_local_client`; else 403); it carries the engine's secret in
``x-rollouts-engine-secret`` (constant-time compare; else 401); and its method and path are in
:data:`ALLOWED_ROUTES` (the agent's control routes and :data:`INFERENCE_ROUTES`; anything else,
vLLM's own dev and weight routes included, 403). ``GET /health`` (:data:`OPEN_ROUTES`) answers
anyone; WebSockets are closed. Refusals use vLLM's error shape. The secret is read once from
the file named by ``ROLLOUTS_ENGINE_SECRET_FILE`` (:func:`read_secret_file` refuses a file
group or others can read); it is never on a command line. docs/design.md, "Security".
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from common import envs
from common.settings import ENGINE_SECRET_HEADER
from replica.engine_routes import ENGINE_ROUTES, VLLM_PREFIX

OPEN_ROUTES: frozenset[tuple[str, str]] = frozenset({("GET", "/health")})

# Inference (the gateway, from any host) and what serves it.
INFERENCE_ROUTES: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/metrics"),
    }
)

# Control (the replica agent on the engine's own host: replica/agent/engine_rpc.py).
CONTROL_ROUTES: frozenset[tuple[str, str]] = frozenset(("POST", VLLM_PREFIX + name) for name in ENGINE_ROUTES)

ALLOWED_ROUTES: frozenset[tuple[str, str]] = INFERENCE_ROUTES | CONTROL_ROUTES

NOT_LOCAL = "engine control answers only its own host's replica agent"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def _ip(host: object) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(str(host).split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def is_local_client(scope: Scope) -> bool:
    """Whether the connection of ``scope`` comes from the engine's own host: the client's
    address is loopback, or equals the address the connection arrived at (module docstring).
    No client address (a Unix socket, a test scope without one) is not local."""
    client, server = scope.get("client"), scope.get("server")
    ip = _ip(client[0]) if client else None
    if ip is None:
        return False
    if ip.is_loopback:
        return True
    return bool(server and _ip(server[0]) == ip)


class EngineSecretError(RuntimeError):
    """The engine's secret is missing or stored unsafely; the engine must not start."""


def read_secret_file(
    path: str | os.PathLike[str] | None = None, var: envs.Var[str | None] = envs.ROLLOUTS_ENGINE_SECRET_FILE
) -> str:
    """The secret in ``path`` (default: the file the environment variable ``var`` names, the
    engine's secret unless told otherwise), stripped.

    Raises EngineSecretError when no file is named, it cannot be read, it is empty, or group or
    others may read it."""
    env = var.name
    if path is None:
        path = var.get()
    if not path:
        raise EngineSecretError(f"{env} is not set: a rollouts engine needs this secret")
    path = Path(path)
    try:
        mode = path.stat().st_mode
        secret = path.read_text().strip()
    except OSError as exc:
        raise EngineSecretError(f"{env}={path}: cannot read the secret: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise EngineSecretError(f"{env}={path}: mode {stat.S_IMODE(mode):o} lets others read it (use 0600)")
    if not secret:
        raise EngineSecretError(f"{env}={path}: the file is empty")
    return secret


class EngineGuard:
    """ASGI middleware: the client's host for control routes, the secret, the route list (module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        secret: str,
        allowed: frozenset[tuple[str, str]] = ALLOWED_ROUTES,
        open_routes: frozenset[tuple[str, str]] = OPEN_ROUTES,
        local_only: frozenset[tuple[str, str]] = CONTROL_ROUTES,
    ) -> None:
        if not secret:
            raise EngineSecretError("EngineGuard needs a non-empty secret")
        self.app = app
        self._secret = secret.encode()
        self.allowed = allowed
        self.open_routes = open_routes
        self.local_only = local_only
        self._header = ENGINE_SECRET_HEADER.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        if kind != "http":
            await send({"type": "websocket.close", "code": 1008, "reason": "not served by rollouts engines"})
            return
        route = (scope["method"].upper(), scope["path"])
        if route in self.open_routes:
            await self.app(scope, receive, send)
            return
        if route in self.local_only and not is_local_client(scope):
            client = scope.get("client")
            await _refuse(
                send,
                403,
                "permission_denied",
                f"{route[0]} {route[1]} from {client[0] if client else 'an unknown client'}: {NOT_LOCAL}",
            )
            return
        given = next((v for k, v in scope.get("headers") or () if k.lower() == self._header), None)
        if given is None:
            await _refuse(
                send,
                401,
                "unauthenticated",
                f"missing {ENGINE_SECRET_HEADER} header: this engine answers only its replica agent and the gateway",
            )
            return
        if not hmac.compare_digest(given, self._secret):
            await _refuse(
                send,
                401,
                "unauthenticated",
                f"wrong {ENGINE_SECRET_HEADER}: this engine answers only its replica agent and the gateway",
            )
            return
        if route not in self.allowed:
            await _refuse(send, 403, "permission_denied", f"{route[0]} {route[1]} is off on rollouts engines")
            return
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
