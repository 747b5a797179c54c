"""Start and stop the real embedded stack for tests (Temporal dev server, SeaweedFS, API,
control worker, gateway) in a temporary home on free loopback ports, and helpers to drive it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.processes import port_in_use
from common.settings import PORT_OFFSETS, Settings, temporal_client
from contracts import names
from contracts.records import TERMINAL_HOT_LOAD_STATES
from tests.helpers.parallel import worker_slot
from workers.stack import Stack

REPO = Path(__file__).resolve().parents[2]


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take theirs there)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_base() -> int:
    """A base whose whole range (and SeaweedFS's gRPC ports at +10000) is free on 127.0.0.1, and
    below the kernel's ephemeral range where it can be: a port there can be taken by any outgoing
    connection between this check and the service's bind (a stack starts its services over a
    minute or more, uploading the base model meanwhile). Each xdist worker draws from a slice
    of its own, so two workers' stacks never pick the same range at the same moment."""
    top = _ephemeral_low() - 10000 - max(PORT_OFFSETS.values()) - 1
    low, high = (10000, top) if top > 12000 else (20000, 40000)
    index, count = worker_slot()
    span = (high - low) // count // 50 * 50
    low, high = low + index * span, low + (index + 1) * span
    for _ in range(200):
        base = random.randrange(low, high, 50)
        ports = [base + off for off in PORT_OFFSETS.values()]
        ports += [p + 10000 for p in ports]
        if not any(port_in_use(p) for p in ports):
            return base
    raise RuntimeError("no free port range found")


def start_stack(home: Path) -> tuple[Stack, Settings]:
    settings = Settings.create(home, free_port_base())
    stack = Stack(settings)
    stack.up(say=lambda line: print(line, flush=True))
    return stack, settings


class Api:
    """A thin JSON client for the REST API, raising nothing: tests assert status and body."""

    def __init__(self, settings: Settings, token: str | None = None) -> None:
        self.base = f"{settings.api_url}/v1alpha1/inference"
        self.headers = {"Authorization": f"Bearer {token or settings.admin_token}"}

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.base}{path}", headers=self.headers, timeout=60, **kw)

    def wait_deployment(self, dep_id: str, timeout: float = 900) -> dict:
        """The deployment once it is ready or failed."""
        return self._wait(
            f"/deployments/{dep_id}",
            "deployment",
            lambda dep: dep["status"]["status"] in ("STATUS_READY", "STATUS_FAILED"),
            f"deployment {dep_id} not ready",
            timeout,
            every=0.5,
        )

    def wait_hot_load(self, hl_id: str, timeout: float = 900) -> dict:
        """The hot-load once it is in a terminal state (a small delta completes in a few hundred ms)."""
        return self._wait(
            f"/hotLoads/{hl_id}",
            "hotLoad",
            lambda hl: hl["status"]["state"] in TERMINAL_HOT_LOAD_STATES,
            f"hot-load {hl_id} not terminal",
            timeout,
            every=0.25,
        )

    def _wait(self, path: str, key: str, done: Callable[[dict], bool], late: str, timeout: float, every: float) -> dict:
        """GET ``path`` every ``every`` s until its ``key`` record is ``done``; every answer must be
        a 200; ``TimeoutError`` (``late``) after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.call("GET", path)
            assert r.status_code == 200, f"GET {path}: {r.status_code} {r.text}"
            record = r.json()[key]
            if done(record):
                return record
            time.sleep(every)
        raise TimeoutError(f"{late} after {timeout}s")


def deployment_body(settings: Settings, name: str, replicas: int, path_prefix: str) -> dict:
    return {
        "name": name,
        "gatewayIds": [settings.gateway_id],
        "runtime": {"engine": "dynamo-vllm", "version": "0.32.0"},
        "resources": {"instanceType": "cpu-local", "gpuCount": 0},
        "model": {"name": name + "-model", "bucket": settings.bucket, "path": settings.base_model_path},
        "autoscaling": {"min": replicas, "max": replicas},
        "traffic": {"weight": 100},
        "hotLoad": {"bucket": settings.bucket, "pathPrefix": path_prefix, "transitionMode": "TRANSITION_MODE_ASYNC"},
    }


def cwtrain_python() -> Path:
    """cwtrain's interpreter: ROLLOUTS_CWTRAIN_PYTHON, else the venv `make test` installs (.venv-cw)."""
    return Path(os.environ.get("ROLLOUTS_CWTRAIN_PYTHON") or REPO / ".venv-cw" / "bin" / "python")


def require_cwtrain() -> None:
    """Fail, naming the missing interpreter and how to install it, when cwtrain's venv is absent."""
    if not cwtrain_python().exists():
        pytest.fail(f"cwtrain venv missing at {cwtrain_python()}: run `make cwtrain` (needs python3.12)")


def cwtrain(settings: Settings, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    """Run the real cwtrain CLI (Python 3.12 venv) with stack.env's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CW_", "COREWEAVE_"))}
    env.update(settings.stack_env())
    cmd = [str(cwtrain_python()), "-m", "cwtrain.cli", "--base-url", settings.api_url, *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def json_out(proc: subprocess.CompletedProcess) -> Any:
    assert proc.returncode == 0, f"cwtrain failed ({proc.returncode}):\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout)


def wait_registered(settings, node: str, timeout: float = 120) -> None:
    """Until the node registry lists `node` (its first heartbeat arrived)."""

    async def nodes() -> dict:
        client = await temporal_client(settings)
        return (await (await client.get_workflow_handle(names.NODE_REGISTRY_ID).describe()).memo()).get("nodes", {})

    deadline = time.monotonic() + timeout
    while node not in asyncio.run(nodes()):
        assert time.monotonic() < deadline, f"node {node} did not register in {timeout:.0f}s"
        time.sleep(0.5)
