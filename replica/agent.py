"""One replica: a vLLM engine, the host copy of its weights, and its Temporal agent.

`run_replica` downloads the deployment's model from the bucket, starts the engine (a stock vLLM
OpenAI server with our worker extension), loads the host copy of the weights (checkpoint format,
what deltas apply to), starts a Temporal worker on the replica's own task queue (running
`activities.replica_step`), and tells its deployment workflow it is ready. If the engine dies,
the replica reports the failure to its deployment and exits; SIGTERM stops the engine and exits.

`ReplicaRuntime` owns the all-or-nothing bookkeeping of an update: staging (host copy first,
nothing the engine sees), commit, and roll-back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from workers.processes import free_port
from workers.settings import Settings, temporal_client
from workflows import names
from workflows.types import (
    ApplySnapshotInput,
    ReplicaEndpoint,
    ReplicaFailure,
    SnapshotRef,
    SnapshotType,
    rfc3339,
)

log = logging.getLogger("rollouts.replica")


def engine_alive(engine: Any) -> bool:
    from replica.engine import _pid_alive

    return engine.pid is not None and _pid_alive(engine.pid)


def one_line(exc: BaseException, limit: int = 400) -> str:
    """The first and last lines of an error (an engine's start error carries its log tail)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def snapshot_uri(bucket: str, path_prefix: str, identity: str) -> str:
    prefix = path_prefix.strip("/")
    return f"s3://{bucket}/{prefix + '/' if prefix else ''}{identity}/"


@dataclass
class StagedUpdate:
    """An update prepared off the serving path; nothing the engine sees has changed yet."""

    names: list[str] = field(default_factory=list)
    path: Path | None = None
    links: list[str] = field(default_factory=list)
    bytes_read: int = 0
    new_host: Any = None  # a new HostWeights when the chain starts from another full base
    backups: dict[str, np.ndarray] = field(default_factory=dict)  # old bytes of in-place changes
    nothing_to_do: bool = False


class ReplicaRuntime:
    """State shared by the agent's activities: the engine, the host copy and what it serves."""

    def __init__(self, *, engine: Any, host: Any, s3: Any, workdir: Path) -> None:
        self.engine = engine
        self.host = host
        self.s3 = s3
        self.workdir = workdir
        self.staging = workdir / "staging"
        # Identities of the chain the replica serves, full base first; ["initial"] at start.
        self.applied: list[str] = ["initial"]
        self.lock = asyncio.Lock()

    @property
    def current_identity(self) -> str:
        return self.applied[-1]

    # ------------------------------------------------------------------ staging
    def stage_chain(self, inp: ApplySnapshotInput) -> StagedUpdate:
        from snapshots.host import HostWeights
        from snapshots.inspect import read_delta_plan

        wanted = [link.identity for link in inp.chain]
        if self.applied == wanted:
            return StagedUpdate(nothing_to_do=True)
        staged = StagedUpdate()
        if not inp.chain or inp.chain[0].type != SnapshotType.FULL:
            from snapshots.errors import ChainError

            raise ChainError("the snapshot chain must start with a full snapshot")
        have = len(self.applied)
        incremental = have < len(wanted) and self.applied == wanted[:have] and self.applied[0] != "initial"
        if incremental:
            todo: list[SnapshotRef] = inp.chain[have:]
            target = self.host
        else:
            base = inp.chain[0]
            uri = snapshot_uri(inp.bucket, inp.path_prefix, base.identity)
            target = HostWeights.load(uri, s3=self.s3)
            staged.new_host = target
            staged.bytes_read += target.total_bytes
            staged.links.append(base.identity)
            todo = inp.chain[1:]
        changed: set[str] = set()
        try:
            for link in todo:
                uri = snapshot_uri(inp.bucket, inp.path_prefix, link.identity)
                plan = read_delta_plan(uri, s3=self.s3)
                if staged.new_host is None:
                    for name in plan.tensors:
                        if name not in staged.backups and name in target:
                            staged.backups[name] = target.raw(name).copy()
                changed.update(target.apply_delta(plan.uri, s3=self.s3))
                staged.bytes_read += plan.wire_bytes
                staged.links.append(link.identity)
        except Exception:
            self._restore(staged)
            raise
        staged.names = sorted(target.names() if staged.new_host is not None else changed)
        staged.path = self._write_staging(target, staged.names, inp.identity)
        return staged

    def _write_staging(self, host: Any, names_: list[str], identity: str) -> Path:
        from safetensors.torch import save_file

        self.staging.mkdir(parents=True, exist_ok=True)
        path = self.staging / f"{identity}.safetensors"
        save_file({n: host.tensor(n).contiguous() for n in names_}, str(path))
        return path

    def _restore(self, staged: StagedUpdate) -> None:
        self.host.restore(staged.backups)

    # ------------------------------------------------------------------ outcome
    def commit(self, staged: StagedUpdate, inp: ApplySnapshotInput) -> None:
        if staged.new_host is not None:
            self.host = staged.new_host
        self.applied = [link.identity for link in inp.chain]
        if staged.path is not None:
            staged.path.unlink(missing_ok=True)

    async def roll_back(self, staged: StagedUpdate) -> None:
        """Give the engine back the tensors it had, and the host copy its bytes."""
        self._restore(staged)
        if not staged.names:
            return
        path = self._write_staging(self.host, staged.names, "rollback")
        await self.engine.pause(mode="keep", clear_cache=False)
        try:
            await self.engine.load_weights_from_files([str(path)], staged.names)
        finally:
            await self.engine.resume()
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------- process
def download_prefix(s3: Any, bucket: str, prefix: str, dest: Path) -> int:
    """Copy the top-level objects under `prefix/` into `dest`; returns bytes downloaded."""
    dest.mkdir(parents=True, exist_ok=True)
    prefix = prefix.strip("/") + "/"
    total = 0
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix):]
            if not name or "/" in name:
                continue
            target = dest / name
            if not target.exists() or target.stat().st_size != obj["Size"]:
                tmp = target.with_suffix(target.suffix + ".part")
                s3.download_file(bucket, obj["Key"], str(tmp))
                tmp.replace(target)
                total += obj["Size"]
    if not any(dest.iterdir()):
        raise FileNotFoundError(f"no objects under s3://{bucket}/{prefix}")
    return total


