"""The embedded stack launcher: idempotent `up` (in a shell holding another stack's variables,
which redirect neither it nor its processes), a clear error for a taken port, `down` by pid that
keeps the data, `up --host` binding and publishing only that address. Runs the real Temporal dev
server and SeaweedFS (a few seconds)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from common.processes import port_in_use
from common.settings import STACK_ENV, Settings
from tests.helpers.other_stack import other_stack_env
from tests.helpers.stack_fixtures import free_port_base
from workers.stack import SERVICE_ORDER, Stack, StackError, load_or_create_settings

# It starts the stack's Temporal dev server and SeaweedFS itself, not through the `stack` fixture.
pytestmark = pytest.mark.stack


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_up_is_idempotent_and_down_keeps_data(tmp_path, monkeypatch: pytest.MonkeyPatch):
    # Another stack's stack.env sourced in this shell: its addresses (nothing listens at 10.9.9.9)
    # must redirect neither `up` (its checks, the default gateway) nor the processes it starts.
    other = other_stack_env(tmp_path)
    del other["ROLLOUTS_HOST"], other["ROLLOUTS_DYNAMO_ROUTER_MODE"]  # `up`'s own inputs
    for name, value in other.items():
        monkeypatch.setenv(name, value)
    settings = Settings.create(tmp_path / "home", free_port_base())
    stack = Stack(settings)
    lines: list[str] = []
    try:
        stack.up(say=lines.append)
        for name in stack.services():
            env = environ_of(stack.pid_file(name).alive_pid())
            leaked = {k for k in env if k in STACK_ENV or k.startswith(("TEMPORAL_", "AWS_", "CW_"))} - {
                "ROLLOUTS_HOME"
            }
            assert not leaked and env["ROLLOUTS_HOME"] == str(tmp_path / "home"), (name, leaked)
        env = (tmp_path / "home" / "stack.env").read_text()
        for key in (
            "ROLLOUTS_API_URL",
            "CW_API_TOKEN",
            "ROLLOUTS_VIEWER_TOKEN",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_REGION",
            "CW_S3_ENDPOINT",
            "AWS_ENDPOINT_URL_S3",
            "ROLLOUTS_BUCKET",
            "ROLLOUTS_BASE_MODEL_PATH",
            "ROLLOUTS_GATEWAY_ID",
            "TEMPORAL_ADDRESS",
            "TEMPORAL_UI_URL",
        ):
            assert f"\n{key}=" in "\n" + env, key
        assert f"\nROLLOUTS_API_URL={settings.api_url}\n" in "\n" + env  # the home's, not the shell's
        pids = stack.status()
        assert all(pids[n] for n in ("temporal", "s3", "api", "worker", "gateway"))
        again: list[str] = []
        stack.up(say=again.append)
        assert stack.services() == SERVICE_ORDER  # Dynamo's frontend included
        assert sum("already running" in line for line in again) == len(stack.services()), again
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


def test_up_on_another_host_binds_and_publishes_only_that_address(tmp_path):
    """`up --host`: every service binds the stack's host (the API, the gateway and the Temporal
    UI not 127.0.0.1; the Temporal frontend binds every address, SeaweedFS adds 127.0.0.1), and
    every published URL names it. 127.0.0.2 is a loopback address of this machine that is not
    127.0.0.1."""
    host = "127.0.0.2"
    settings = load_or_create_settings(tmp_path / "home", free_port_base(), host)
    stack = Stack(settings)
    lines: list[str] = []
    try:
        stack.up(say=lines.append)
        assert json.loads((tmp_path / "home" / "stack.json").read_text())["host"] == host
        env = dict(line.split("=", 1) for line in (tmp_path / "home" / "stack.env").read_text().splitlines())
        for key in (
            "ROLLOUTS_API_URL",
            "ROLLOUTS_GATEWAY_URL",
            "AWS_ENDPOINT_URL_S3",
            "TEMPORAL_ADDRESS",
            "TEMPORAL_UI_URL",
        ):
            assert f"{host}:" in env[key] and "127.0.0.1" not in env[key], (key, env[key])
        for name in ("api", "gateway", "temporal", "temporal_ui", "s3"):
            port = settings.ports[name]
            assert port_in_use(port, host), name
            # The Temporal frontend binds every address (workers/stack.py, temporal_ip_flags), and
            # SeaweedFS listens on 127.0.0.1 too, of its own accord.
            if name not in ("temporal", "s3"):
                assert not port_in_use(port, "127.0.0.1"), f"{name} also listens on 127.0.0.1:{port}"
        # A later `up` elsewhere is refused while the stack runs, and changes nothing.
        with pytest.raises(StackError, match="rollouts down"):
            load_or_create_settings(tmp_path / "home", None, "127.0.0.1")
        assert json.loads((tmp_path / "home" / "stack.json").read_text())["host"] == host
    finally:
        stack.down(say=lines.append)
    assert not any(stack.status().values())
