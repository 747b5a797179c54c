"""Helpers shared by the workflow tests (test activities on the real Temporal dev server)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from contracts.records import (
    Deployment,
    DeploymentInput,
    DeploymentSpec,
    DeploymentStatus,
    HotLoadConfig,
    ModelSource,
    ResourceStatus,
    Runtime,
    SnapshotRef,
)
from tests.helpers.harness import ZONE, Fleet, poll
from tests.helpers.temporal_server import REPO


def error(r, status: int, code: str, *words: str) -> dict:
    body = r.json()
    assert r.status_code == status, (r.status_code, body)
    assert body["code"] == code, body
    for w in words:
        assert w in body["message"], body
    return body


def delta_body(prev: str) -> dict:
    return {
        "type": "SNAPSHOT_TYPE_INCREMENTAL",
        "incrementalSnapshotMetadata": {
            "previousSnapshotIdentity": prev,
            "compressionFormat": "COMPRESSION_FORMAT_ZSTD",
            "checksumFormat": "CHECKSUM_FORMAT_ADLER32",
        },
    }


def deployment_state(
    dep_id: str, *, zones: list[str], chains: dict[str, list[SnapshotRef]] | None = None
) -> DeploymentInput:
    dep = Deployment(
        spec=DeploymentSpec(
            id=dep_id,
            name=dep_id,
            organization_id="org-a",
            gateway_ids=["g1", "g2"],
            runtime=Runtime(engine="dynamo-vllm"),
            model=ModelSource(name="m", bucket="rollouts", path="models/base"),
            hot_load=HotLoadConfig(bucket="rollouts", path_prefix=f"ckpt/{dep_id}"),
        ),
        status=DeploymentStatus(
            status=ResourceStatus.READY, created_at="2026-01-01T00:00:00Z", updated_at="2026-01-01T00:00:00Z"
        ),
    )
    return DeploymentInput(deployment=dep, gateway_zones=zones, chains=chains or {})


async def on_base(f: Fleet, name: str, replicas: int, **hot_load: int) -> str:
    """A deployment of `replicas` whose replicas all serve the full snapshot "base", with these
    `hotLoad` settings (HotLoadConfig field names); the fleet's recorded events are cleared."""
    state = deployment_state(name, zones=[ZONE])
    for key, value in hot_load.items():
        setattr(state.deployment.spec.hot_load, key, value)
    state.replicas = f.replica_endpoints(name, replicas)
    dep = await f.deployment_from_state(state)
    await f.completed(dep, "base", hotLoadId=f"{name}-base")
    f.peer_events.clear()
    f.applied.clear()
    return dep


class every(dict):
    """Every replica behaves the same."""

    def __init__(self, behaviour) -> None:
        super().__init__()
        self.behaviour = behaviour

    def get(self, key, default=None):  # noqa: ARG002 - dict protocol
        return self.behaviour


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_control_process(address: str, f: Fleet, tmp: Path) -> subprocess.Popen:
    ready = tmp / f"control-{os.urandom(3).hex()}.ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.control_process", address, f.task_queue, str(f.bucket_root), str(ready)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "control.log", "ab"),
    )
    await poll(lambda: true_if(ready.exists()), 30, "control worker process ready", every=0.1)
    return proc


async def true_if(cond: bool) -> bool | None:
    return True if cond else None


def kill9(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
