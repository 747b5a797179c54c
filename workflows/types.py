"""The records the workflows keep, shaped exactly as the wire objects of the guide.

Workflows hold these as state, publish them in their memo (so reads never need a worker) and
the API returns them as they are: camelCase JSON, enums as proto names, RFC 3339 UTC timestamps.
Nothing here talks to Temporal, HTTP or storage.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class WireModel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def wire(self) -> dict[str, Any]:
        """JSON as the API sends it: camelCase, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


def rfc3339(dt: datetime) -> str:
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


# --------------------------------------------------------------------------- enums
class SnapshotType(str, Enum):
    FULL = "SNAPSHOT_TYPE_FULL"
    INCREMENTAL = "SNAPSHOT_TYPE_INCREMENTAL"


class CompressionFormat(str, Enum):
    ZSTD = "COMPRESSION_FORMAT_ZSTD"


class ChecksumFormat(str, Enum):
    ADLER32 = "CHECKSUM_FORMAT_ADLER32"


class PromptCachePolicy(str, Enum):
    PRESERVE = "PROMPT_CACHE_POLICY_PRESERVE"
    RESET_ALL = "PROMPT_CACHE_POLICY_RESET_ALL"


class HotLoadState(str, Enum):
    PENDING = "HOT_LOAD_STATE_PENDING"
    IN_PROGRESS = "HOT_LOAD_STATE_IN_PROGRESS"
    COMPLETED = "HOT_LOAD_STATE_COMPLETED"
    FAILED = "HOT_LOAD_STATE_FAILED"
    CANCELED = "HOT_LOAD_STATE_CANCELED"

    @property
    def terminal(self) -> bool:
        return self in (HotLoadState.COMPLETED, HotLoadState.FAILED, HotLoadState.CANCELED)


class ReplicaState(str, Enum):
    PENDING_UPDATE = "PENDING_UPDATE"
    UPDATING = "UPDATING"
    READY = "READY"
    ERROR = "ERROR"


class ResourceStatus(str, Enum):
    CREATING = "STATUS_CREATING"
    UPDATING = "STATUS_UPDATING"
    DELETING = "STATUS_DELETING"
    ERROR = "STATUS_ERROR"
    FAILED = "STATUS_FAILED"
    READY = "STATUS_READY"


class ConditionStatus(str, Enum):
    TRUE = "STATUS_TRUE"
    FALSE = "STATUS_FALSE"
    UNKNOWN = "STATUS_UNKNOWN"


class TransitionMode(str, Enum):
    ASYNC = "TRANSITION_MODE_ASYNC"


# Proto enums also travel as integers (cwtrain parses both); these are the proto numbers.
ENUM_NUMBERS: dict[type[Enum], list[Enum | None]] = {
    SnapshotType: [None, SnapshotType.FULL, SnapshotType.INCREMENTAL],
    CompressionFormat: [None, CompressionFormat.ZSTD],
    ChecksumFormat: [None, ChecksumFormat.ADLER32],
    PromptCachePolicy: [None, PromptCachePolicy.RESET_ALL, PromptCachePolicy.PRESERVE],
    TransitionMode: [None, TransitionMode.ASYNC],
}


# --------------------------------------------------------------------------- shared
class Condition(WireModel):
    type: str
    status: ConditionStatus
    reason: str = ""
    message: str = ""
    zone: str | None = None
    last_update_time: str | None = None


# --------------------------------------------------------------------------- gateways
class GatewaySpec(WireModel):
    id: str
    name: str
    organization_id: str
    zones: list[str] = Field(default_factory=list)


class GatewayStatus(WireModel):
    status: ResourceStatus
    endpoints: list[str] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)
    created_at: str | None = None
    updated_at: str | None = None


class Gateway(WireModel):
    spec: GatewaySpec
    status: GatewayStatus


# --------------------------------------------------------------------------- deployments
class Runtime(WireModel):
    engine: str
    version: str = ""
    engine_config: dict[str, str] = Field(default_factory=dict)


class Resources(WireModel):
    instance_type: str = ""
    gpu_count: int = 0


