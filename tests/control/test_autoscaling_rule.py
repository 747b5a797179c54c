"""The autoscaling rule (contracts/autoscaling.py): a gateway's judgement of a window of
in-flight samples, and the deployment's step from the reports it heard."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from contracts.autoscaling import (
    BUSY,
    IDLE,
    SCALE_IN_AFTER_S,
    SCALE_OUT_AFTER_S,
    STALE_S,
    STEADY,
    TARGET_IN_FLIGHT,
    Heard,
    judge,
    policy,
    step,
)
from contracts.records import Autoscaling
from control.admission import same_autoscaling

T0 = datetime(2026, 12, 3, tzinfo=UTC)
P = policy(Autoscaling(min=1, max=3, target_in_flight=4, scale_out_after_seconds=10, scale_in_after_seconds=60))


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


@pytest.mark.parametrize(
    ("samples", "replicas", "level"),
    [
        ([0, 0, 0], 2, IDLE),
        ([], 2, IDLE),
        ([0, 1, 0], 2, STEADY),  # one request in the window: not idle
        ([8, 8, 7], 2, STEADY),  # mean 3.83 per replica, under 4
        ([8, 8, 8], 2, BUSY),
        ([16, 0, 0], 1, BUSY),  # the mean, not the last sample
    ],
)
def test_a_window_is_judged_by_its_mean_per_replica_and_idle_only_when_always_empty(samples, replicas, level) -> None:
    assert judge(samples, replicas, 4) == level


def test_the_extension_fields_default_when_unset() -> None:
    p = policy(Autoscaling(min=2, max=2))
    assert (p.target_in_flight, p.scale_out_after, p.scale_in_after) == (
        TARGET_IN_FLIGHT,
        timedelta(seconds=SCALE_OUT_AFTER_S),
        timedelta(seconds=SCALE_IN_AFTER_S),
    )
    assert not p.scales and step(p, 2, {"gw": Heard(BUSY, at(0), at(0))}, at(3600), None) == 0


def test_busy_from_any_gateway_for_the_whole_duration_adds_one_up_to_max() -> None:
    heard = {"a": Heard(BUSY, at(0), at(9)), "b": Heard(IDLE, at(0), at(9))}
    assert step(P, 1, heard, at(9), None) == 0  # not for 10 s yet
    assert step(P, 1, heard, at(10), None) == 1
    assert step(P, 3, heard, at(10), None) == 0  # at max


def test_idle_from_every_gateway_for_the_whole_duration_removes_one_down_to_min() -> None:
    heard = {"a": Heard(IDLE, at(0), at(59)), "b": Heard(STEADY, at(0), at(59))}
    assert step(P, 2, heard, at(60), None) == 0  # one gateway still sees requests
    heard["b"] = Heard(IDLE, at(0), at(59))
    assert step(P, 2, heard, at(59), None) == 0
    assert step(P, 2, heard, at(60), None) == -1
    assert step(P, 1, heard, at(60), None) == 0  # at min


def test_a_scale_step_restarts_the_count_which_is_the_cool_down() -> None:
    heard = {"a": Heard(BUSY, at(0), at(30))}
    assert step(P, 2, heard, at(30), scaled_at=at(25)) == 0
    assert step(P, 2, heard, at(35), scaled_at=at(25)) == 1


def test_a_stale_report_counts_for_nothing() -> None:
    busy = {"gone": Heard(BUSY, at(0), at(0))}
    assert step(P, 1, busy, at(STALE_S), None) == 1
    assert step(P, 1, busy, at(STALE_S + 1), None) == 0
    idle = {"gone": Heard(IDLE, at(0), at(0))}
    assert step(P, 2, idle, at(STALE_S + 1), None) == 0  # no fresh report: no scale-in either


def test_an_update_that_leaves_the_extension_fields_out_keeps_them() -> None:
    spec = Autoscaling(min=1, max=2, target_in_flight=4, scale_in_after_seconds=60)
    assert same_autoscaling(Autoscaling(min=1, max=2), spec)
    assert same_autoscaling(Autoscaling(min=1, max=2, target_in_flight=4), spec)
    assert not same_autoscaling(Autoscaling(min=1, max=3), spec)
    assert not same_autoscaling(Autoscaling(min=1, max=2, target_in_flight=8), spec)
