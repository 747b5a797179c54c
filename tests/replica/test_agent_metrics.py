"""replica/agent/metrics.py: a step is counted and timed; a failed one is counted by the reason
the control plane sees (an ApplicationError's type, else the exception's class); the state and
info gauges follow the replica. Read back through the text exposition, as Prometheus reads it."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.exceptions import ApplicationError

from control.metrics import error_kind
from replica.agent.metrics import ReplicaMetrics


def sample(name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(generate_latest().decode()):
        for s in family.samples:
            if s.name == name and labels.items() <= s.labels.items():
                return s.value
    return 0.0


def test_steps_failures_by_reason_state_and_snapshot() -> None:
    m = ReplicaMetrics("dep-metrics", "replica-0", "dynamo-vllm")
    mine = {"deployment": "dep-metrics", "replica": "replica-0"}
    assert sample("rollouts_replica_state", **mine, state="STARTING") == 1
    with m.step("apply_snapshot", changes_weights=True):
        assert sample("rollouts_replica_state", **mine, state="UPDATING") == 1
    m.paused(42.0)
    m.took_in("bucket", 1000)
    m.serving("s1")
    with pytest.raises(ApplicationError), m.step("apply_snapshot", changes_weights=True):
        raise ApplicationError("checksum mismatch", type="NonRetryableSnapshot")
    with pytest.raises(TimeoutError), m.step("stage_from_peer"):
        raise TimeoutError()
    m.serving("s2")
    assert sample("rollouts_replica_steps_total", **mine, step="apply_snapshot") == 2
    assert (
        sample("rollouts_replica_step_failures_total", **mine, step="apply_snapshot", reason="NonRetryableSnapshot")
        == 1
    )
    assert sample("rollouts_replica_step_failures_total", **mine, step="stage_from_peer", reason="TimeoutError") == 1
    assert sample("rollouts_replica_state", **mine, state="READY") == 1
    assert sample("rollouts_replica_pause_seconds_sum", **mine) == pytest.approx(0.042)
    assert sample("rollouts_replica_bytes_total", **mine, source="bucket") == 1000
    assert sample("rollouts_replica_info", **mine, snapshot="s2") == 1
    assert sample("rollouts_replica_info", **mine, snapshot="s1") == 0  # the old label set is gone


def test_a_replica_error_becomes_a_bounded_reason() -> None:
    assert error_kind("checksum mismatch: the writer recorded 0badc0de, ...") == "checksum mismatch"
    assert error_kind("") == "unknown"
    assert len(error_kind("x" * 500)) == 60
