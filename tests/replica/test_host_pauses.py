"""A stage gives way to another engine's pause on the same host (replica/engine/host_pauses.py):
it waits while a live process's pause marker is there, not for a dead one's (which it removes),
and never longer than its limit in all. Threads of this process stand in for the two engines."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest

from replica.engine import host_pauses


@pytest.fixture(autouse=True)
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ROLLOUTS_SHM_DIR", str(tmp_path))
    return tmp_path / "rollouts-pauses"


def test_a_stage_waits_until_the_pause_ends() -> None:
    inside, ended = threading.Event(), threading.Event()

    def pause() -> None:
        with host_pauses.pausing():
            inside.set()
            time.sleep(0.05)
            ended.set()

    host_pauses.begin_stage()
    host_pauses.give_way()  # no pause on the host: no wait
    other = threading.Thread(target=pause)
    other.start()
    assert inside.wait(10)
    host_pauses.give_way()
    assert ended.is_set()  # it returned only once the pause had ended
    other.join(10)
    assert not any(host_pauses._directory().iterdir())  # the marker went with the pause


def test_a_dead_process_s_marker_is_removed_and_not_waited_for(shm: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    shm.mkdir()
    stale = shm / f"{gone.pid}-deadbeef"
    stale.touch()
    host_pauses.begin_stage()
    host_pauses.give_way()
    assert not stale.exists()


def test_a_stage_waits_no_longer_than_its_limit_in_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_pauses, "WAIT_LIMIT_S", 0.05)
    with host_pauses.pausing():  # a pause that outlasts the limit (this process is alive)
        host_pauses.begin_stage()
        t0 = time.monotonic()
        host_pauses.give_way()
        waited = time.monotonic() - t0
        t1 = time.monotonic()
        host_pauses.give_way()  # the limit is spent: the rest of the stage does not wait
        again = time.monotonic() - t1
    assert waited >= 0.05 > again
