"""Crashes in the middle of a multi-replica hot-load, on the real Temporal dev server: the control
worker killed -9 (a process of its own), the Temporal dev server killed -9 and restarted on the
same SQLite file, the API dropping a create mid-request. After each, the operation goes on and
ends in a documented terminal state, nothing stays IN_PROGRESS, no replica is left mid-step, and
the deployment admits the next hot-load. Replicas are test activities in this process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.temporal_server import REPO, TEMPORAL_BIN
from tests.workflows.harness import ZONE, Fleet, poll, write_full
from tests.workflows.test_admission import _every, _state
from workers.settings import SEARCH_ATTRIBUTES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_control_process(address: str, f: Fleet, tmp: Path) -> subprocess.Popen:
    ready = tmp / f"control-{os.urandom(3).hex()}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.workflows.control_process", address, f.task_queue, str(f.bucket_root), str(ready)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=open(tmp / "control.log", "ab"),
    )
    await poll(lambda: _true_if(ready.exists()), 30, "control worker process ready", every=0.1)
    return proc


async def _true_if(cond: bool) -> bool | None:
    return True if cond else None


def kill9(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


async def replicas_of(f: Fleet, hl: str) -> list[dict]:
    return (await f.call("GET", f"/hotLoads/{hl}/replicas")).json()["replicas"]


async def test_control_worker_killed_mid_hot_load_then_restarted(temporal_env, tmp_path):
    address = temporal_env.client.service_client.config.target_host
    async with Fleet(temporal_env.client, tmp_path, control_worker=False) as f:
        proc = await start_control_process(address, f, tmp_path)
        try:
            state = _state("dep-crash-worker", zones=[ZONE])
            state.replicas = f.replica_endpoints("dep-crash-worker", 3)
            dep = await f.deployment_from_state(state)
            write_full(f.bucket_root / f"ckpt/{dep}", "s1")
            f.apply_behaviour = {"replica-1": f.held}
            assert (await f.create_hot_load(dep, "s1", hotLoadId="crash-worker")).status_code == 200
            await asyncio.wait_for(f.started.wait(), 20)

            kill9(proc)
            # The step finishes while no control worker runs: its result waits in Temporal.
            f.hold.set()
            await asyncio.sleep(1)
            mid = (await f.call("GET", "/hotLoads/crash-worker")).json()["hotLoad"]
            assert mid["status"]["state"] == "HOT_LOAD_STATE_IN_PROGRESS"
            assert [r["state"] for r in await replicas_of(f, "crash-worker")] == ["READY", "UPDATING", "PENDING_UPDATE"]

            proc = await start_control_process(address, f, tmp_path)
            end = await f.wait_hot_load("crash-worker", timeout=60)
            assert end["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", end["status"]
            assert [(r["state"], r["currentSnapshotIdentity"]) for r in await replicas_of(f, "crash-worker")] == [
                ("READY", "s1")
            ] * 3
            await f.wait_idle(dep, timeout=60)
            f.apply_behaviour = {}
            await f.completed(dep, "s1")  # the deployment admits the next one
        finally:
            kill9(proc)


class DevServer:
    """A Temporal dev server on a SQLite file, to kill -9 and restart on the same file and port."""

    def __init__(self, tmp: Path) -> None:
        self.db = tmp / "temporal.db"
        self.log = tmp / "temporal.log"
        self.port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        argv = [
            str(TEMPORAL_BIN), "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(self.port),
            "--http-port", str(self.http_port), "--metrics-port", str(self.metrics_port),
            "--db-filename", str(self.db), "--log-level", "error",
        ]
        for name, kind in SEARCH_ATTRIBUTES.items():
            argv += ["--search-attribute", f"{name}={kind}"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"))

        async def healthy() -> bool | None:
            health = await asyncio.create_subprocess_exec(
                str(TEMPORAL_BIN), "operator", "cluster", "health", "--address", self.address,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
            return True if await health.wait() == 0 else None

        await poll(healthy, 30, "Temporal dev server healthy", every=0.2)

    def kill9(self) -> None:
        if self.proc is not None:
            kill9(self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                kill9(self.proc)


async def test_temporal_dev_server_killed_mid_hot_load_then_restarted(tmp_path):
    server = DevServer(tmp_path)
    await server.start()
    try:
        client = await Client.connect(server.address, data_converter=pydantic_data_converter)
        async with Fleet(client, tmp_path) as f:
            dep = await f.ready_deployment(replicas=3)
            write_full(f.bucket_root / f"ckpt/{dep}", "s1")
            f.apply_behaviour = _every(f.held)
            assert (await f.create_hot_load(dep, "s1", hotLoadId="crash-server")).status_code == 200
            await asyncio.wait_for(f.started.wait(), 20)

            server.kill9()
            # Reads say so, retryably (cwtrain retries 503), instead of failing with a traceback.
            down = await f.call("GET", "/hotLoads/crash-server")
            assert down.status_code == 503 and down.json()["code"] == "unavailable", down.text

            await server.start()  # same SQLite file, same port
            f.hold.set()  # the held step completes once its worker reaches the server again
            end = await f.wait_hot_load("crash-server", timeout=90)
            assert end["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", end["status"]
            assert {r["state"] for r in await replicas_of(f, "crash-server")} == {"READY"}
            await f.wait_idle(dep, timeout=60)
            f.apply_behaviour = {}
            await f.completed(dep, "s2")  # the deployment admits the next one
    finally:
        server.stop()


async def test_create_dropped_mid_request_then_retried_with_the_same_id(temporal_env, tmp_path):
    """The API process dies while a create is in flight (here: the request is abandoned after the
    Update was sent). cwtrain retries with its client-chosen id: the answer is the operation, or
    already_exists and then a GET that finds it, never a second operation."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        request = asyncio.create_task(f.create_hot_load(dep, "s1", hotLoadId="dropped"))
        await asyncio.sleep(0.02)
        request.cancel()
        retry = await f.create_hot_load(dep, "s1", hotLoadId="dropped")
        assert retry.status_code in (200, 409), retry.text
        if retry.status_code == 409:
            assert (await f.call("GET", "/hotLoads/dropped")).status_code == 200
        end = await f.wait_hot_load("dropped")
        assert end["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        listed = (await f.call("GET", "/hotLoads", params={"parentDeploymentId": dep})).json()["hotLoads"]
        assert [h["spec"]["id"] for h in listed] == ["dropped"]
