"""The OpenAI-compatible gateway in front of the deployments' replicas: this module only wires it.

It holds the lifespan (the proxy's HTTP clients; with ``refresh``, the routing refresh and the
load report), authentication (``Authorization: Bearer``; inference needs ``admin``, a ``viewer``
may list models), ``GET /v1/models``, ``/healthz``, and the inference routes
``POST /v1/chat/completions`` and ``POST /v1/completions`` (``gateway/proxy.py``; a dynamo
deployment's path: ``gateway/dynamo_proxy.py``). Invariants: every ``contracts.errors.ApiError``
is answered by ``gateway.errors.error_response``; any other exception of an inference route is
logged and answered 500 ``internal``, so the client's connection is never dropped. The contract
(routing, retries, caps, ``nvext`` and its weight-version spans) is docs/design.md "The gateway".
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from common.settings import Settings
from contracts.errors import ApiError, Internal
from contracts.tokens import Principal, TokenStore
from gateway.errors import error_response
from gateway.listing import model_list
from gateway.load import LoadMeter, report_loop, temporal_signal
from gateway.proxy import Proxy
from gateway.routing import Router, refresh_loop

log = logging.getLogger("rollouts.gateway")


def authorize(tokens: TokenStore, request: Request, action: str | None = None) -> Principal:
    """The caller; with ``action``, one that may run it (admin). Raises ``Unauthenticated`` or
    ``PermissionDenied``."""
    principal = tokens.authenticate(request.headers.get("authorization"))
    if action is not None:
        principal.require_admin(action)
    return principal


def create_gateway_app(settings: Settings, *, refresh: bool = True, router: Router | None = None) -> FastAPI:
    """The gateway app; ``refresh=False`` with a prepared ``router`` serves a fixed table (tests).
    The router serves the deployments that list ``settings.gateway_id`` unless it names a gateway."""
    tokens = TokenStore(settings.tokens_file)
    router = router or Router()
    meter = LoadMeter()
    if router.gateway_id is None:
        router.gateway_id = settings.gateway_id
    proxy = Proxy(settings, router, meter)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        proxy.open()
        tasks = (
            [
                asyncio.create_task(refresh_loop(router, settings)),
                asyncio.create_task(report_loop(router, meter, temporal_signal(settings))),
            ]
            if refresh
            else []
        )
        yield
        for task in tasks:
            task.cancel()
        await proxy.aclose()

    app = FastAPI(title="rollouts gateway", lifespan=lifespan)
    app.state.router = router
    app.state.load = meter

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "models": [v.model_name for v in router.models()]}

    @app.get("/v1/models")
    async def models(request: Request):
        principal = authorize(tokens, request)
        return model_list(router.models(principal.organization_id))

    async def guarded(request: Request, path: str):
        # An exception escaping a handler makes the server drop the client's connection: answer it.
        try:
            principal = authorize(tokens, request, "running inference")
            return await proxy.serve(request, path, principal.organization_id)
        except ApiError:
            raise  # the gateway's own refusal: answered by api_error
        except Exception:  # noqa: BLE001 - logged; the client gets a 500 in the usual shape
            log.exception("request to %s failed", path)
            raise Internal("internal error in the gateway; see its log") from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await guarded(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await guarded(request, "/v1/completions")

    return app
