"""``common.processes.wait_serving`` and ``tail``, unit, on real processes: a process that exits
before it serves is named with its exit code and its log's last lines; one that never serves is
named with its URL after the timeout; a probe that raises a not-yet error is asked again until it
answers; a non-reaping ``pid_alive`` leaves the exit code to the ``Popen``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.processes import pid_alive, tail, terminate, wait_serving


class Down(Exception):
    pass


async def test_an_exit_before_serving_names_the_code_and_the_log_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('\\n'.join(map(str, range(100)))); raise SystemExit(3)"], stdout=out
        )
    deadline = time.monotonic() + 60
    while pid_alive(proc.pid):  # a zombie counts as gone, and is left unreaped
        assert time.monotonic() < deadline, "the process did not exit"
        time.sleep(0.01)
    assert proc.poll() == 3  # its Popen, not pid_alive, read the exit code

    async def never() -> bool:
        return False

    with pytest.raises(Down, match=r"(?s)^engine exited with code 3 before it served .*\n40\n.*\n99$") as err:
        await wait_serving(proc, never, name="engine", url="http://h:1", log_path=log, timeout=60, error=Down)
    assert "\n39\n" not in str(err.value)  # the last 60 lines only


async def test_a_probe_not_yet_ready_is_asked_again_then_times_out_naming_the_url(tmp_path: Path) -> None:
    asked = []

    async def refusing() -> bool:
        asked.append(1)
        if len(asked) < 3:
            raise ConnectionRefusedError("not listening yet")
        return len(asked) >= 4

    await wait_serving(None, refusing, name="engine", url="http://h:1", log_path=None, timeout=60, error=Down, every=0)
    assert len(asked) == 4

    async def never() -> bool:
        return False

    with pytest.raises(Down, match=r"^frontend at http://h:2 not answering after 0s \(log None\):\n\(no log\)$"):
        await wait_serving(
            None,
            never,
            name="frontend",
            url="http://h:2",
            log_path=None,
            timeout=0,
            error=Down,
            ready="answering",
            every=0,
        )


def test_tail_reads_the_last_lines_of_a_large_log(tmp_path: Path) -> None:
    log = tmp_path / "big.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert tail(log, 2) == "line 99998\nline 99999"
    assert tail(tmp_path / "missing.log") == "(no log)"


async def test_terminate_kills_the_group_of_a_process_deaf_to_sigterm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(sys.argv[1], 'w').close(); time.sleep(600)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(ready)], start_new_session=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the process did not start"
        time.sleep(0.02)
    assert await terminate(proc, timeout=0.2) == -signal.SIGKILL
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    assert await terminate(polite, timeout=60) == -signal.SIGTERM
