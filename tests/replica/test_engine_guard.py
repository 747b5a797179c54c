"""Engines answer only their agent and the gateway (replica/engine/guard.py), on the session's
real vLLM CPU engine (conftest.py).

Covers: every route but ``GET /health`` refuses a request without the secret or with a wrong
one (401) and changes nothing (not paused, label and weights as before); with it, inference and
the agent's control routes work; control routes the agent does not use are off (403) even with
the secret, and the weights stay as they were (``/weight_checker``'s ``reset`` would zero them);
the secret is on no command line and its file is gone once the engine serves; a server without
a secret file, or with one others may read, does not start.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from common.settings import ENGINE_SECRET_HEADER
from replica.agent.engine_process import REPO_ROOT, EngineProcess
from replica.launch import SECRET_FILE_ENV, SERVER_MODULE

pytestmark = pytest.mark.engine

SERVED_NAME = "base"
COMPLETION = {"model": SERVED_NAME, "prompt": [100, 101, 102], "max_tokens": 2, "temperature": 0}

# (method, path, JSON body) of routes an attacker would want; all need the secret.
GUARDED = [
    ("POST", "/rollouts/pause", {}),
    ("POST", "/rollouts/resume", {}),
    ("POST", "/rollouts/collective_rpc", {"method": "engine_pid", "args": [], "kwargs": {}}),
    ("POST", "/rollouts/update_weight_version", {"new_version": "forged"}),
    ("POST", "/rollouts/weight_info", {}),
    ("POST", "/rollouts/swap_in_pause", {"label": "forged", "previous": "x"}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", COMPLETION),
    (
        "POST",
        "/v1/chat/completions",
        {"model": SERVED_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    ),
    ("GET", "/metrics", None),
]

# Routes the agent does not use: off, even with the secret.
OFF = [
    ("POST", "/sleep", None),
    ("POST", "/wake_up", None),
    ("POST", "/weight_checker", {"action": "reset"}),
    ("POST", "/update_weights", {}),
    ("POST", "/init_weight_transfer_engine", {}),
    ("POST", "/start_weight_update", {}),
    ("POST", "/finish_weight_update", {}),
    ("POST", "/abort_requests", {}),
    ("POST", "/tokenize", {"model": SERVED_NAME, "prompt": "hi"}),
    ("GET", "/version", None),
    ("POST", "/rollouts/pause/", None),
    # vLLM's own dev routes: the agent uses ours.
    ("POST", "/pause", None),
    ("POST", "/collective_rpc", {"method": "engine_pid", "args": [], "kwargs": {}}),
    ("POST", "/update_weight_version", {"new_version": "forged"}),
    ("GET", "/weight_info", None),
]


async def call(engine: EngineProcess, method: str, path: str, body: object, headers: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=engine.base_url, timeout=120) as client:
        return await client.request(method, path, json=body, headers=headers)


async def test_without_the_secret_every_route_is_refused_and_nothing_changes(engine: EngineProcess) -> None:
    assert engine.secret
    label = await engine.weight_version()
    sums = await engine.checksums()
    for headers in (
        {},
        {ENGINE_SECRET_HEADER: "not-" + engine.secret},
        {ENGINE_SECRET_HEADER: ""},
        {"Authorization": f"Bearer {engine.secret}"},
    ):
        for method, path, body in GUARDED + OFF:
            resp = await call(engine, method, path, body, headers)
            assert resp.status_code == 401, (headers, path, resp.status_code, resp.text)
            error = resp.json()["error"]
            assert error["type"] == "unauthenticated" and ENGINE_SECRET_HEADER in error["message"], error
    assert not await engine.is_paused()
    assert await engine.weight_version() == label
    assert await engine.checksums() == sums


async def test_with_the_secret_inference_and_the_agents_routes_work(engine: EngineProcess) -> None:
    ok = await call(engine, "POST", "/v1/completions", COMPLETION, engine.auth_headers)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == 2
    assert await engine.models() == [SERVED_NAME]
    assert (await engine.engine_pids())["worker"] > 0  # /collective_rpc
    await engine.pause(mode="keep")
    try:
        assert await engine.is_paused()
    finally:
        await engine.resume()
    assert not await engine.is_paused()
    # The liveness probe alone needs nothing.
    health = await call(engine, "GET", "/health", None, {})
    assert health.status_code == 200


async def test_control_routes_the_agent_does_not_use_are_off(engine: EngineProcess) -> None:
    sums = await engine.checksums()
    for method, path, body in OFF:
        resp = await call(engine, method, path, body, engine.auth_headers)
        assert resp.status_code == 403, (path, resp.status_code, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "permission_denied" and path in error["message"], error
    assert await engine.checksums() == sums  # weight_checker's reset never ran
    assert not await engine.is_paused()
    # vLLM's own checksums still come through the one control route the agent uses.
    assert await engine.vllm_weight_checksums()


async def test_the_secret_is_on_no_command_line_and_its_file_is_gone(engine: EngineProcess) -> None:
    if not engine.owned:
        pytest.skip("an attached development engine: its start is not ours to check")
    assert engine.secret
    assert not engine.secret_path.exists()
    for pid in (await engine.engine_pids()).values():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        assert engine.secret.encode() not in cmdline, pid


def run_server(tmp_path: Path, env_update: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
    env.update(env_update)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-m", SERVER_MODULE, "--model", str(tmp_path)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_server_without_a_safe_secret_file_does_not_start(tmp_path: Path) -> None:
    missing = run_server(tmp_path, {})
    assert missing.returncode != 0 and f"{SECRET_FILE_ENV} is not set" in missing.stderr, missing.stderr[-2000:]
    shared = tmp_path / "shared.secret"
    shared.write_text("s3cret")
    shared.chmod(0o644)
    readable = run_server(tmp_path, {SECRET_FILE_ENV: str(shared)})
    assert readable.returncode != 0 and "lets others read it" in readable.stderr, readable.stderr[-2000:]
    empty = tmp_path / "empty.secret"
    empty.write_text("")
    empty.chmod(0o600)
    blank = run_server(tmp_path, {SECRET_FILE_ENV: str(empty)})
    assert blank.returncode != 0 and "the file is empty" in blank.stderr, blank.stderr[-2000:]