class ModelSource(WireModel):
    name: str
    bucket: str
    path: str


class Autoscaling(WireModel):
    min: int = 1
    max: int = 1


class Traffic(WireModel):
    """A deployment's share of its model name's requests, relative to the other deployments of
    that name on a gateway (0: none; the API accepts 0-100)."""

    weight: int = 100


class HotLoadConfig(WireModel):
    bucket: str
    path_prefix: str = ""
    transition_mode: TransitionMode = TransitionMode.ASYNC


class DeploymentSpec(WireModel):
    id: str
    name: str
    organization_id: str
    gateway_ids: list[str] = Field(default_factory=list)
    runtime: Runtime
    resources: Resources = Field(default_factory=Resources)
    model: ModelSource
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    traffic: Traffic = Field(default_factory=Traffic)
    hot_load: HotLoadConfig | None = None


class DeploymentStatus(WireModel):
    status: ResourceStatus
    conditions: list[Condition] = Field(default_factory=list)
    created_at: str | None = None
    updated_at: str | None = None
    # Beyond the guide: what the deployment serves now and the operation running, if any.
    current_snapshot_identity: str | None = None
    active_hot_load_id: str | None = None
    ready_replicas: int | None = None


class Deployment(WireModel):
    spec: DeploymentSpec
    status: DeploymentStatus


# --------------------------------------------------------------------------- hot-loads
class IncrementalSnapshotMetadata(WireModel):
    previous_snapshot_identity: str
    compression_format: CompressionFormat = CompressionFormat.ZSTD
    checksum_format: ChecksumFormat = ChecksumFormat.ADLER32


class SnapshotRef(WireModel):
    identity: str
    type: SnapshotType
    hot_load_id: str | None = None
    compression_format: CompressionFormat | None = None
    checksum_format: ChecksumFormat | None = None


class HotLoadSpec(WireModel):
    id: str
    deployment_id: str
    organization_id: str
    identity: str
    type: SnapshotType
    incremental_snapshot_metadata: IncrementalSnapshotMetadata | None = None
    prompt_cache_policy: PromptCachePolicy = PromptCachePolicy.PRESERVE
    snapshot_chain: list[SnapshotRef] = Field(default_factory=list)


class HotLoadStatus(WireModel):
    state: HotLoadState
    created_at: str
    updated_at: str
    finished_at: str | None = None
    canceled_at: str | None = None
    conditions: list[Condition] = Field(default_factory=list)
    # Beyond the guide: the Temporal UI page of this operation.
    workflow_url: str | None = None


class HotLoad(WireModel):
    spec: HotLoadSpec
    status: HotLoadStatus


class Replica(WireModel):
    name: str
    state: ReplicaState
    zone: str = ""
    current_snapshot_identity: str = ""
    error_reason: str | None = None
    started_at: str | None = None
    finished_at: str | None = None
    transitioned_at: str | None = None
    updated_at: str | None = None
    # Beyond the guide: how this replica's last step went (where its weights came from, bytes
    # read from the bucket, the pause window, tensors whose served bytes were proven).
    source: str | None = None
    bytes_read_from_bucket: int | None = None
    pause_ms: float | None = None
    verified_tensors: int | None = None


# --------------------------------------------------------------------------- internal
class ReplicaEndpoint(WireModel):
    """A running replica as the deployment workflow knows it (not a wire object)."""

    name: str
    zone: str
    task_queue: str
    engine_url: str
    engine_pid: int
    agent_pid: int
    current_snapshot_identity: str = "initial"
    started_at: str | None = None
    transitioned_at: str | None = None


class ReplicaFailure(WireModel):
    name: str
    reason: str


class HotLoadInput(WireModel):
    """What the deployment workflow hands to a hot-load workflow it admitted."""

    hot_load: HotLoad
    hot_load_config: HotLoadConfig
    replicas: list[ReplicaEndpoint]
    deployment_workflow_id: str
    # Replicas after the first take the weights from an updated peer instead of the bucket.
    peer_transfer: bool = True


