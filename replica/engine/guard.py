"""The gate in front of every replica engine's HTTP routes: a per-replica secret and a short
list of routes.

A replica's vLLM server listens on loopback, where any local process can reach it. Its dev-mode
routes pause the engine, relabel its weights or call any worker method, and its OpenAI routes
answer without the gateway's organization checks. :class:`EngineGuard` (pure ASGI, installed by
``replica/engine/server.py`` as the outermost middleware of every engine) lets a request through
only when

1. it carries the engine's secret in the ``x-rollouts-engine-secret`` header (compared in
   constant time): missing -> 401 ``unauthenticated``, wrong -> 401 ``unauthenticated``; and
2. its method and path are one of :data:`ALLOWED_ROUTES`: what the replica agent
   (``replica/agent/engine_rpc.py``) and the gateway use, plus ``/metrics``. Anything else -> 403
   ``permission_denied``, with the secret or without it, e.g. ``/sleep``, ``/wake_up``,
   ``/weight_checker`` (its ``reset`` action re-initialises the weights), ``/update_weights``
   and the other weight-transfer routes, ``/abort_requests``, ``/tokenize``, ``/v1/responses``.

``GET /health`` (:data:`OPEN_ROUTES`) answers without the secret: a liveness probe that says
nothing but "up". WebSocket connections are closed (no engine route needs one).

Refusals are JSON in vLLM's error shape: ``{"error": {"message", "type", "code"}}``.

Who holds the secret: the engine reads it at start from the file named by
``ROLLOUTS_ENGINE_SECRET_FILE`` (:func:`read_secret_file`: the file must not be readable by group
or others; it is never on a command line); ``replica.agent.engine.EngineProcess`` writes that file and
sends the header; the stack derives each replica's secret from its settings
(``common.settings.Settings.engine_secret``), so the agent and the gateway agree on it.
"""

from __future__ import annotations

import hmac
import json
import os
import stat
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

from common.settings import ENGINE_SECRET_HEADER
from replica.launch import SECRET_FILE_ENV

OPEN_ROUTES: frozenset[tuple[str, str]] = frozenset({("GET", "/health")})

ALLOWED_ROUTES: frozenset[tuple[str, str]] = frozenset({
    # inference (the gateway) and what serves it
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/metrics"),
    # control (the replica agent: replica/agent/engine_rpc.py)
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/collective_rpc"),
    ("POST", "/update_weight_version"),
    ("GET", "/weight_info"),
})

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class EngineSecretError(RuntimeError):
    """The engine's secret is missing or stored unsafely; the engine must not start."""


def read_secret_file(path: str | os.PathLike[str] | None = None) -> str:
    """The secret in ``path`` (default: ``$ROLLOUTS_ENGINE_SECRET_FILE``), stripped.

    Raises EngineSecretError when no file is named, it cannot be read, it is empty, or group or
    others may read it."""
    if path is None:
        path = os.environ.get(SECRET_FILE_ENV)
    if not path:
        raise EngineSecretError(f"{SECRET_FILE_ENV} is not set: a rollouts engine needs its secret")
    path = Path(path)
    try:
        mode = path.stat().st_mode
        secret = path.read_text().strip()
    except OSError as exc:
        raise EngineSecretError(f"{SECRET_FILE_ENV}={path}: cannot read the engine secret: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise EngineSecretError(f"{SECRET_FILE_ENV}={path}: mode {stat.S_IMODE(mode):o} lets others read it (use 0600)")
    if not secret:
        raise EngineSecretError(f"{SECRET_FILE_ENV}={path}: the file is empty")
    return secret


class EngineGuard:
    """ASGI middleware: the secret and the route list (module docstring)."""

    def __init__(self, app: ASGIApp, secret: str,
                 allowed: frozenset[tuple[str, str]] = ALLOWED_ROUTES,
                 open_routes: frozenset[tuple[str, str]] = OPEN_ROUTES) -> None:
        if not secret:
            raise EngineSecretError("EngineGuard needs a non-empty secret")
        self.app = app
        self._secret = secret.encode()
        self.allowed = allowed
        self.open_routes = open_routes
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
        given = next((v for k, v in scope.get("headers") or () if k.lower() == self._header), None)
        if given is None:
            await _refuse(send, 401, "unauthenticated", f"missing {ENGINE_SECRET_HEADER} header: this engine "
                          "answers only its replica agent and the gateway")
            return
        if not hmac.compare_digest(given, self._secret):
            await _refuse(send, 401, "unauthenticated", f"wrong {ENGINE_SECRET_HEADER}: this engine answers "
                          "only its replica agent and the gateway")
            return
        if route not in self.allowed:
            await _refuse(send, 403, "permission_denied", f"{route[0]} {route[1]} is off on rollouts engines")
            return
        await self.app(scope, receive, send)


async def _refuse(send: Send, status: int, kind: str, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
