"""Control-plane activities (task queue `rollouts-control`): replica processes and bucket checks.

`start_replicas` launches each replica as a detached `rollouts replica` process on this machine
(pid file under the stack home, so `rollouts down` stops it); the replica reports itself ready to
its deployment workflow by signal. `check_snapshot_files` is the admission check that every
snapshot of a resolved chain has its required files; a missing file is a `failed_precondition`
naming the files, and is never retried.
"""

from __future__ import annotations

import json
import sys

from temporalio import activity
from temporalio.exceptions import ApplicationError

from common.processes import PidFile, spawn, stop_pid
from common.settings import Settings
from contracts import names
from contracts.activities import ApplySnapshotInput, CheckSnapshotInput, StartReplicasInput, StopReplicasInput
from contracts.errors import FAILED_PRECONDITION
from contracts.records import SnapshotType
from snapshots.errors import SnapshotError
from snapshots.inspect import check_required_files
from snapshots.storage import snapshot_uri


def snapshot_check_failure(
    identity: str, uri: str, *, missing: list[str] | None = None, exc: BaseException | None = None
) -> ApplicationError:
    """The admission error for an incomplete or malformed snapshot: `failed_precondition`, never
    retried, naming the snapshot, where it was looked for and each missing file."""
    if missing:
        message = f"snapshot {identity!r} ({uri}) is missing required files: {', '.join(missing)}"
    else:
        message = f"snapshot {identity!r} ({uri}): {exc}"
    return ApplicationError(message, type=FAILED_PRECONDITION, non_retryable=True)


class ControlActivities:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def _replica_dir(self, deployment_id: str, name: str):
        return self.settings.home_path / "replicas" / deployment_id / name

    @activity.defn(name=names.START_REPLICAS)
    def start_replicas(self, inp: StartReplicasInput) -> list[str]:
        """Start each named replica whose process is not running; returns the names started.

        Idempotent: a retry, or the deployment's check of its replicas (periodic, at admission,
        and `verify_replicas` when the control worker starts; one at a time per deployment),
        starts nothing twice, so the names returned are the replicas that were gone. With
        `target_chain`, a replica loads that chain from the bucket before it reports ready."""
        started = []
        for name in inp.names:
            workdir = self._replica_dir(inp.deployment_id, name)
            workdir.mkdir(parents=True, exist_ok=True)
            pid_file = PidFile(workdir / "replica.pid")
            pid = pid_file.alive_pid()
            if pid is None:  # an activity retry must not start a second copy
                argv = [
                    sys.executable, "-m", "workers.cli", "replica",
                    "--home", self.settings.home,
                    "--deployment", inp.deployment_id,
                    "--name", name,
                    "--workflow-id", inp.deployment_workflow_id,
                    "--zone", inp.zone,
                    "--model-bucket", inp.model.bucket,
                    "--model-path", inp.model.path,
                    "--model-name", inp.model.name,
                    "--engine-config", json.dumps(inp.engine_config),
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
                pid = spawn(argv, log_path=workdir / "replica.log", pid_file=pid_file)
                activity.logger.info("started replica %s (pid %d)", name, pid)
                started.append(name)
        return started

    @activity.defn(name=names.STOP_REPLICAS)
    def stop_replicas(self, inp: StopReplicasInput) -> int:
        stopped = 0
        for name in inp.names:
            pid_file = PidFile(self._replica_dir(inp.deployment_id, name) / "replica.pid")
            pid = pid_file.alive_pid()
            if pid is not None:
                activity.heartbeat(name)
                stop_pid(pid, timeout=30)
                stopped += 1
            pid_file.remove()
        return stopped

    @activity.defn(name=names.CHECK_SNAPSHOT)
    def check_snapshot_files(self, inp: CheckSnapshotInput) -> list[str]:
        """Raises failed_precondition naming the missing files; returns [] when complete."""
        uri = snapshot_uri(inp.bucket, inp.path_prefix, inp.identity)
        kind = "full" if inp.type == SnapshotType.FULL else "delta"
        try:
            missing = check_required_files(uri, kind, s3=self.settings.s3_client())
        except SnapshotError as exc:
            raise snapshot_check_failure(inp.identity, uri, exc=exc) from None
        if missing:
            raise snapshot_check_failure(inp.identity, uri, missing=missing)
        return []
