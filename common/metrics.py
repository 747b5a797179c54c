"""Prometheus metrics, served with the standard client library (`prometheus_client`).

Each process defines its own metrics at import, in the default registry, next to the code that
observes them (api/metrics.py, control/metrics.py, replica/agent/metrics.py). The API serves them
at its own `/metrics`; the control worker and each replica agent start :func:`serve` on a port of
their own. Names follow Prometheus' conventions: `rollouts_` prefix, base units, `_total`
counters. docs/design.md, "Tracing and metrics".
"""

from __future__ import annotations

from prometheus_client import start_http_server

from common.addresses import host_port

# Seconds: a pause is tens of ms to a few s; a hot-load a second to many minutes.
PAUSE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
OPERATION_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


def serve(address: str, port: int) -> str:
    """Serve the default registry at `http://ADDRESS:PORT/metrics` (port 0: any free port) from
    a daemon thread; returns the URL."""
    server, _ = start_http_server(port, addr=address)
    return f"http://{host_port(address, server.server_port)}/metrics"
