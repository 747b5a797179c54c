"""Request bodies the API accepts, validated strictly (unknown fields and enum names refused).

Enums are accepted as proto names or their proto numbers (cwtrain sends names; some tools send
numbers); responses always carry names. Validation errors become `invalid_argument` naming the
field (see api/app.py). Buckets and paths (`model`, `hotLoad`) follow common/buckets.py's rules.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, StrictInt, field_validator, model_validator

from common.buckets import bucket_problem, normalize_path, path_problem
from common.ids import resource_id_problem
from contracts import names
from contracts.autoscaling import MAX_AFTER_S, MAX_TARGET_IN_FLIGHT
from contracts.engine_config import engine_config_problem
from contracts.records import (
    ENUM_NUMBERS,
    MAX_CONCURRENT_SWAPS,
    MAX_PEER_FAN_OUT,
    MAX_REPLICAS_PER_GROUP,
    Autoscaling,
    ChecksumFormat,
    CompressionFormat,
    HotLoadConfig,
    ModelSource,
    PromptCachePolicy,
    Resources,
    Runtime,
    SnapshotType,
    Traffic,
    TransitionMode,
    WireModel,
)
from snapshots.identity import identity_problem


def _proto_enum(enum_cls):
    numbers = ENUM_NUMBERS[enum_cls]

    def parse(value: Any) -> Any:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
            n = int(value)
            if 0 < n < len(numbers) and numbers[n] is not None:
                return numbers[n]
            raise ValueError(f"unknown enum number {n}; expected one of {', '.join(e.value for e in enum_cls)}")
        if isinstance(value, str) and value not in {e.value for e in enum_cls}:
            raise ValueError(f"unknown value {value!r}; expected one of {', '.join(e.value for e in enum_cls)}")
        return value

    return Annotated[enum_cls, BeforeValidator(parse)]


if TYPE_CHECKING:  # mypy sees the enums; pydantic gets them with the number parser
    SnapshotTypeIn = SnapshotType
    CompressionIn = CompressionFormat
    ChecksumIn = ChecksumFormat
    PromptCachePolicyIn = PromptCachePolicy
    TransitionModeIn = TransitionMode
else:
    SnapshotTypeIn = _proto_enum(SnapshotType)
    CompressionIn = _proto_enum(CompressionFormat)
    ChecksumIn = _proto_enum(ChecksumFormat)
    PromptCachePolicyIn = _proto_enum(PromptCachePolicy)
    TransitionModeIn = _proto_enum(TransitionMode)

Name = Annotated[str, Field(min_length=1, max_length=128)]


def _resource_id(field: str):
    def check(value: str) -> str:
        if p := resource_id_problem(value, field):
            raise ValueError(p)
        return value

    return check


# A resource id the caller chose (`common/ids.py`).
ResourceId = Annotated[str, AfterValidator(_resource_id("id"))]
HotLoadId = Annotated[str, AfterValidator(_resource_id("hotLoadId"))]


class CreateGatewayRequest(WireModel):
    id: ResourceId | None = None
    name: Name
    zones: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=16)


def _bucket(value: str) -> str:
    if p := bucket_problem(value, "bucket"):
        raise ValueError(p)
    return value


def _path(field: str, *, allow_empty: bool):
    def check(value: str) -> str:
        if p := path_problem(value, field, allow_empty=allow_empty):
            raise ValueError(p)
        return normalize_path(value)

    return check


# A bucket (`model.bucket`, `hotLoad.bucket`) and the object paths in it (common/buckets.py).
BucketName = Annotated[str, Field(max_length=63), AfterValidator(_bucket)]
PathPrefix = Annotated[str, Field(max_length=512), AfterValidator(_path("pathPrefix", allow_empty=True))]
ModelPath = Annotated[str, Field(min_length=1, max_length=512), AfterValidator(_path("path", allow_empty=False))]


class HotLoadConfigIn(WireModel):
    bucket: BucketName
    path_prefix: PathPrefix = ""
    transition_mode: TransitionModeIn = TransitionMode.ASYNC
    # Beyond the guide (docs/operations.md, "Large deployments").
    max_concurrent_swaps: StrictInt = Field(default=1, ge=1, le=MAX_CONCURRENT_SWAPS)
    peer_fan_out: StrictInt = Field(default=4, ge=1, le=MAX_PEER_FAN_OUT)
    replicas_per_group: StrictInt = Field(default=100, ge=2, le=MAX_REPLICAS_PER_GROUP)

    def to_record(self) -> HotLoadConfig:
        return HotLoadConfig(
            bucket=self.bucket,
            path_prefix=self.path_prefix,
            transition_mode=self.transition_mode,
            max_concurrent_swaps=self.max_concurrent_swaps,
            peer_fan_out=self.peer_fan_out,
            replicas_per_group=self.replicas_per_group,
        )


# runtime.engineConfig keys a deployment may set, and the value each takes: a positive integer
# (COUNT), none (SWITCH: the flag alone) or one of vLLM's names for a choice (NAME: an attention
# backend such as CPU_MLA, which vLLM checks at engine start). They become vLLM flags on the
# replicas, so nothing outside this list is accepted.
COUNT, SWITCH, NAME = "count", "switch", "name"
ENGINE_CONFIG_KEYS: dict[str, str] = {
    "max-model-len": COUNT,
    "max-num-seqs": COUNT,
    "enable-return-routed-experts": SWITCH,
    "tensor-parallel-size": COUNT,
    # GPU replicas at tensor-parallel size 2 or more only (contracts/engine_config.py).
    "enable-expert-parallel": SWITCH,
    "attention-backend": NAME,
}
CHOICE_NAME = re.compile(r"[A-Z][A-Z0-9_]{0,63}")


class RuntimeIn(Runtime):
    engine: Annotated[str, Field(min_length=1, max_length=64)]
    version: Annotated[str, Field(max_length=64)] = ""
    engine_config: dict[Annotated[str, Field(max_length=128)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=64
    )

    @field_validator("engine")
    @classmethod
    def _engine(cls, v: str) -> str:
        if v not in names.ENGINES:
            raise ValueError(f"unsupported engine {v!r}; supported: {', '.join(names.ENGINES)}")
        return v

    @field_validator("engine_config")
    @classmethod
    def _engine_config(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if key not in ENGINE_CONFIG_KEYS:
                raise ValueError(f"unsupported key {key!r}; supported: {', '.join(ENGINE_CONFIG_KEYS)}")
            kind = ENGINE_CONFIG_KEYS[key]
            if kind == COUNT and not (value.isdigit() and int(value) > 0):
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
            if kind == SWITCH and value:
                raise ValueError(f"{key} takes an empty value, got {value!r}")
            if kind == NAME and not CHOICE_NAME.fullmatch(value):
                raise ValueError(f"{key} must be one of vLLM's names (capitals, digits, _), got {value!r}")
        return v


class ModelSourceIn(ModelSource):
    name: Name
    bucket: BucketName
    path: ModelPath


class TrafficIn(Traffic):
    # The bound is checked on requests, not on the `Traffic` record: every stored state loads.
    weight: Annotated[int, Field(ge=0, le=100, strict=True)] = 100


# The most replicas one deployment may ask for: the hot-load walk is measured at this size with
# simulated replicas (bench/scale.py).
MAX_REPLICAS = 1024


class AutoscalingIn(Autoscaling):
    min: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 1
    max: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 1
    # Beyond the guide (docs/operations.md, "Autoscaling"); unset: contracts/autoscaling.py's defaults.
    target_in_flight: Annotated[StrictInt, Field(ge=1, le=MAX_TARGET_IN_FLIGHT)] | None = None
    scale_out_after_seconds: Annotated[StrictInt, Field(ge=0, le=MAX_AFTER_S)] | None = None
    scale_in_after_seconds: Annotated[StrictInt, Field(ge=0, le=MAX_AFTER_S)] | None = None


class CreateDeploymentRequest(WireModel):
    id: ResourceId | None = None
    name: Name
    gateway_ids: list[Annotated[str, Field(min_length=1, max_length=128)]] = Field(min_length=1, max_length=8)
    runtime: RuntimeIn
    resources: Resources = Field(default_factory=Resources)
    model: ModelSourceIn
    autoscaling: AutoscalingIn = Field(default_factory=AutoscalingIn)
    traffic: TrafficIn = Field(default_factory=TrafficIn)
    hot_load: HotLoadConfigIn | None = None

    @model_validator(mode="after")
    def _engine_config_fits_resources(self) -> CreateDeploymentRequest:
        if p := engine_config_problem(self.runtime, self.resources):
            raise ValueError(p)
        return self


class UpdateDeploymentRequest(WireModel):
    """PATCH /deployments/{id}: any field of the create body but `id`; `hotLoad` must repeat the
    deployment's own section (the workflow compares it, see control/deployment.py)."""

    name: Name | None = None
    gateway_ids: list[Annotated[str, Field(min_length=1, max_length=128)]] | None = Field(
        default=None, min_length=1, max_length=8
    )
    runtime: RuntimeIn | None = None
    resources: Resources | None = None
    model: ModelSourceIn | None = None
    autoscaling: AutoscalingIn | None = None
    traffic: TrafficIn | None = None
    hot_load: HotLoadConfigIn | None = None

    @model_validator(mode="after")
    def _engine_config_fits_resources(self) -> UpdateDeploymentRequest:
        # Both given: checked here; runtime alone: against the deployment's (control/admission.py).
        if p := engine_config_problem(self.runtime, self.resources):
            raise ValueError(p)
        return self


