"""The API's Prometheus metrics, served at `GET /metrics` on the API's own port (no token, like
`/healthz`).

Requests and their seconds by method, route template (one series per endpoint, not per id) and
status; errors by the body's `code`; hot-load creates answered; reads of an open hot-load by
id (api/open_reads.py) by `answer` (`described` or `kept`). How hot-loads end is counted by the
control worker (control/metrics.py), pauses and bytes by each replica agent.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

REQUESTS = Counter("rollouts_api_requests", "API requests", ("method", "route", "status"))
REQUEST_SECONDS = Histogram(
    "rollouts_api_request_seconds", "API request duration", ("method", "route"), buckets=REQUEST_BUCKETS
)
ERRORS = Counter("rollouts_api_errors", "API error answers, by code", ("code",))
HOT_LOADS_CREATED = Counter("rollouts_hot_loads_created", "Hot-loads admitted by the API")
OPEN_READS = Counter("rollouts_api_open_hot_load_reads", "Reads of an open hot-load by id, by answer", ("answer",))


def observe(method: str, route: str, status: int, seconds: float) -> None:
    REQUESTS.labels(method=method, route=route, status=str(status)).inc()
    REQUEST_SECONDS.labels(method=method, route=route).observe(seconds)


def exposition() -> tuple[bytes, str]:
    """The text exposition of every metric of this process, and its content type."""
    return generate_latest(), CONTENT_TYPE_LATEST
