"""Control-plane activities (task queue `rollouts-control`): placement and bucket checks.

The control worker starts no process: node agents run the replicas (replica/node/). Here:
`place_replicas` and `release_replicas` ask the node registry (control/nodes.py; a workflow cannot
call another workflow's Update, an activity can). `check_snapshot_files` is the admission check
of one snapshot of a resolved chain: its required files are there (a missing one is a
`failed_precondition` naming the files, never retried) and, for a snapshot verified before, its
fingerprint is the one it had then (a rewritten or removed file is a `failed_precondition` too);
it answers `[fingerprint]`. One S3 client serves every check.
"""

from __future__ import annotations

import threading
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from common.settings import Settings
from contracts import names
from contracts.activities import CheckSnapshotInput
from contracts.errors import FAILED_PRECONDITION
from contracts.nodes import PlaceRequest, ReleaseRequest
from contracts.records import Placement, SnapshotType
from snapshots.errors import SnapshotError
from snapshots.inspect import verify_required_files
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


def snapshot_changed(identity: str, uri: str) -> ApplicationError:
    """The admission error for a snapshot whose files changed since it joined the chain."""
    return ApplicationError(
        f"snapshot {identity!r} ({uri}) changed since it joined this deployment's chain (a required file "
        "was rewritten or its size changed): a replica that reads it now would not serve what the others "
        "serve; publish a full checkpoint to start a new chain",
        type=FAILED_PRECONDITION,
        non_retryable=True,
    )


def check_snapshot(inp: CheckSnapshotInput, location: Any, s3: Any = None) -> list[str]:
    """The admission check of one snapshot at `location` (its `s3://` URI, or a directory):
    `[fingerprint]`, or failed_precondition naming what is missing or that it changed."""
    uri = snapshot_uri(inp.bucket, inp.path_prefix, inp.identity)
    kind = "full" if inp.type == SnapshotType.FULL else "delta"
    try:
        found = verify_required_files(location, kind, s3=s3)
    except SnapshotError as exc:
        raise snapshot_check_failure(inp.identity, uri, exc=exc) from None
    if found.missing:
        raise snapshot_check_failure(inp.identity, uri, missing=found.missing)
    if inp.verified is not None and found.fingerprint != inp.verified:
        raise snapshot_changed(inp.identity, uri)
    return [found.fingerprint]


class ControlActivities:
    def __init__(self, settings: Settings, client: Client | None = None) -> None:
        self.settings = settings
        self.client = client
        self._s3: Any = None
        self._s3_lock = threading.Lock()

    def s3(self) -> Any:
        """One S3 client for every check (a boto3 client is thread-safe once built; building one
        costs more than a check's listing)."""
        with self._s3_lock:
            if self._s3 is None:
                self._s3 = self.settings.s3_client()
            return self._s3

    def _registry(self) -> WorkflowHandle[Any, Any]:
        assert self.client is not None, "the placement activities need a Temporal client"
        return self.client.get_workflow_handle(names.NODE_REGISTRY_ID)

    @activity.defn(name=names.PLACE_REPLICAS)
    async def place_replicas(self, req: PlaceRequest) -> dict[str, Placement]:
        """The registry's placement of these replicas (all or none); not enough capacity is a
        `failed_precondition` naming what is missing, never retried."""
        try:
            placed: dict[str, Placement] = await self._registry().execute_update(
                names.PLACE, req, result_type=dict[str, Placement]
            )
            return placed
        except WorkflowUpdateFailedError as exc:
            cause = exc.cause
            if isinstance(cause, ApplicationError) and cause.type == FAILED_PRECONDITION:
                raise ApplicationError(cause.message, type=FAILED_PRECONDITION, non_retryable=True) from None
            raise

    @activity.defn(name=names.RELEASE_REPLICAS)
    async def release_replicas(self, req: ReleaseRequest) -> int:
        released: int = await self._registry().execute_update(names.RELEASE, req, result_type=int)
        return released

    @activity.defn(name=names.CHECK_SNAPSHOT)
    def check_snapshot_files(self, inp: CheckSnapshotInput) -> list[str]:
        """`[fingerprint]`; failed_precondition naming the missing files, or saying it changed."""
        return check_snapshot(inp, snapshot_uri(inp.bucket, inp.path_prefix, inp.identity), s3=self.s3())
