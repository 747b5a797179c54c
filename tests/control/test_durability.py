"""Crashes in the middle of a multi-replica hot-load, on the real Temporal dev server: the control
worker killed -9 (a process of its own), the Temporal dev server killed -9 and restarted on the
same SQLite file, the API process (`rollouts api`, real HTTP) killed -9 mid-operation and while a
create is in flight, the API dropping a create mid-request. After each, the operation goes on and
ends in a documented terminal state, nothing stays IN_PROGRESS, no replica is left mid-step, a
create retried with its hotLoadId yields one operation, and the deployment admits the next
hot-load. Replicas are test activities in this process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from api.app import PREFIX
from common.settings import SEARCH_ATTRIBUTES
from contracts import names
from contracts.activities import CheckSnapshotInput
from contracts.records import TERMINAL_HOT_LOAD_STATES
from rollouts.client import hot_load_body
from tests.helpers.harness import ADMIN, ZONE, Fleet, poll, write_full
from tests.helpers.temporal_server import REPO, TEMPORAL_BIN
from tests.helpers.workflow_checks import deployment_state, every, free_port, kill9, start_control_process, true_if


async def test_control_worker_killed_mid_hot_load_then_restarted(temporal_env, tmp_path):
    address = temporal_env.client.service_client.config.target_host
    async with Fleet(temporal_env.client, tmp_path, control_worker=False) as f:
        proc = await start_control_process(address, f, tmp_path)
        try:
            state = deployment_state("dep-crash-worker", zones=[ZONE])
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
            assert [r["state"] for r in await f.hot_load_replicas("crash-worker")] == [
                "READY",
                "UPDATING",
                "PENDING_UPDATE",
            ]

            proc = await start_control_process(address, f, tmp_path)
            end = await f.wait_hot_load("crash-worker", timeout=60)
            assert end["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", end["status"]
            assert [(r["state"], r["currentSnapshotIdentity"]) for r in await f.hot_load_replicas("crash-worker")] == [
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
            str(TEMPORAL_BIN),
            "server",
            "start-dev",
            "--headless",
            "--ip",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            "--metrics-port",
            str(self.metrics_port),
            "--db-filename",
            str(self.db),
            "--log-level",
            "error",
        ]
        for name, kind in SEARCH_ATTRIBUTES.items():
            argv += ["--search-attribute", f"{name}={kind}"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"))

        async def healthy() -> bool | None:
            health = await asyncio.create_subprocess_exec(
                str(TEMPORAL_BIN),
                "operator",
                "cluster",
                "health",
                "--address",
                self.address,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
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
            f.apply_behaviour = every(f.held)
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
            assert {r["state"] for r in await f.hot_load_replicas("crash-server")} == {"READY"}
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


class ApiProcess:
    """`rollouts api` as the stack starts it (workers/cli.py), on the test's Temporal server and
    tokens file, on one port across restarts; killed with SIGKILL, restarted on the same home."""

    def __init__(self, f: Fleet, temporal_address: str, tmp: Path) -> None:
        self.port = free_port()
        # The fleet's home holds the tokens file; the process finds everything else in stack.json.
        dataclasses.replace(f.settings, ports={**f.settings.ports, "api": self.port}).save()
        self.argv = [sys.executable, "-m", "workers.cli", "api", "--home", f.settings.home]
        self.env = {**os.environ, "TEMPORAL_ADDRESS": temporal_address}
        self.log = tmp / "api.log"
        self.url = f"http://127.0.0.1:{self.port}{PREFIX}"
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            cwd=REPO,
            env=self.env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "ab"),
        )

        async def healthy() -> bool | None:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                async with httpx.AsyncClient(timeout=2) as http:
                    return (
                        True if (await http.get(f"http://127.0.0.1:{self.port}/healthz")).status_code == 200 else None
                    )
            except httpx.TransportError:
                return None

        await poll(healthy, 60, "API process healthy", every=0.1)

    def http(self) -> httpx.AsyncClient:
        # A client per process lifetime: a pooled connection to a killed process is dead.
        return httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)

    def kill9(self) -> None:
        if self.proc is not None:
            kill9(self.proc)


class HeldCheckFleet(Fleet):
    """A fleet whose admission file check (an activity inside the create Update) waits while
    `checks_open` is clear: a create is then in flight inside the API process, to kill it there."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.checks_open = threading.Event()
        self.checks_open.set()
        self.check_started = threading.Event()

    @activity.defn(name=names.CHECK_SNAPSHOT)
    def check_snapshot_files(self, inp: CheckSnapshotInput) -> list[str]:
        self.check_started.set()
        self.checks_open.wait(60)
        return super().check_snapshot_files(inp)


