"""The records the workflows keep, shaped exactly as the wire objects of the guide.

Workflows hold these as state, publish them in their memo (so reads never need a worker) and
the API returns them as they are: camelCase JSON, enums as proto names, RFC 3339 UTC timestamps.
Nothing here talks to Temporal, HTTP or storage.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        return self in TERMINAL_HOT_LOAD_STATES


# The states a hot-load ends in (str members: equal to their wire names, so a JSON record's
# `status.state` string is `in` it too).
TERMINAL_HOT_LOAD_STATES = (HotLoadState.COMPLETED, HotLoadState.FAILED, HotLoadState.CANCELED)


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
    # Beyond the guide (docs/operations.md, "Autoscaling"; contracts/autoscaling.py): unset means
    # the default there. Requests in flight per serving replica, as a gateway sees them, that
    # make the deployment busy; how long busy lasts before one replica is added, and how long
    # idle lasts before one is removed.
    target_in_flight: int | None = None
    scale_out_after_seconds: int | None = None
    scale_in_after_seconds: int | None = None


class Traffic(WireModel):
    """A deployment's share of its model name's requests, relative to the other deployments of
    that name on a gateway (0: none; the API accepts 0-100)."""

    weight: int = 100


MAX_CONCURRENT_SWAPS = 256
MAX_PEER_FAN_OUT = 64
MAX_REPLICAS_PER_GROUP = 1000


class HotLoadConfig(WireModel):
    bucket: str
    path_prefix: str = ""
    transition_mode: TransitionMode = TransitionMode.ASYNC
    # Beyond the guide (docs/operations.md, "Large deployments"). How many replicas may swap at
    # once: 1 is the guide's rolling walk; k > 1 commits up to k replicas together, in walk order.
    max_concurrent_swaps: int = Field(default=1, ge=1, le=MAX_CONCURRENT_SWAPS)
    # How many receivers one replica that holds the update passes it to at a time (each transfer
    # is its own group of 1 + peerFanOut engines): N replicas are reached in O(log N) rounds.
    peer_fan_out: int = Field(default=4, ge=1, le=MAX_PEER_FAN_OUT)
    # Past this many replicas, a hot-load stages them in groups of this size, each in a child
    # workflow (`hotLoads/ORG/ID/stage-J`), which keeps every workflow's history bounded.
    replicas_per_group: int = Field(default=100, ge=2, le=MAX_REPLICAS_PER_GROUP)


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
    # Where the pause went, in ms: pause (until the engine stopped), label, swap (with swap_in
    # and prove, the engine's own part of it), resume.
    pause_breakdown_ms: dict[str, float] | None = None
    # What the swap moved: pause_bytes (into the engine inside the pause), staged_bytes (before
    # it), changed_bytes (of the elements that changed), device_staged_bytes, pinned_staged_bytes.
    swap_bytes: dict[str, int] | None = None
    verified_tensors: int | None = None
    # Beyond the guide: the node (host) the replica runs on.
    node: str | None = None
    # Beyond the guide: for a replica that staged from a peer, the transfer round that reached
    # it (1: from the replica that read the bucket; n: from one reached in round n - 1).
    peer_round: int | None = None


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
    # The node agent that runs it ("" when unknown).
    node: str = ""
    # A Dynamo worker's id in Dynamo's discovery (hex; "" for a vLLM server replica): the
    # ``worker_id`` Dynamo's frontend reports. Its engine_url is then its control URL.
    dynamo_worker: str = ""
    dynamo_namespace: str = ""
    # The agent's Prometheus endpoint (`http://NODE_ADDRESS:PORT/metrics`; replica/agent/metrics.py).
    metrics_url: str = ""


class Placement(WireModel):
    """Where a replica runs: a node (contracts/nodes.py) and, for a GPU replica, its devices."""

    node: str
    address: str
    # GPU device indices on that node (CUDA_VISIBLE_DEVICES); empty: a CPU slot.
    devices: list[int] = Field(default_factory=list)


class ReplicaFailure(WireModel):
    name: str
    reason: str


class HotLoadInput(WireModel):
    """What the deployment workflow hands to a hot-load workflow it admitted."""

    hot_load: HotLoad
    hot_load_config: HotLoadConfig
    replicas: list[ReplicaEndpoint]
    deployment_workflow_id: str
    # True: replicas after the first stage from the first one's broadcast; False: every replica
    # reads the bucket.
    peer_transfer: bool = True


class StageGroupInput(WireModel):
    """What a hot-load hands to one of its stage groups (a child workflow): pass the update from
    `source` (which holds it) to every member, in walk order, `fan_out` receivers at a time."""

    spec: HotLoadSpec
    members: list[ReplicaEndpoint]
    # The member names' snapshots as the hot-load saw them (a receiver's offer depends on them).
    serving: dict[str, str]
    source: ReplicaEndpoint
    # The source holds a checked stage it has not swapped in yet (else it serves the update).
    source_staged: bool
    # The round in which the source itself was reached (0: the replica that read the bucket).
    source_round: int
    fan_out: int


class StageGroupResult(WireModel):
    """Which members of a stage group hold a checked stage, and the round that reached each;
    every other member reads the bucket in its turn."""

    staged: dict[str, int] = Field(default_factory=dict)
    failed: dict[str, str] = Field(default_factory=dict)


class HotLoadOutcome(WireModel):
    """What a hot-load workflow reports back to its deployment when it ends."""

    hot_load_id: str
    identity: str
    state: HotLoadState
    replicas: list[Replica]
    chain: list[SnapshotRef] = Field(default_factory=list)


class CompletedLink(WireModel):
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
    # rather than the deployment's long-lived one (common/telemetry.py).
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


@dataclass(frozen=True)
class Heard:
    """A deployment's record of one gateway's load reports (contracts/autoscaling.py)."""

    level: str
    since: datetime  # when this gateway began to report this level
    at: datetime  # its last report


class DeploymentInput(WireModel):
    """The deployment workflow's input, also what it carries across continue-as-new."""

    deployment: Deployment
    gateway_zones: list[str] = Field(default_factory=list)
    replicas: list[ReplicaEndpoint] = Field(default_factory=list)
    pending_replicas: list[str] = Field(default_factory=list)
    # Every replica that belongs to the deployment: serving (`replicas`), starting (`pending`) or
    # lost (its process died; the deployment restarts it).
    members: list[str] = Field(default_factory=list)
    # Members that still run an earlier runtime (`version`/`engineConfig`): a rolling update
    # replaces them one at a time, in walk order; empty when every member runs the spec's runtime.
    outdated: list[str] = Field(default_factory=list)
    # Why the last rolling update stopped (a new replica failed to start); the deployment is
    # STATUS_ERROR until a configuration update succeeds. None: no failed update.
    update_error: str | None = None
    completed: list[CompletedLink] = Field(default_factory=list)
    chains: dict[str, list[SnapshotRef]] = Field(default_factory=dict)
    # Each snapshot of the kept chains as admission verified it (identity -> its fingerprint,
    # snapshots/inspect.py): a later hot-load checks again only a snapshot it reads, and refuses
    # it if its files changed since (control/admission.py: `links_to_check`).
    verified_snapshots: dict[str, str] = Field(default_factory=dict)
    seen_hot_load_ids: list[str] = Field(default_factory=list)
    active_hot_load_id: str | None = None
    replica_generation: int = 0
    # Where each member runs (the node registry placed it); a member without one is placed
    # before it starts.
    placements: dict[str, Placement] = Field(default_factory=dict)
    # When the last autoscaling step ended (RFC 3339; None: none yet). The next step's load must
    # hold from then on (contracts/autoscaling.py).
    scaled_at: str | None = None
    # Each gateway's load reports as heard (gateway id -> level, since, last report), kept
    # across continue-as-new so a step does not wait for the next report.
    load_heard: dict[str, Heard] = Field(default_factory=dict)
