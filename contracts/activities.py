"""Activity contracts: each activity's name, task queue, input and output.

The control worker's workflows schedule these; the control worker's own activities
(control/activities.py), each node agent (replica/node/activities.py: starting and stopping
replica processes) and each replica's agent (replica/agent/activities.py) implement them. They are
Temporal payloads (JSON, camelCase), never REST wire objects.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any

from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from contracts.records import (
    HotLoadConfig,
    ModelSource,
    Placement,
    PromptCachePolicy,
    SnapshotRef,
    SnapshotType,
    WireModel,
)


class StartReplicasInput(WireModel):
    deployment_id: str
    deployment_workflow_id: str
    names: list[str]
    zone: str
    model: ModelSource
    # runtime.engine (contracts.names.ENGINES): Dynamo's vLLM worker, or vLLM's OpenAI server.
    engine: str = "dynamo-vllm"
    # runtime.engineConfig: vLLM flags for the replica's engine (e.g. "max-model-len").
    engine_config: dict[str, str] = Field(default_factory=dict)
    # The snapshot a new replica must serve before it reports ready (a restart or a scale-up
    # after a hot-load began loads the target directly); None: the model's base weights.
    target_chain: list[SnapshotRef] | None = None
    hot_load_config: HotLoadConfig | None = None
    # Where each named replica runs (the node agent that runs this activity), from the registry:
    # its GPU devices become the replica's CUDA_VISIBLE_DEVICES.
    placements: dict[str, Placement] = Field(default_factory=dict)
    # A scale-out's new replica (control/autoscaler.py): it stays out of its engine's routing pool
    # (a Dynamo worker leaves discovery) until the deployment makes it a member (`serve_replica`).
    joining: bool = False


class StopReplicasInput(WireModel):
    deployment_id: str
    names: list[str]


class DrainInput(WireModel):
    """Scale-in of one replica: how long routers get to notice it left before its engine stops
    taking requests and finishes those it holds."""

    grace_seconds: float = 2.0


class CheckSnapshotInput(WireModel):
    """One snapshot's admission check; it answers `[fingerprint]` (snapshots/inspect.py:
    `verify_required_files`), or `[]` from a worker older than fingerprints."""

    bucket: str
    path_prefix: str
    identity: str
    type: SnapshotType
    # The fingerprint this snapshot had when it joined the deployment's chain: the check also
    # refuses it if its files changed since. None: a snapshot checked for the first time.
    verified: str | None = None


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
    # Where the pause went, in ms: pause, label, swap (swap_in and prove inside it), resume
    # (replica/agent/runtime.py `_swap_staged`). Empty when nothing was swapped.
    pause_breakdown_ms: dict[str, float] = Field(default_factory=dict)
    # What the swap moved (contracts/engine_ranks.py BYTE_COUNTS): pause_bytes written into the
    # engine inside the pause, staged_bytes before it, changed_bytes of the elements that
    # changed, device_staged_bytes held on the engine's device, pinned_staged_bytes in pinned
    # host memory. Empty when nothing was swapped.
    swap_bytes: dict[str, int] = Field(default_factory=dict)


class PeerOfferInput(WireModel):
    """Asks the first replica what it would send to peers that serve `target_identity`."""

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
    # With `from_stage`: the sender is a receiver passing on the stage it got from a peer (the
    # fan-out), not the replica updating from the bucket: it offers that stage's delta files, or
    # what it serves once it swapped the update in, and never waits for an update of its own;
    # refused (no offer) when it holds neither (a stage of tensors not yet swapped in).
    peer_stage: bool = False


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
    # An offer of more than PACK_OVER tensors carries `specs` and `expected_adler32` packed here
    # instead (:func:`pack_tensor_lists`), unpacked again on arrival: Temporal refuses a payload
    # over 2 MB, and every tensor of an 18,867-tensor model as JSON is about 2.5 MB (packed: 0.3).
    packed: str = ""

    @model_validator(mode="after")
    def _unpack(self) -> PeerOffer:
        if self.packed and not self.specs:
            self.specs, self.expected_adler32 = unpack_tensor_lists(self.packed)
        self.packed = ""
        return self

    @model_serializer(mode="wrap")
    def _pack(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if len(self.specs) > PACK_OVER:
            expected_key = "expectedAdler32" if "expectedAdler32" in data else "expected_adler32"
            data["specs"], data[expected_key] = [], {}
            data["packed"] = pack_tensor_lists(self.specs, self.expected_adler32)
        else:
            data.pop("packed", None)  # a small offer is what it always was
        shown: dict[str, Any] = data
        return shown


PACK_OVER = 1000  # tensors in an offer above which its lists travel packed


def pack_tensor_lists(specs: list[list[Any]], expected: dict[str, str]) -> str:
    """``specs`` and ``expected`` as zlib-compressed JSON in base64 (a tensor's name compresses
    to a few bytes: Qwen3-30B-A3B's 18,867 tensors take 0.3 MB, Kimi-K2's ~70,000 1.2 MB)."""
    raw = json.dumps([specs, expected], separators=(",", ":")).encode()
    return base64.b64encode(zlib.compress(raw, 6)).decode()


def unpack_tensor_lists(packed: str) -> tuple[list[list[Any]], dict[str, str]]:
    specs, expected = json.loads(zlib.decompress(base64.b64decode(packed)))
    return specs, expected


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
