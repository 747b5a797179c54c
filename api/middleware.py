"""The API's HTTP middleware besides authentication (api/auth.py): `limit_body` answers
payload_too_large for a declared body over `MAX_BODY_BYTES`, and `server_span(tracer)` opens each
request's server span and counts and times it (api/metrics.py), both by the route's template."""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from opentelemetry.trace import SpanKind

from api import metrics as api_metrics
from contracts.errors import PayloadTooLarge

MAX_BODY_BYTES = 1 << 20


async def limit_body(request: Request, call_next):
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
        err = PayloadTooLarge(f"request body larger than {MAX_BODY_BYTES} bytes")
        return JSONResponse(err.body(), status_code=err.http_status)
    return await call_next(request)


def server_span(tracer: Any):
    """The outermost span of a trace: Temporal calls made while serving carry it on (the client's
    TracingInterceptor), so a hot-load's workflow and activity spans join the request's trace.
    Named, counted and timed by the route template: one series per endpoint, not per id."""

    async def span(request: Request, call_next):
        route = "unmatched"
        for r in request.app.router.routes:
            if getattr(r, "path_regex", None) is not None and r.path_regex.match(request.url.path):
                route = r.path
                break
        start = time.perf_counter()
        with tracer.start_as_current_span(
            f"{request.method} {route}",
            kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.url.path},
        ) as s:
            response = await call_next(request)
            s.set_attribute("http.response.status_code", response.status_code)
        api_metrics.observe(request.method, route, response.status_code, time.perf_counter() - start)
        return response

    return span
