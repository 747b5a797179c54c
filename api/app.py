"""The REST API, `/v1alpha1/inference`: gateways, deployments and hot-loads, as the guide states.

`create_app` wires the `ApiContext` (api/context.py), a lifespan that connects Temporal and
serves the resources (api/resources.py), the middleware (outermost first: span and metrics,
authentication, body cap), the error handlers and one router per resource (api/routes/).
Invariants: every request under `PREFIX` is authenticated before anything else is looked at;
ids are per organization and another organization's resource answers not_found; every error is
`{"code", "message", "details"}` with its code's HTTP status, never a traceback (validation:
invalid_argument naming the field; Temporal unreachable: unavailable; else internal); an unknown
engine in `ROLLOUTS_HOT_LOAD_ENGINES` stops the app at creation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from temporalio.service import RPCError

from api import metrics as api_metrics
from api.auth import PREFIX, authenticate
from api.context import ApiContext
from api.middleware import limit_body, server_span
from api.resources import Resources
from api.routes import deployments, gateways, hot_loads, service
from common.settings import HOT_LOAD_ENGINES_ENV, Settings
from common.settings import temporal_client as connect_temporal
from common.telemetry import setup_tracing, temporal_interceptors
from common.telemetry import tracer as telemetry_tracer
from contracts import names
from contracts.errors import ApiError, InvalidArgument, Unavailable, code_for_status
from contracts.tokens import TokenStore

log = logging.getLogger("rollouts.api")


def allowed_hot_load_engines(settings: Settings) -> tuple[str, ...]:
    """The engines whose deployments may hot-load: `settings.hot_load_engines`, by default the
    guide's rule (dynamo-vllm alone); SystemExit naming any that is not an engine."""
    engines = settings.hot_load_engines
    if engines is None:
        engines = (names.HOT_LOAD_ENGINE,)
    unknown = [e for e in engines if e not in names.ENGINES]
    if unknown:
        raise SystemExit(f"{HOT_LOAD_ENGINES_ENV}: {', '.join(unknown)} is not an engine ({', '.join(names.ENGINES)})")
    return engines


def hot_load_view(settings: Settings) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A hot-load's wire object as answered: with `status.workflowUrl`, its workflow in the Temporal UI."""

    def view(hot_load: dict[str, Any]) -> dict[str, Any]:
        spec = hot_load["spec"]
        workflow_id = quote(names.hot_load_workflow_id(spec["organizationId"], spec["id"]), safe="")
        hot_load["status"]["workflowUrl"] = (
            f"{settings.temporal_ui_url}/namespaces/{settings.temporal_namespace}/workflows/{workflow_id}"
        )
        return hot_load

    return view


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    api_metrics.ERRORS.labels(code=exc.code).inc()
    return JSONResponse(exc.body(), status_code=exc.http_status)


def _field_path(loc: tuple[Any, ...]) -> str:
    # The first element says where (body, query, path parameter); a field may itself be "path".
    parts = [str(p) for p in (loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)]
    return ".".join(parts) or "body"


async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    problems = []
    for err in exc.errors():
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif err.get("type") == "missing":
            msg = "required field is missing"
        problems.append(f"{_field_path(tuple(err.get('loc', ())))}: {msg}")
    err = InvalidArgument("; ".join(problems[:10]) or "invalid request")
    return JSONResponse(err.body(), status_code=400)


async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = code_for_status(exc.status_code)
    return JSONResponse({"code": code, "message": str(exc.detail), "details": []}, status_code=exc.status_code)


async def _temporal_down(_: Request, exc: RPCError) -> JSONResponse:
    # Temporal unreachable or overloaded: retryable for the client (cwtrain retries 503).
    log.warning("Temporal call failed: %s", exc)
    err = Unavailable(f"Temporal is unavailable: {exc.message}")
    return JSONResponse(err.body(), status_code=err.http_status)


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error")
    return JSONResponse(
        {"code": "internal", "message": "internal error; see the API log", "details": []}, status_code=500
    )


EXCEPTION_HANDLERS: dict[Any, Callable[..., Any]] = {
    ApiError: _api_error,
    RequestValidationError: _validation,
    StarletteHTTPException: _http,
    RPCError: _temporal_down,
    Exception: _internal,
}


def create_app(
    settings: Settings,
    *,
    temporal_client: Any = None,
    task_queue: str = names.CONTROL_TASK_QUEUE,
    cancel_wait_s: float = 10.0,
    tracer: Any = None,
) -> FastAPI:
    tokens = TokenStore(settings.tokens_file)
    hot_load_engines = allowed_hot_load_engines(settings)
    request_tracer = tracer or telemetry_tracer("rollouts.api")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = temporal_client
        if client is None:
            setup_tracing("rollouts-api")
            client = await connect_temporal(settings, interceptors=temporal_interceptors(request_tracer))
        app.state.resources = resources = Resources(
            client, task_queue=task_queue, hot_load_view=hot_load_view(settings)
        )
        try:
            yield
        finally:
            await resources.open_reads.close()
            await resources.hot_loads.close()

    app = FastAPI(title="rollouts", version="v1alpha1", lifespan=lifespan, exception_handlers=EXCEPTION_HANDLERS)
    app.state.cancel_wait_s = cancel_wait_s
    app.state.context = ApiContext(
        settings=settings, tokens=tokens, hot_load_engines=hot_load_engines, app_state=app.state
    )
    # The last added runs first: the request's span, then who asks and may they write, before
    # the body is looked at.
    app.middleware("http")(limit_body)
    app.middleware("http")(authenticate)
    app.middleware("http")(server_span(request_tracer))
    app.include_router(service.router)
    for resource in (gateways, deployments, hot_loads):
        app.include_router(resource.router, prefix=PREFIX)
    return app
