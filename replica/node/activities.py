"""The node agent's activities (task queue `nodes/NAME`): the replica processes on this machine.

`start_replicas` launches each named replica as a detached `rollouts replica` process (pid file
under the node's home, so a restarted node agent, and `rollouts down`, find it); the replica
reports itself ready to its deployment workflow by signal. A GPU replica gets the devices its
placement names as `CUDA_VISIBLE_DEVICES` (mapped through the agent's own); its engine binds the node's engine address
and advertises the node's address. `stop_replicas` stops them by pid, all at once (each stops its engine). Both are
idempotent: a retry, or the deployment's periodic check, starts nothing twice and stops nothing twice.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from temporalio import activity

from common.processes import PidFile, spawn, stop_pids
from contracts import names
from contracts.activities import ApplySnapshotInput, StartReplicasInput, StopReplicasInput


@dataclass
class NodeIdentity:
    """What a node agent knows of itself and hands to the replicas it starts."""

    name: str
    address: str
    zone: str
    engine_bind: str
    home: Path


def visible_devices(devices: list[int], own: str | None = None) -> str:
    """`CUDA_VISIBLE_DEVICES` for a replica given device indices counted from 0 as this node
    agent sees them: through the agent's own `CUDA_VISIBLE_DEVICES` when it has one (Slurm or a
    container runtime may hand it e.g. "4,5": index 0 is device 4)."""
    own = os.environ.get("CUDA_VISIBLE_DEVICES") if own is None else own
    mine = [d.strip() for d in own.split(",") if d.strip()] if own else []
    return ",".join(mine[d] if d < len(mine) else str(d) for d in devices)


def replica_dir(home: Path, deployment_id: str, name: str) -> Path:
    return home / "replicas" / deployment_id / name


def running_replicas(home: Path) -> dict[Path, int]:
    """Every replica directory under `home` whose process runs -> its pid."""
    out: dict[Path, int] = {}
    for pid_path in sorted((home / "replicas").glob("*/*/replica.pid")):
        pid = PidFile(pid_path).alive_pid()
        if pid is not None:
            out[pid_path.parent] = pid
    return out


class NodeActivities:
    def __init__(self, node: NodeIdentity) -> None:
        self.node = node

    def _argv(self, inp: StartReplicasInput, name: str) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "workers.cli",
            "replica",
            "--home",
            str(self.node.home),
            "--deployment",
            inp.deployment_id,
            "--name",
            name,
            "--workflow-id",
            inp.deployment_workflow_id,
            "--zone",
            inp.zone,
            "--model-bucket",
            inp.model.bucket,
            "--model-path",
            inp.model.path,
            "--model-name",
            inp.model.name,
            "--engine",
            inp.engine,
            "--engine-config",
            json.dumps(inp.engine_config),
            "--node",
            self.node.name,
            "--node-address",
            self.node.address,
            "--engine-bind",
            self.node.engine_bind,
        ]
        if inp.target_chain and inp.hot_load_config:
            catch_up = ApplySnapshotInput(
                hot_load_id="catch-up",
                identity=inp.target_chain[-1].identity,
                chain=inp.target_chain,
                bucket=inp.hot_load_config.bucket,
                path_prefix=inp.hot_load_config.path_prefix,
            )
            argv += ["--catch-up", catch_up.model_dump_json(by_alias=True)]
        if inp.joining:
            argv.append("--joining")
        return argv

    @activity.defn(name=names.START_REPLICAS)
    def start_replicas(self, inp: StartReplicasInput) -> list[str]:
        """Start each named replica whose process is not running; returns the names started.

        With `target_chain`, a replica loads that chain from the bucket before it reports ready."""
        started = []
        for name in inp.names:
            workdir = replica_dir(self.node.home, inp.deployment_id, name)
            workdir.mkdir(parents=True, exist_ok=True)
            pid_file = PidFile(workdir / "replica.pid")
            if pid_file.alive_pid() is not None:  # an activity retry must not start a second copy
                continue
            env = {}
            placement = inp.placements.get(name)
            if placement is not None and placement.devices:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices(placement.devices)
            pid = spawn(
                self._argv(inp, name),
                log_path=workdir / "replica.log",
                pid_file=pid_file,
                env=env,
                workflow_id=inp.deployment_workflow_id,
            )
            activity.logger.info(
                "started replica %s of %s (pid %d) on %s", name, inp.deployment_id, pid, self.node.name
            )
            started.append(name)
        return started

    @activity.defn(name=names.STOP_REPLICAS)
    def stop_replicas(self, inp: StopReplicasInput) -> int:
        # All at once: each agent stops its engine in parallel with the others.
        pid_files = [
            PidFile(replica_dir(self.node.home, inp.deployment_id, name) / "replica.pid") for name in inp.names
        ]
        pids = [pid for pf in pid_files if (pid := pf.alive_pid()) is not None]
        stopped = stop_pids(pids, timeout=30, waiting=lambda: activity.heartbeat(len(pids)))
        for pf in pid_files:
            pf.remove()
        return len(stopped)