class HotLoadOutcome(WireModel):
    """What a hot-load workflow reports back to its deployment when it ends."""

    hot_load_id: str
    identity: str
    state: HotLoadState
    replicas: list[Replica]
    chain: list[SnapshotRef] = Field(default_factory=list)


class ChainLink(WireModel):
    """One completed hot-load of a deployment, kept to resolve later chains."""

    identity: str
    type: SnapshotType
    hot_load_id: str
    previous_identity: str | None = None


class CreateHotLoadCommand(WireModel):
    """A create request after the API parsed it (syntax checked, enums resolved)."""

    hot_load_id: str
    identity: str
    type: SnapshotType
    incremental_snapshot_metadata: IncrementalSnapshotMetadata | None = None
    prompt_cache_policy: PromptCachePolicy = PromptCachePolicy.PRESERVE
    organization_hot_load_enabled: bool = True
    created_at: str
    # The API request's trace context (W3C carrier): the operation's spans join that trace
    # rather than the deployment's long-lived one (workers/telemetry.py).
    trace_context: dict[str, str] = Field(default_factory=dict)


class UpdateDeploymentCommand(WireModel):
    """A deployment update after the API parsed it: each field given replaces the current one.

    `hot_load` is the section the caller sent (None: omitted). The workflow refuses an update
    that omits or changes it on a hot-load deployment, and one that adds it to another; of the
    rest only `runtime.version`, `runtime.engineConfig` (the replicas roll onto a new runtime)
    and `traffic` may change, and nothing changes while a hot-load runs.
    """

    name: str | None = None
    gateway_ids: list[str] | None = None
    runtime: Runtime | None = None
    resources: Resources | None = None
    model: ModelSource | None = None
    autoscaling: Autoscaling | None = None
    traffic: Traffic | None = None
    hot_load: HotLoadConfig | None = None
    updated_at: str


# --------------------------------------------------------------------------- rules
IDENTITY_MAX = 128
MAX_DELTAS_IN_CHAIN = 63
RESERVED_IDENTITY = "initial"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def identity_problem(identity: str, field: str = "identity") -> str | None:
    """Why `identity` is not a valid snapshot identity, or None (the guide's rules)."""
    if not isinstance(identity, str) or not identity:
        return f"{field} must be a non-empty string"
    if len(identity) > IDENTITY_MAX:
        return f"{field} must be at most {IDENTITY_MAX} characters (got {len(identity)})"
    if "/" in identity or "\\" in identity:
        return f"{field} {identity!r} must be a single path segment (no '/')"
    if identity in (".", "..") or ".." in identity:
        return f"{field} {identity!r} must not contain '..'"
    if any(ord(c) < 32 or ord(c) == 127 for c in identity):
        return f"{field} must not contain control characters"
    if identity == RESERVED_IDENTITY:
        return f"{field} {RESERVED_IDENTITY!r} is reserved for the deployment's base weights"
    return None


