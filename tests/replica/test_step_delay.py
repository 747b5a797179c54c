"""replica/engine/step_delay.py on a stand-in worker (a unit test: the real engine's use is in
tests/replica/test_dynamo_worker.py and the in-flight e2e tests): a delay wraps the worker's own
``execute_model``, 0 restores it, a bad delay is refused by name and changes nothing."""

from __future__ import annotations

import math
import time

import pytest

from replica.engine.step_delay import set_step_delay


class Worker:
    def execute_model(self, step: int) -> int:
        return step + 1


def test_a_delay_slows_each_step_and_zero_restores_the_workers_own_method() -> None:
    w = Worker()
    assert set_step_delay(w, 0.05) == {"step_delay_s": 0.05}
    t0 = time.perf_counter()
    assert w.execute_model(1) == 2
    assert time.perf_counter() - t0 >= 0.05
    assert set_step_delay(w, 0.01) == {"step_delay_s": 0.01}  # replaces, never stacks
    assert set_step_delay(w, 0) == {"step_delay_s": 0.0}
    assert "execute_model" not in vars(w) and w.execute_model(1) == 2


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_a_bad_delay_is_refused_and_changes_nothing(bad: float) -> None:
    w = Worker()
    set_step_delay(w, 0.02)
    slowed = w.execute_model
    with pytest.raises(ValueError, match="step delay"):
        set_step_delay(w, bad)
    assert w.execute_model is slowed
