"""The embedded stack launcher: idempotent `up`, a clear error for a taken port, `down` by pid
that keeps the data. Runs the real Temporal dev server and SeaweedFS (a few seconds)."""

from __future__ import annotations

import socket

import pytest

from common.settings import Settings
from tests.helpers.stack_fixtures import free_port_base
from workers.stack import Stack, StackError

# It starts the stack's Temporal dev server and SeaweedFS itself, not through the `stack` fixture.
pytestmark = pytest.mark.stack


def test_up_is_idempotent_and_down_keeps_data(tmp_path):
    settings = Settings.create(tmp_path / "home", free_port_base())
    stack = Stack(settings)
    lines: list[str] = []
    try:
        stack.up(say=lines.append)
        env = (tmp_path / "home" / "stack.env").read_text()
        for key in ("ROLLOUTS_API_URL", "CW_API_TOKEN", "ROLLOUTS_VIEWER_TOKEN", "AWS_ACCESS_KEY_ID",
                    "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "CW_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3",
                    "ROLLOUTS_BUCKET", "ROLLOUTS_BASE_MODEL_PATH", "ROLLOUTS_GATEWAY_ID", "TEMPORAL_ADDRESS",
                    "TEMPORAL_UI_URL"):
            assert f"\n{key}=" in "\n" + env, key
        pids = stack.status()
        assert all(pids[n] for n in ("temporal", "s3", "api", "worker", "gateway"))
        again: list[str] = []
        stack.up(say=again.append)
        assert sum("already running" in line for line in again) == 5, again
        assert any("base model already in" in line for line in again)
        assert stack.status() == pids
    finally:
        stack.down(say=lines.append)
    assert not any(stack.status().values())
    assert (tmp_path / "home" / "temporal" / "temporal.db").exists()
    assert any((tmp_path / "home" / "s3" / "data").iterdir())


def test_a_taken_port_is_a_clear_error(tmp_path):
    base = free_port_base()
    settings = Settings.create(tmp_path / "home", base)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", settings.ports["temporal"]))
    blocker.listen()
    try:
        with pytest.raises(StackError, match=str(settings.ports["temporal"])) as err:
            Stack(settings).start("temporal")
        assert "already in use" in str(err.value)
    finally:
        blocker.close()


def test_a_failed_up_stops_what_it_started(tmp_path):
    settings = Settings.create(tmp_path / "home", free_port_base())
    stack = Stack(settings)
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", settings.ports["api"]))
    blocker.listen()
    lines: list[str] = []
    try:
        with pytest.raises(StackError, match=str(settings.ports["api"])):
            stack.up(say=lines.append)
        # Temporal, SeaweedFS and the control worker had started before the API's port was found
        # taken: none of them is left running.
        assert any(line.startswith("worker") and "started" in line for line in lines), lines
        assert not any(stack.status().values()), stack.status()
    finally:
        blocker.close()
        stack.down(say=lines.append)