async def _until_terminal(http: httpx.AsyncClient, hl: str) -> dict:
    async def check() -> dict | None:
        got = (await http.get(f"/hotLoads/{hl}")).json()["hotLoad"]
        return got if got["status"]["state"] in TERMINAL_HOT_LOAD_STATES else None

    return await poll(check, 90, f"hot-load {hl} terminal", every=0.1)


async def test_api_process_killed_mid_hot_load_and_mid_create_then_restarted(temporal_env, tmp_path):
    """Crash table: `rollouts api` killed -9 while a 3-replica hot-load it created is in its
    second replica step -> after restart the operation reads IN_PROGRESS (READY, UPDATING,
    PENDING_UPDATE) and ends COMPLETED with every replica READY on the target. Killed -9 while a
    create is inside the deployment's admission (response lost) -> the client's retry with the
    same hotLoadId answers already_exists, and exactly one operation exists and completes."""
    address = temporal_env.client.service_client.config.target_host
    async with HeldCheckFleet(temporal_env.client, tmp_path) as f:
        api = ApiProcess(f, address, tmp_path)
        try:
            dep = await f.ready_deployment(replicas=3)
            for identity in ("s1", "s2"):
                write_full(f.bucket_root / f"ckpt/{dep}", identity)
            steps: list[str] = []

            async def second_step_held(replica: str, inp) -> None:
                steps.append(replica)
                if len(steps) == 2:
                    await f.held(replica, inp)  # the second replica's step waits for `hold`
                else:
                    await asyncio.sleep(f.apply_delay)

            f.apply_behaviour = every(second_step_held)

            # 1. Killed mid-operation: the operation does not need the API.
            await api.start()
            async with api.http() as http:
                created = await http.post("/hotLoads", json=hot_load_body(dep, "s1", hot_load_id="api-crash"))
                assert created.status_code == 200, created.text
                await asyncio.wait_for(f.started.wait(), 30)
                api.kill9()
            await api.start()
            async with api.http() as http:
                mid = (await http.get("/hotLoads/api-crash")).json()["hotLoad"]
                assert mid["status"]["state"] == "HOT_LOAD_STATE_IN_PROGRESS", mid["status"]
                replicas = (await http.get("/hotLoads/api-crash/replicas")).json()["replicas"]
                assert [r["state"] for r in replicas] == ["READY", "UPDATING", "PENDING_UPDATE"]
                f.hold.set()
                end = await _until_terminal(http, "api-crash")
                assert end["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", end["status"]
                replicas = (await http.get("/hotLoads/api-crash/replicas")).json()["replicas"]
                assert [(r["state"], r["currentSnapshotIdentity"]) for r in replicas] == [("READY", "s1")] * 3
            await f.wait_idle(dep)

            # 2. Killed while a create is being admitted: its response is lost.
            f.checks_open.clear()
            f.check_started.clear()
            body = {"deploymentId": dep, "identity": "s2", "type": "SNAPSHOT_TYPE_FULL", "hotLoadId": "lost"}
            async with api.http() as http:
                lost = asyncio.create_task(http.post("/hotLoads", json=body))
                await poll(lambda: true_if(f.check_started.is_set()), 30, "admission check started")
                api.kill9()
                with pytest.raises(httpx.TransportError):
                    await lost  # the response is lost with the process
            await api.start()
            async with api.http() as http:
                retry = asyncio.create_task(http.post("/hotLoads", json=body))
                await asyncio.sleep(0.2)  # the retry meets the first create still in admission
                f.checks_open.set()
                again = await retry
                assert again.status_code == 409 and again.json()["code"] == "already_exists", again.text
                assert (await http.get("/hotLoads/lost")).status_code == 200  # what cwtrain does next
                end = await _until_terminal(http, "lost")
                assert end["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", end["status"]
                replicas = (await http.get("/hotLoads/lost/replicas")).json()["replicas"]
                assert [(r["state"], r["currentSnapshotIdentity"]) for r in replicas] == [("READY", "s2")] * 3
                listed = (await http.get("/hotLoads", params={"parentDeploymentId": dep})).json()["hotLoads"]
                assert [(h["spec"]["id"], h["status"]["state"]) for h in listed] == [
                    ("lost", "HOT_LOAD_STATE_COMPLETED"),
                    ("api-crash", "HOT_LOAD_STATE_COMPLETED"),
                ]
            await f.wait_idle(dep)
            f.apply_behaviour = {}
            await f.completed(dep, "s3")  # the deployment admits the next one
        finally:
            f.checks_open.set()
            api.kill9()