def resource_id_problem(value: str, field: str) -> str | None:
    """Client-chosen ids (deployments, gateways, hot-loads): one URL path segment, 1-128 chars."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        return f"{field} must be 1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
    return None


# --------------------------------------------------------------------------- activity contracts
class StartReplicasInput(WireModel):
    deployment_id: str
    deployment_workflow_id: str
    names: list[str]
    zone: str
    model: ModelSource
    # runtime.engineConfig: vLLM flags for the replica's engine (e.g. "max-model-len").
    engine_config: dict[str, str] = Field(default_factory=dict)
    # The snapshot a new replica must serve before it reports ready (a restart or a scale-up
    # after a hot-load began loads the target directly); None: the model's base weights.
    target_chain: list[SnapshotRef] | None = None
    hot_load_config: HotLoadConfig | None = None


class StopReplicasInput(WireModel):
    deployment_id: str
    names: list[str]


class CheckSnapshotInput(WireModel):
    bucket: str
    path_prefix: str
    identity: str
    type: SnapshotType


class ApplySnapshotInput(WireModel):
    hot_load_id: str
    identity: str
    chain: list[SnapshotRef]
    bucket: str
    path_prefix: str
    prompt_cache_policy: PromptCachePolicy = PromptCachePolicy.PRESERVE


class ApplySnapshotResult(WireModel):
    identity: str
    engine_pid: int
    tensors_loaded: int
    bytes_read_from_bucket: int
    pause_ms: float
    links_applied: list[str] = Field(default_factory=list)
    stage_ms: float = 0.0
    source: str = "bucket"  # "bucket", or "peer:<replica name>"
    # Tensors whose served bytes were read back from the engine and matched the snapshot's
    # Adler-32 after the update: the served-weights proof behind READY.
    verified_tensors: int = 0


class PeerOfferInput(WireModel):
    """Asks an updated replica what it would send to a peer that serves `target_identity`."""

    hot_load_id: str
    identity: str
    chain: list[SnapshotRef]
    target_identity: str
    # Members of the group the offer opens: the sender (rank 0) and world_size - 1 receivers.
    world_size: int = 2
    # Receivers can take the delta link's files instead of the tensors as served.
    accept_files: bool = False
    # The sender's agent hosts the group's rendezvous store from the offer on, so no engine
    # waits out TCPStore's connect back-off for a master that is not up yet.
    host_store: bool = False
    # Offer the delta link's files as soon as the sender's own update of this hot-load (from the
    # bucket) has decoded and checked them, before it swaps them in: the receivers stage while
    # it commits, and commit only after it is READY. Waits for that stage; refused (no offer)
    # when the update holds no such files.
    from_stage: bool = False


class PeerOffer(WireModel):
    """What a sending replica offers: where to join, and exactly which tensors will arrive."""

    source_replica: str
    host: str
    port: int
    backend: str
    base_identity: str  # the identity the receiver must serve for these tensors to complete it
    identity: str
    chain: list[SnapshotRef]
    specs: list[list[Any]]  # [name, dtype, shape] in send order
    expected_adler32: dict[str, str]
    world_size: int = 2
    # "tensors": specs are tensors as the sender serves them; "files": specs are the files of
    # the delta link `identity` (XOR+zstd frames), which each receiver decodes and checks itself.
    mode: str = "tensors"
    # Every engine joins as a client of a store the sender's agent already hosts (host_store).
    store_hosted: bool = False


class StageFromPeerInput(WireModel):
    """A receiver's place in a broadcast: it joins `offer`'s group as `rank` and stages."""

    offer: PeerOffer
    rank: int


class CommitPeerStageInput(WireModel):
    identity: str
    prompt_cache_policy: PromptCachePolicy = PromptCachePolicy.PRESERVE


class StageFromPeerResult(WireModel):
    identity: str
    tensors_staged: int
    bytes_received: int
    stage_ms: float


class ReceiveFromPeerInput(WireModel):
    offer: PeerOffer
    prompt_cache_policy: PromptCachePolicy = PromptCachePolicy.PRESERVE


class DeploymentInput(WireModel):
    """The deployment workflow's input, also what it carries across continue-as-new."""

    deployment: Deployment
    gateway_zones: list[str] = Field(default_factory=list)
    replicas: list[ReplicaEndpoint] = Field(default_factory=list)
    pending_replicas: list[str] = Field(default_factory=list)
    # Every replica that belongs to the deployment: serving (`replicas`), starting (`pending`) or
    # lost (its process died; the deployment restarts it). Empty in a state carried over from
    # before it was kept: then `replicas` and `pending_replicas` are the members.
    members: list[str] = Field(default_factory=list)
    # Members that still run an earlier runtime (`version`/`engineConfig`): a rolling update
    # replaces them one at a time, in walk order; empty when every member runs the spec's runtime.
    outdated: list[str] = Field(default_factory=list)
    # Why the last rolling update stopped (a new replica failed to start); the deployment is
    # STATUS_ERROR until a configuration update succeeds. None: no failed update.
    update_error: str | None = None
    completed: list[ChainLink] = Field(default_factory=list)
    chains: dict[str, list[SnapshotRef]] = Field(default_factory=dict)
    seen_hot_load_ids: list[str] = Field(default_factory=list)
    active_hot_load_id: str | None = None
    replica_generation: int = 0
