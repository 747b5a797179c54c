"""The API's Prometheus metrics, served at `GET /metrics` on the API's own port (no token, like
`/healthz`).

- `rollouts_api_requests_total{method, route, status}` (counter) and
  `rollouts_api_request_seconds{method, route}` (histogram): every request, by the route's
  template (`/v1alpha1/inference/hotLoads/{hot_load_id}`, one series per endpoint, not per id).
- `rollouts_api_errors_total{code}` (counter): requests answered with an error, by the error
  body's `code` (`invalid_argument`, `failed_precondition`, `already_exists`, `unavailable`, ...).
- `rollouts_hot_loads_created_total` (counter): hot-load creates the API answered with the
  operation (a create repeated with the same id counts again).
- `rollouts_api_open_hot_load_reads_total{answer}` (counter): reads of an open hot-load by id
  (api/open_reads.py), `answer="described"` (its describe, waited for) or `"kept"` (that
  describe was late: the previous describe's answer).

How hot-loads end (durations, outcomes, replica failures) is counted where they run: the control
worker's endpoint (control/metrics.py); pauses and bytes per replica on each replica agent's
(replica/agent/metrics.py).
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
