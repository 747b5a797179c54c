"""The control worker's Prometheus metrics: how hot-loads end, and autoscaling steps.

Hot-load durations and ends by outcome and reason, replicas left in ERROR by reason, and
autoscaling steps by direction and outcome. Workflow code records them through Temporal's
workflow metric meter (`hot_load_ended`, `scaled`), which records nothing during replay; a final
workflow task may still run twice, so counts are at least what happened, never at most.
`TemporalMirror` (a collector in the default registry) drains the runtime's buffer
(`buffered_runtime()`) on every scrape and every second, dropping Temporal's own attributes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import REGISTRY, CounterMetricFamily, HistogramMetricFamily
from temporalio import workflow

from common.metrics import OPERATION_BUCKETS

DURATION = "rollouts_hot_load_duration_seconds"
ENDED = "rollouts_hot_loads_ended"
REPLICA_FAILURES = "rollouts_hot_load_replica_failures"
AUTOSCALING_STEPS = "rollouts_autoscaling_steps"
# name -> (help, label names); the histogram is DURATION's alone.
METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    DURATION: ("Hot-load duration, by outcome", ("outcome",)),
    ENDED: ("Hot-loads that ended, by outcome and reason", ("outcome", "reason")),
    REPLICA_FAILURES: ("Replicas left in ERROR, by reason", ("reason",)),
    AUTOSCALING_STEPS: ("Autoscaling steps, by direction and outcome", ("direction", "outcome")),
}
BUFFER_SIZE = 100_000
DRAIN_EVERY_S = 1.0


# -- in workflow code -------------------------------------------------------------------------


def hot_load_ended(outcome: str, reason: str, seconds: float, replica_errors: list[str]) -> None:
    meter = workflow.metric_meter()
    meter.create_histogram_float(DURATION, METRICS[DURATION][0], "s").record(seconds, {"outcome": outcome})
    meter.create_counter(ENDED, METRICS[ENDED][0]).add(1, {"outcome": outcome, "reason": reason})
    failures = meter.create_counter(REPLICA_FAILURES, METRICS[REPLICA_FAILURES][0])
    for error in replica_errors:
        failures.add(1, {"reason": error_kind(error)})


def scaled(direction: str, outcome: str) -> None:
    workflow.metric_meter().create_counter(AUTOSCALING_STEPS, METRICS[AUTOSCALING_STEPS][0]).add(
        1, {"direction": direction, "outcome": outcome}
    )


def error_kind(error: str) -> str:
    """A bounded label from a replica's error: the text before its first colon, at most 60
    characters (`checksum mismatch`, `replica-2 did not stage`, ...)."""
    return error.split(":", 1)[0].strip()[:60] or "unknown"


# -- in the control worker's process ----------------------------------------------------------


def buffered_runtime() -> tuple[Any, Any]:
    """A Temporal runtime whose metrics go to a buffer, and the buffer (`TemporalMirror` drains it)."""
    from temporalio.runtime import MetricBuffer, Runtime, TelemetryConfig  # noqa: PLC0415 - not in workflow code

    buffer = MetricBuffer(BUFFER_SIZE)
    return Runtime(telemetry=TelemetryConfig(metrics=buffer)), buffer


@dataclass
class _Histogram:
    buckets: list[float] = field(default_factory=lambda: [0.0] * len(OPERATION_BUCKETS))
    total: float = 0.0
    count: float = 0.0

    def observe(self, value: float) -> None:
        for i, upper in enumerate(OPERATION_BUCKETS):
            if value <= upper:
                self.buckets[i] += 1
        self.total += value
        self.count += 1


class TemporalMirror:
    """Our workflow metrics from a Temporal runtime's buffer, as Prometheus families (module
    docstring). `mirror(updates)` takes buffered updates (each with `.metric.name`, `.value`,
    `.attributes`); `collect()` drains the runtime's buffer (`buffer`) first."""

    def __init__(self, buffer: Any = None) -> None:
        self.buffer = buffer
        self._lock = threading.Lock()
        self.counters: dict[str, dict[tuple[str, ...], float]] = {n: {} for n in METRICS if n != DURATION}
        self.durations: dict[tuple[str, ...], _Histogram] = {}

    def mirror(self, updates: Iterable[Any]) -> None:
        with self._lock:
            for update in updates:
                name = update.metric.name
                if name not in METRICS:
                    continue
                labels = tuple(str(update.attributes.get(k, "")) for k in METRICS[name][1])
                if name == DURATION:
                    self.durations.setdefault(labels, _Histogram()).observe(float(update.value))
                else:
                    self.counters[name][labels] = self.counters[name].get(labels, 0.0) + float(update.value)

    def drain(self) -> None:
        if self.buffer is not None:
            with self._lock:
                updates = self.buffer.retrieve_updates()
            self.mirror(updates)

    def collect(self) -> Iterator[Any]:
        self.drain()
        with self._lock:
            help_, labels = METRICS[DURATION]
            family = HistogramMetricFamily(DURATION, help_, labels=labels)
            for values, h in sorted(self.durations.items()):
                cumulative = [(str(upper), count) for upper, count in zip(OPERATION_BUCKETS, h.buckets, strict=True)]
                family.add_metric(list(values), [*cumulative, ("+Inf", h.count)], h.total)
            yield family
            for name, series in self.counters.items():
                help_, labels = METRICS[name]
                counter = CounterMetricFamily(name, help_, labels=labels)
                for values, value in sorted(series.items()):
                    counter.add_metric(list(values), value)
                yield counter

    def start(self) -> TemporalMirror:
        """Register in the default registry and drain every `DRAIN_EVERY_S` from a daemon thread
        (the buffer holds `BUFFER_SIZE` updates, Temporal's own metrics included)."""
        REGISTRY.register(self)

        def drain_forever() -> None:
            while True:
                time.sleep(DRAIN_EVERY_S)
                self.drain()

        threading.Thread(target=drain_forever, name="temporal-metrics", daemon=True).start()
        return self
