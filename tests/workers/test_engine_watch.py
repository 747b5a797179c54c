"""The suite's engine guard (tests/helpers/engines.py) on stand-in processes: a process whose
command line runs the engine's server module counts as an engine, its children do not count
again, processes of another session are not counted, more than three at once is recorded with
the running test's name, and a process is a test's only if it started while the test ran."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from replica.launch import SERVER_MODULE
from tests.helpers.engines import SESSION_ENV, EngineWatch, engines

# Sleeps with the engine's module name in its argv; with a child, like vLLM's own processes.
STAND_IN = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]]) "
    "if sys.argv[2] == 'child' else None\n"
    "time.sleep(60)\n"
)


@pytest.fixture
def stand_ins() -> Iterator:
    started: list[subprocess.Popen] = []

    def start(session: str, n: int, child: bool = False) -> None:
        env = {**os.environ, SESSION_ENV: session}
        for _ in range(n):
            started.append(
                subprocess.Popen(
                    [sys.executable, "-c", STAND_IN, SERVER_MODULE, "child" if child else "-"],
                    env=env,
                    start_new_session=True,
                )
            )

    yield start
    for proc in started:
        os.killpg(proc.pid, 9)
        proc.wait()


def wait_count(session: str, n: int) -> list:
    for _ in range(200):
        found = engines(session)
        if len(found) == n:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{len(engines(session))} stand-ins found, want {n}")


def test_an_engine_with_children_counts_once_and_other_sessions_not_at_all(stand_ins):
    mine, other = uuid.uuid4().hex, uuid.uuid4().hex
    stand_ins(mine, 2, child=True)
    stand_ins(other, 1)
    found = wait_count(mine, 2)
    assert all(SERVER_MODULE in proc.cmdline for proc in found)
    wait_count(other, 1)


def test_more_than_three_at_once_is_recorded_with_the_test(stand_ins):
    session = uuid.uuid4().hex
    watch = EngineWatch(session=session)
    watch.enter("tests/x.py::test_y", "call")
    stand_ins(session, 3)
    wait_count(session, 3)
    watch.sample()
    assert watch.peak == 3 and watch.take_excess() is None
    assert len(watch.started_during("tests/x.py::test_y")) == 3
    stand_ins(session, 1)
    wait_count(session, 4)
    watch.sample()
    excess = watch.take_excess()
    assert excess is not None and excess.startswith(
        "4 vLLM engines of this test session alive at once during tests/x.py::test_y (call) (at most 3)"
    ), excess


def test_a_process_started_before_a_test_began_is_not_that_tests(stand_ins):
    session = uuid.uuid4().hex
    stand_ins(session, 1)
    wait_count(session, 1)
    time.sleep(0.05)  # past the start-time clock's tick (10 ms)
    watch = EngineWatch(session=session)
    watch.enter("tests/x.py::test_later", "setup")
    watch.sample()  # first seen now, but it started earlier
    assert watch.started_by["tests/x.py::test_later"] and watch.started_during("tests/x.py::test_later") == []
