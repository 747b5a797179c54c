"""OpenTelemetry for rollouts processes: one trace per hot-load, from the API request through the
deployment's Update, the hot-load workflow and its activities.

The API opens a server span per request (api/middleware.py); Temporal clients and workers created with
`temporal_interceptors()` carry the span context in Temporal headers (temporalio's
`TracingInterceptor`), so the workflow and activity spans join the request's trace. A worker
built from such a client inherits the interceptor.

Spans leave the process over OTLP when `OTEL_EXPORTER_OTLP_ENDPOINT` (or the traces-specific
variable) is set: `OTEL_EXPORTER_OTLP_PROTOCOL=grpc` uses gRPC, anything else HTTP/protobuf.
Without it, nothing is exported and tracing costs next to nothing.
"""

from __future__ import annotations

import os
from typing import Any

from opentelemetry import trace

_configured = False


def otlp_configured() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service_name: str) -> None:
    """Install a global tracer provider exporting over OTLP, once, if an endpoint is configured."""
    global _configured
    if _configured or not otlp_configured():
        return
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415 - the OTLP SDK and exporter load only when an endpoint is configured
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415 - the OTLP SDK and exporter load only when an endpoint is configured
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415 - the OTLP SDK and exporter load only when an endpoint is configured

    if os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").startswith("grpc"):
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415 - the OTLP SDK and exporter load only when an endpoint is configured
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[assignment]  # noqa: PLC0415 - the OTLP SDK and exporter load only when an endpoint is configured
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _configured = True


def tracer(name: str = "rollouts") -> trace.Tracer:
    return trace.get_tracer(name)


def temporal_interceptors(tr: trace.Tracer | None = None) -> list[Any]:
    """Interceptors for `Client.connect(..., interceptors=...)` (workers inherit them)."""
    from temporalio.contrib.opentelemetry import TracingInterceptor  # noqa: PLC0415 - Temporal loads only in the processes that connect to it

    return [TracingInterceptor(tr)]
