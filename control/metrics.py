"""The control worker's Prometheus metrics (common/metrics.py serves them on the worker's port):
how hot-loads end.

- `rollouts_hot_load_duration_seconds{outcome}` (histogram): from the workflow's start to its
  end, by outcome (`COMPLETED`, `FAILED`, `CANCELED`).
- `rollouts_hot_loads_ended_total{outcome, reason}` (counter): hot-loads that ended, with the failure's
  reason (`ReplicaFailed`, `ReplicaLost`, `NoReplicas`, ...; `""` when none).
- `rollouts_hot_load_replica_failures_total{reason}` (counter): replicas a hot-load left in
  ERROR, by the first words of their error (what kind of failure).
- `rollouts_autoscaling_steps_total{direction, outcome}` (counter): autoscaling steps of the
  deployments (control/autoscaler.py): `out` `joined` or `failed`, `in` `removed`.

The workflows record each event once, when they first run it: a replay of their
history (a worker restart, a cache eviction) records nothing (`workflow.unsafe.is_replaying`).
The final workflow task may still run twice if its worker dies before it completes, so the
counts are at least, never at most, what happened.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from common.metrics import OPERATION_BUCKETS

DURATION = Histogram("rollouts_hot_load_duration_seconds", "Hot-load duration, by outcome", ("outcome",),
                     buckets=OPERATION_BUCKETS)
ENDED = Counter("rollouts_hot_loads_ended", "Hot-loads that ended, by outcome and reason", ("outcome", "reason"))
AUTOSCALING_STEPS = Counter("rollouts_autoscaling_steps", "Autoscaling steps, by direction and outcome",
                            ("direction", "outcome"))
REPLICA_FAILURES = Counter("rollouts_hot_load_replica_failures", "Replicas left in ERROR, by reason", ("reason",))


def hot_load_ended(outcome: str, reason: str, seconds: float, replica_errors: list[str]) -> None:
    DURATION.labels(outcome=outcome).observe(seconds)
    ENDED.labels(outcome=outcome, reason=reason).inc()
    for error in replica_errors:
        REPLICA_FAILURES.labels(reason=error_kind(error)).inc()


def error_kind(error: str) -> str:
    """A bounded label from a replica's error: the text before its first colon, at most 60
    characters (`checksum mismatch`, `replica-2 did not stage`, ...)."""
    return error.split(":", 1)[0].strip()[:60] or "unknown"


def scaled(direction: str, outcome: str) -> None:
    AUTOSCALING_STEPS.labels(direction=direction, outcome=outcome).inc()
