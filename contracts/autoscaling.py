"""Autoscaling between a deployment's `autoscaling.min` and `max`: what a gateway reports and
the rule the deployment applies (control/deployment.py).

A gateway counts, per deployment, the requests it sent that have not finished (queued in an
engine or running), samples the count every `SAMPLE_S`, and judges the last `WINDOW_S` of
samples (`judge`):

- `BUSY`: the mean count per serving replica is at least `target_in_flight`;
- `IDLE`: no request in flight at any sample of the window;
- `STEADY`: anything between.

It signals the deployment's workflow `load_report` (a `LoadReport`) when its judgement changes,
and at least every `HEARTBEAT_S` while it serves the deployment (only deployments with
`max > min`). The deployment keeps each gateway's last report and since when it has said the
same; a report older than `STALE_S` counts for nothing (its gateway is gone).

The rule (`step`): one replica more when some fresh report has said BUSY for
`scale_out_after_seconds`, one fewer when every fresh report (at least one) has said IDLE for
`scale_in_after_seconds`; never past `min` or `max`. Both durations count from the later of the
report's start and the end of the last scale step, which is the cool-down: after a step, a load
must hold for the whole duration again, measured on the new replica count.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from contracts.records import Autoscaling, Heard, WireModel

BUSY, STEADY, IDLE = "BUSY", "STEADY", "IDLE"
LEVELS = (BUSY, STEADY, IDLE)
SAMPLE_S = 1.0
WINDOW_S = 10.0
HEARTBEAT_S = 30.0
STALE_S = 3 * HEARTBEAT_S

# Defaults of the extension fields (contracts/records.py `Autoscaling`).
TARGET_IN_FLIGHT = 16
SCALE_OUT_AFTER_S = 30
SCALE_IN_AFTER_S = 300
MAX_TARGET_IN_FLIGHT = 4096
MAX_AFTER_S = 86_400


class LoadReport(WireModel):
    """One gateway's judgement of one deployment's load (the `load_report` signal)."""

    gateway_id: str
    level: str  # one of LEVELS
    # The window it judged: mean and largest requests in flight, and the serving replicas.
    mean_in_flight: float = 0.0
    peak_in_flight: int = 0
    replicas: int = 0


@dataclass(frozen=True)
class Policy:
    min: int
    max: int
    target_in_flight: int
    scale_out_after: timedelta
    scale_in_after: timedelta

    @property
    def scales(self) -> bool:
        return self.max > self.min


def policy(a: Autoscaling) -> Policy:
    """The spec's autoscaling with the defaults filled in."""
    return Policy(
        min=a.min,
        max=a.max,
        target_in_flight=a.target_in_flight or TARGET_IN_FLIGHT,
        scale_out_after=timedelta(
            seconds=SCALE_OUT_AFTER_S if a.scale_out_after_seconds is None else a.scale_out_after_seconds
        ),
        scale_in_after=timedelta(
            seconds=SCALE_IN_AFTER_S if a.scale_in_after_seconds is None else a.scale_in_after_seconds
        ),
    )


def judge(samples: list[int], replicas: int, target_in_flight: int) -> str:
    """A gateway's judgement of a window of in-flight samples for a deployment of `replicas`
    serving replicas (module docstring)."""
    if not samples or max(samples) == 0:
        return IDLE
    if replicas > 0 and sum(samples) / len(samples) / replicas >= target_in_flight:
        return BUSY
    return STEADY


def step(p: Policy, replicas: int, heard: dict[str, Heard], now: datetime, scaled_at: datetime | None) -> int:
    """+1, -1 or 0: what the deployment of `replicas` members does now (module docstring)."""
    if not p.scales:
        return 0
    fresh = [h for h in heard.values() if (now - h.at).total_seconds() <= STALE_S]

    def held(h: Heard) -> timedelta:
        return now - (max(h.since, scaled_at) if scaled_at is not None else h.since)

    if replicas < p.max and any(h.level == BUSY and held(h) >= p.scale_out_after for h in fresh):
        return 1
    if replicas > p.min and fresh and all(h.level == IDLE and held(h) >= p.scale_in_after for h in fresh):
        return -1
    return 0
