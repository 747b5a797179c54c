"""Control-plane activities (task queue `rollouts-control`): placement and bucket checks.

The control worker starts no process: node agents run the replicas (replica/node/). Here:
`place_replicas` and `release_replicas` ask the node registry (control/nodes.py; a workflow cannot
call another workflow's Update, an activity can). `check_snapshot_files` is the admission check
that every snapshot of a resolved chain has its required files; a missing file is a
`failed_precondition` naming the files, and is never retried. `start_replicas`/`stop_replicas`
on this queue only answer deployments created before node agents, with a final error saying so.
"""

from __future__ import annotations

from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from common.settings import Settings
from contracts import names
from contracts.activities import CheckSnapshotInput, StartReplicasInput, StopReplicasInput
from contracts.errors import FAILED_PRECONDITION
from contracts.nodes import PlaceRequest, ReleaseRequest
from contracts.records import Placement, SnapshotType
from snapshots.errors import SnapshotError
from snapshots.inspect import check_required_files
from snapshots.storage import snapshot_uri

LEGACY_MESSAGE = (
    "deployment {deployment} was created before node agents and schedules its replica processes on "
    "the control worker, which no longer runs any: recreate the deployment (docs/operations.md, "
    "upgrading to node agents)"
)


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
    def __init__(self, settings: Settings, client: Client | None = None) -> None:
        self.settings = settings
        self.client = client

    def _registry(self):
        assert self.client is not None, "the placement activities need a Temporal client"
        return self.client.get_workflow_handle(names.NODE_REGISTRY_ID)

    @activity.defn(name=names.PLACE_REPLICAS)
    async def place_replicas(self, req: PlaceRequest) -> dict[str, Placement]:
        """The registry's placement of these replicas (all or none); not enough capacity is a
        `failed_precondition` naming what is missing, never retried."""
        try:
            return await self._registry().execute_update(names.PLACE, req, result_type=dict[str, Placement])
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == FAILED_PRECONDITION:
                raise ApplicationError(cause.message, type=FAILED_PRECONDITION, non_retryable=True) from None
            raise

    @activity.defn(name=names.RELEASE_REPLICAS)
    async def release_replicas(self, req: ReleaseRequest) -> int:
        return await self._registry().execute_update(names.RELEASE, req, result_type=int)

    @activity.defn(name=names.START_REPLICAS)
    def legacy_start_replicas(self, inp: StartReplicasInput) -> list[str]:
        """Deployments created before node agents schedule replica starts here; the control
        worker no longer runs replicas, so they get a clear, final error."""
        raise ApplicationError(LEGACY_MESSAGE.format(deployment=inp.deployment_id), type=FAILED_PRECONDITION,
                               non_retryable=True)

    @activity.defn(name=names.STOP_REPLICAS)
    def legacy_stop_replicas(self, inp: StopReplicasInput) -> int:
        raise ApplicationError(LEGACY_MESSAGE.format(deployment=inp.deployment_id), type=FAILED_PRECONDITION,
                               non_retryable=True)

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
