"""``common.processes.stop_pids``, unit, on real processes: several processes are stopped at once
(each gets its SIGTERM before any of them has finished stopping), one that ignores SIGTERM gets
SIGKILL after the wait, and a pid that is not running is not reported as stopped."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from common.processes import alive, stop_pids

# On SIGTERM: write the time it came, take a while to stop (as an engine does), write the time
# it stopped, exit.
SLOW_STOP = """
import signal, sys, time
out = sys.argv[1]
def on_term(*_):
    open(out + ".term", "w").write(repr(time.time()))
    time.sleep(1.0)
    open(out + ".exit", "w").write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
open(out + ".ready", "w").write("")
while True:
    time.sleep(0.05)
"""
# Notes SIGTERM and goes on: only SIGKILL stops it.
DEAF = """
import signal, sys, time
out = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *_: open(out + ".term", "w").write(""))
open(sys.argv[1] + ".ready", "w").write("")
while True:
    time.sleep(0.05)
"""


def start(code: str, out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code, str(out)], start_new_session=True)
    deadline = time.monotonic() + 60
    while not out.with_suffix(".ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the process did not start"
        time.sleep(0.02)
    return proc


def test_processes_stop_together_and_a_deaf_one_is_killed(tmp_path: Path) -> None:
    slow = [start(SLOW_STOP, tmp_path / f"slow{i}") for i in range(3)]
    deaf = start(DEAF, tmp_path / "deaf")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stopped = stop_pids([p.pid for p in slow] + [deaf.pid, gone.pid], timeout=5)
    assert stopped == [p.pid for p in slow] + [deaf.pid]  # the exited one was not running
    for p in [*slow, deaf]:
        p.wait(timeout=10)
        assert not alive(p.pid)
    terms = [float((tmp_path / f"slow{i}.term").read_text()) for i in range(3)]
    exits = [float((tmp_path / f"slow{i}.exit").read_text()) for i in range(3)]
    assert max(terms) < min(exits), (terms, exits)  # all were told before the first had stopped
    assert (tmp_path / "deaf.term").exists()  # told, went on, and is gone: killed after the wait
