"""The engine worker's job slots (replica/engine/jobs.py): a stage job and, beside it, a send of
the agent's files (the early offer's sender stages the update it passes on); no vLLM."""

from __future__ import annotations

import threading

import pytest

from replica.engine.jobs import JobRunner


def test_a_file_send_runs_beside_a_stage_and_each_slot_takes_one_job() -> None:
    runner, release = JobRunner(), threading.Event()
    runner.start("stage", lambda: {"staged": release.wait(10)})
    with pytest.raises(RuntimeError, match="background stage job is still running"):
        runner.start("stage", lambda: {})
    runner.start("send", lambda: {"sent": release.wait(10)}, beside=True)
    with pytest.raises(RuntimeError, match="background send job is still running"):
        runner.start("send", lambda: {}, beside=True)
    assert runner.status()["kind"] == "stage" and runner.status("send")["state"] == "running"
    release.set()
    runner.job._thread.join(10)
    runner.beside._thread.join(10)
    assert runner.status("stage")["result"]["staged"] is True
    assert runner.status("send")["result"]["sent"] is True
    assert runner.status("receive")["kind"] is None  # none of that kind: idle