class IncrementalSnapshotMetadataIn(WireModel):
    previous_snapshot_identity: str
    compression_format: CompressionIn = CompressionFormat.ZSTD
    checksum_format: ChecksumIn = ChecksumFormat.ADLER32

    @field_validator("previous_snapshot_identity")
    @classmethod
    def _prev(cls, v: str) -> str:
        if p := identity_problem(v, "previousSnapshotIdentity"):
            raise ValueError(p)
        return v


class CreateHotLoadRequest(WireModel):
    deployment_id: Annotated[str, Field(min_length=1, max_length=128)]
    hot_load_id: HotLoadId | None = None
    identity: str
    type: SnapshotTypeIn
    incremental_snapshot_metadata: IncrementalSnapshotMetadataIn | None = None
    prompt_cache_policy: PromptCachePolicyIn | None = None

    @field_validator("identity")
    @classmethod
    def _identity(cls, v: str) -> str:
        if p := identity_problem(v, "identity"):
            raise ValueError(p)
        return v

    @model_validator(mode="after")
    def _type_matches_metadata(self) -> CreateHotLoadRequest:
        # Checked here too (the deployment workflow checks again) so that a malformed request is
        # invalid_argument whatever the deployment's state.
        if self.type == SnapshotType.FULL and self.incremental_snapshot_metadata is not None:
            raise ValueError("incrementalSnapshotMetadata must be omitted for SNAPSHOT_TYPE_FULL")
        if self.type == SnapshotType.INCREMENTAL and self.incremental_snapshot_metadata is None:
            raise ValueError("incrementalSnapshotMetadata is required for SNAPSHOT_TYPE_INCREMENTAL")
        if (
            self.incremental_snapshot_metadata is not None
            and self.incremental_snapshot_metadata.previous_snapshot_identity == self.identity
        ):
            raise ValueError("a delta cannot be its own previousSnapshotIdentity")
        return self