async def run_replica(
    settings: Settings,
    *,
    deployment_id: str,
    name: str,
    workflow_id: str,
    zone: str,
    model_bucket: str,
    model_path: str,
    model_name: str,
) -> int:
    from temporalio.worker import Worker

    from activities.replica_step import ReplicaActivities
    from replica.engine import EngineProcess
    from snapshots.host import HostWeights

    workdir = settings.home_path / "replicas" / deployment_id / name
    client = await temporal_client(settings)
    deployment = client.get_workflow_handle(workflow_id)
    s3 = settings.s3_client()
    engine = None
    try:
        model_dir = workdir / "model"
        await asyncio.to_thread(download_prefix, s3, model_bucket, model_path, model_dir)
        port = free_port()
        engine = EngineProcess(
            model_dir,
            # vLLM binds IPC sockets under the engine's TMPDIR, and a socket path must stay under
            # 108 bytes: keep it short, outside the (possibly deep) stack home.
            work_dir=Path(tempfile.gettempdir()) / "rollouts-engines" / name,
            served_model_name=model_name,
            port=port,
            log_path=workdir / "engine.log",
        )
        await engine.start()
        host = await asyncio.to_thread(HostWeights.load, model_dir)
    except Exception as exc:  # noqa: BLE001 - reported to the deployment, then exit
        log.exception("replica %s failed to start", name)
        await deployment.signal(
            "replica_failed", ReplicaFailure(name=name, reason=f"start failed: {one_line(exc)}; log {workdir}")
        )
        if engine is not None:
            await engine.stop()
        return 1

    runtime = ReplicaRuntime(engine=engine, host=host, s3=s3, workdir=workdir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task_queue = names.replica_task_queue(deployment_id, name)
    worker = Worker(client, task_queue=task_queue, activities=[ReplicaActivities(runtime).apply_snapshot])
    code = 0
    async with worker:
        now = rfc3339(datetime.now(UTC))
        await deployment.signal(
            "replica_ready",
            ReplicaEndpoint(
                name=name, zone=zone, task_queue=task_queue, engine_url=engine.base_url,
                engine_pid=engine.pid, agent_pid=os.getpid(), current_snapshot_identity="initial",
                started_at=now, transitioned_at=now,
            ),
        )
        log.info("replica %s ready: engine %s (pid %d), queue %s", name, engine.base_url, engine.pid, task_queue)
        while not stop.is_set():
            if not engine_alive(engine):
                reason = f"engine process {engine.pid} exited; log {engine.log_path}"
                log.error(reason)
                try:
                    await deployment.signal("replica_failed", ReplicaFailure(name=name, reason=reason))
                except Exception:  # noqa: BLE001
                    pass
                code = 1
                break
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
    await engine.stop()
    shutil.rmtree(runtime.staging, ignore_errors=True)
    return code
