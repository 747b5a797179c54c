"""The replica agent's Prometheus metrics (served by common/metrics.py): what this replica's
updates cost and how they ended.

Pause seconds; bytes taken in (``source`` bucket | peer) and sent; swap bytes (``what`` pause |
staged | changed, `contracts.engine_ranks.BYTE_COUNTS`); steps, step seconds and failures per
control-plane step (``reason``: the error type the control plane sees); delta stages by ``how``
(decoded | copied from a sibling's decode); offers refused (a normal answer, not a failure);
the replica's ``state`` gauge and its ``info``. Every series carries ``deployment`` and
``replica`` labels, so a host's agents aggregate without relabelling.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram
from temporalio.exceptions import ApplicationError

from common.metrics import OPERATION_BUCKETS, PAUSE_BUCKETS
from contracts.errors import PEER_OFFER_REFUSED

STATES = ("STARTING", "READY", "UPDATING", "FAILED")
_LABELS = ("deployment", "replica")

PAUSE = Histogram("rollouts_replica_pause_seconds", "Engine pause per swap", _LABELS, buckets=PAUSE_BUCKETS)
BYTES = Counter("rollouts_replica_bytes", "Snapshot bytes taken in, by source", (*_LABELS, "source"))
SWAP_BYTES = Counter(
    "rollouts_replica_swap_bytes",
    "Bytes of swaps: written inside the pause, staged before it, changed",
    (*_LABELS, "what"),
)
BYTES_SENT = Counter("rollouts_replica_bytes_sent", "Bytes broadcast to peers", _LABELS)
STEPS = Counter("rollouts_replica_steps", "Steps run", (*_LABELS, "step"))
STEP_SECONDS = Histogram(
    "rollouts_replica_step_seconds", "Step duration", (*_LABELS, "step"), buckets=OPERATION_BUCKETS
)
FAILURES = Counter("rollouts_replica_step_failures", "Failed steps, by reason", (*_LABELS, "step", "reason"))
DELTA_STAGES = Counter(
    "rollouts_replica_delta_stages",
    "Delta updates staged, decoded here or copied from this host's decode",
    (*_LABELS, "how"),
)
REFUSED = Counter("rollouts_replica_offers_refused", "Offers declined (nothing to pass on yet)", _LABELS)
STATE = Gauge("rollouts_replica_state", "1 for the replica's current state", (*_LABELS, "state"))
INFO = Gauge("rollouts_replica_info", "The replica and the snapshot it serves", (*_LABELS, "engine", "snapshot"))


class ReplicaMetrics:
    """The metrics of one replica (one agent process runs one replica)."""

    def __init__(self, deployment: str, replica: str, engine: str) -> None:
        self.labels = {"deployment": deployment, "replica": replica}
        self.engine = engine
        self._snapshot: str | None = None
        self.state("STARTING")

    def state(self, state: str) -> None:
        for s in STATES:
            STATE.labels(**self.labels, state=s).set(1 if s == state else 0)

    def serving(self, snapshot: str) -> None:
        if self._snapshot is not None and self._snapshot != snapshot:
            INFO.remove(*self.labels.values(), self.engine, self._snapshot)
        self._snapshot = snapshot
        INFO.labels(**self.labels, engine=self.engine, snapshot=snapshot).set(1)

    def paused(self, pause_ms: float, moved: dict[str, int] | None = None) -> None:
        PAUSE.labels(**self.labels).observe(pause_ms / 1000)
        for what in ("pause", "staged", "changed"):
            if moved and f"{what}_bytes" in moved:
                SWAP_BYTES.labels(**self.labels, what=what).inc(moved[f"{what}_bytes"])

    def took_in(self, source: str, nbytes: int) -> None:
        if nbytes:
            BYTES.labels(**self.labels, source=source).inc(nbytes)

    def sent(self, nbytes: int) -> None:
        BYTES_SENT.labels(**self.labels).inc(nbytes)

    @contextmanager
    def step(self, name: str, *, changes_weights: bool = False) -> Iterator[None]:
        """Count and time one step; a failure is counted by reason and re-raised. A step that
        changes weights shows the replica UPDATING while it runs."""
        start = time.monotonic()
        if changes_weights:
            self.state("UPDATING")
        try:
            yield
        except BaseException as exc:
            if reason_of(exc) == PEER_OFFER_REFUSED:
                REFUSED.labels(**self.labels).inc()
            else:
                FAILURES.labels(**self.labels, step=name, reason=reason_of(exc)).inc()
            raise
        finally:
            STEPS.labels(**self.labels, step=name).inc()
            STEP_SECONDS.labels(**self.labels, step=name).observe(time.monotonic() - start)
            if changes_weights:
                self.state("READY")


def delta_staged(deployment: str, replica: str, *, copied: bool) -> None:
    """One delta update staged by `replica`: decoded here, or `copied` from this host's decode."""
    DELTA_STAGES.labels(deployment=deployment, replica=replica, how="copied" if copied else "decoded").inc()


def reason_of(exc: BaseException) -> str:
    """The failure's reason as the control plane sees it: an ApplicationError's type, else the
    exception's class."""
    if isinstance(exc, ApplicationError) and exc.type:
        return exc.type
    return type(exc).__name__
