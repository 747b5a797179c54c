"""The deployment's admission rules, without I/O: what a configuration update and a hot-load
create must satisfy, each refused with a clear error carrying its API code (contracts/errors.py).

The deployment workflow (control/deployment.py) applies them in its Updates' validators and again
in the handlers (several Updates in one workflow task all validate first). Order: what is wrong
with the request itself (invalid_argument) before what is wrong with the moment
(failed_precondition), so a retry cannot succeed on a bad request. `resolve_chain` is the
snapshot chain an admitted create loads: the predecessor's completed chain plus the new link;
`links_to_check` the links of it that admission checks in the bucket (the new one, and those a
replica will read because it does not serve them yet).
"""

from __future__ import annotations

from typing import Any

from contracts.engine_config import engine_config_problem
from contracts.errors import ALREADY_EXISTS, FAILED_PRECONDITION, INVALID_ARGUMENT, rejected
from contracts.records import (
    Autoscaling,
    ConditionStatus,
    CreateHotLoadCommand,
    DeploymentInput,
    HotLoadConfig,
    ResourceStatus,
    SnapshotRef,
    SnapshotType,
    UpdateDeploymentCommand,
)
from snapshots.chain import MAX_CHAIN_DELTAS as MAX_DELTAS_IN_CHAIN
from snapshots.identity import identity_problem


def same_hot_load(given: HotLoadConfig, spec: HotLoadConfig) -> bool:
    """Whether an update's hotLoad section is the deployment's. The guide's fields must match; a
    large-deployment setting (beyond the guide) that the update leaves at its default keeps the
    deployment's, so a client that sends only the guide's fields is not refused."""
    defaults = HotLoadConfig(bucket=spec.bucket)
    for name in ("max_concurrent_swaps", "peer_fan_out", "replicas_per_group"):
        value = getattr(given, name)
        if value != getattr(defaults, name) and value != getattr(spec, name):
            return False
    guide = ("bucket", "path_prefix", "transition_mode")
    return all(getattr(given, name) == getattr(spec, name) for name in guide)


def same_autoscaling(given: Autoscaling, spec: Autoscaling) -> bool:
    """Whether an update's autoscaling section is the deployment's: `min` and `max` must match;
    a field beyond the guide that the update leaves out keeps the deployment's."""
    extension = ("target_in_flight", "scale_out_after_seconds", "scale_in_after_seconds")
    return (given.min, given.max) == (spec.min, spec.max) and all(
        getattr(given, name) is None or getattr(given, name) == getattr(spec, name) for name in extension
    )


def check_update(state: DeploymentInput, cmd: UpdateDeploymentCommand, *, deleting: bool) -> None:
    spec = state.deployment.spec
    if spec.hot_load is not None and cmd.hot_load is None:
        raise rejected(
            INVALID_ARGUMENT,
            "hotLoad: an update must include the deployment's hotLoad section unchanged "
            "(it is immutable after creation)",
        )
    if spec.hot_load is None and cmd.hot_load is not None:
        raise rejected(
            INVALID_ARGUMENT,
            "hotLoad: cannot be added to an existing deployment; create a new deployment with it",
        )
    if cmd.hot_load is not None and spec.hot_load is not None and not same_hot_load(cmd.hot_load, spec.hot_load):
        raise rejected(
            INVALID_ARGUMENT,
            "hotLoad: differs from the deployment's section, which is immutable after creation; "
            "create a new deployment to change it",
        )
    fixed: dict[str, tuple[Any, Any]] = {
        "name": (cmd.name, spec.name),
        "gatewayIds": (cmd.gateway_ids, spec.gateway_ids),
        "resources": (cmd.resources, spec.resources),
        "model": (cmd.model, spec.model),
        "autoscaling": (cmd.autoscaling, spec.autoscaling),
        "runtime.engine": (cmd.runtime.engine if cmd.runtime else None, spec.runtime.engine),
    }
    changed = [
        field
        for field, (new, old) in fixed.items()
        if new is not None and not (same_autoscaling(new, old) if field == "autoscaling" else new == old)
    ]
    if changed:
        raise rejected(
            INVALID_ARGUMENT,
            f"{', '.join(changed)}: cannot be changed by an update (only runtime.version, "
            "runtime.engineConfig and traffic can); create a new deployment",
        )
    if problem := engine_config_problem(cmd.runtime, spec.resources):
        raise rejected(INVALID_ARGUMENT, problem)
    if state.active_hot_load_id is not None:
        raise rejected(
            FAILED_PRECONDITION,
            f"hot-load {state.active_hot_load_id} is already in progress on deployment {spec.id}; "
            "configuration updates wait until it ends",
        )
    status = state.deployment.status.status
    failed_update = status == ResourceStatus.ERROR and state.update_error is not None
    if deleting or (status != ResourceStatus.READY and not failed_update):
        raise rejected(FAILED_PRECONDITION, not_ready(state, deleting=deleting))


def not_ready(state: DeploymentInput, *, deleting: bool) -> str:
    """Why the deployment admits nothing now: its status and, if any, the reason."""
    if deleting:
        return f"deployment {state.deployment.spec.id} is STATUS_DELETING, not STATUS_READY"
    st = state.deployment.status
    why = f"deployment {state.deployment.spec.id} is {st.status.value}, not STATUS_READY"
    blocking = [c for c in st.conditions if c.status == ConditionStatus.FALSE and c.message]
    if blocking:
        why += f" ({blocking[0].reason}: {blocking[0].message})"
    return why


# The reason the deployment's status gives while a node agent did not answer its last periodic
# check (control/deployment.py `_settle`, which names it in the status's condition).
NODE_UNREACHABLE = "NodeUnreachable"


def node_unanswered_only(state: DeploymentInput) -> bool:
    """The deployment is UPDATING only because a node agent missed the last periodic check (a
    slow answer or a partition): an admission asks every node agent again before it decides
    (control/deployment_hot_loads.py `_admit_replicas`), rather than refusing on the old answer."""
    st = state.deployment.status
    blocking = [c for c in st.conditions if c.status == ConditionStatus.FALSE]
    return st.status == ResourceStatus.UPDATING and [c.reason for c in blocking] == [NODE_UNREACHABLE]


def admit(state: DeploymentInput, cmd: CreateHotLoadCommand, *, deleting: bool) -> None:
    """The admission rules that need no I/O, each a clear error with its API code.

    Order: what is wrong with the request itself (invalid_argument) before what is wrong
    with the moment (failed_precondition), so a retry cannot succeed on a bad request.
    """
    spec = state.deployment.spec
    if cmd.hot_load_id in state.seen_hot_load_ids:
        raise rejected(ALREADY_EXISTS, f"hot-load {cmd.hot_load_id} already exists")
    problem = identity_problem(cmd.identity)
    if problem:
        raise rejected(INVALID_ARGUMENT, problem)
    meta = cmd.incremental_snapshot_metadata
    if cmd.type == SnapshotType.FULL and meta is not None:
        raise rejected(INVALID_ARGUMENT, "incrementalSnapshotMetadata must be omitted for SNAPSHOT_TYPE_FULL")
    if cmd.type == SnapshotType.INCREMENTAL:
        if meta is None:
            raise rejected(INVALID_ARGUMENT, "incrementalSnapshotMetadata is required for SNAPSHOT_TYPE_INCREMENTAL")
        problem = identity_problem(
            meta.previous_snapshot_identity, "incrementalSnapshotMetadata.previousSnapshotIdentity"
        )
        if problem:
            raise rejected(INVALID_ARGUMENT, problem)
        if meta.previous_snapshot_identity == cmd.identity:
            raise rejected(INVALID_ARGUMENT, "a delta cannot be its own previousSnapshotIdentity")
    if not cmd.organization_hot_load_enabled:
        raise rejected(FAILED_PRECONDITION, "hot-load is not enabled for this organization")
    # The API admits a hotLoad section only on an engine that hot-loads (api/app.py: dynamo-vllm,
    # or what ROLLOUTS_HOT_LOAD_ENGINES allows), so a deployment that has one may hot-load.
    if spec.hot_load is None:
        raise rejected(
            FAILED_PRECONDITION,
            f"hot-load is not enabled on deployment {spec.id}: it was created without a hotLoad "
            "section, which cannot be added later",
        )
    if state.active_hot_load_id is not None:
        raise rejected(
            FAILED_PRECONDITION,
            f"hot-load {state.active_hot_load_id} is already in progress on deployment {spec.id}",
        )
    if deleting or (state.deployment.status.status != ResourceStatus.READY and not node_unanswered_only(state)):
        raise rejected(FAILED_PRECONDITION, not_ready(state, deleting=deleting))
    if len(set(state.gateway_zones)) > 1:
        raise rejected(
            FAILED_PRECONDITION,
            "the deployment's gateways are in different zones "
            f"({', '.join(sorted(set(state.gateway_zones)))}); hot-load needs them in one zone",
        )
    if meta is not None:
        if meta.previous_snapshot_identity not in state.chains:
            raise rejected(
                FAILED_PRECONDITION,
                f"previousSnapshotIdentity {meta.previous_snapshot_identity!r} has no completed hot-load "
                f"on deployment {spec.id}",
            )
        base_chain = state.chains[meta.previous_snapshot_identity]
        deltas = sum(1 for link in base_chain if link.type == SnapshotType.INCREMENTAL) + 1
        if deltas > MAX_DELTAS_IN_CHAIN:
            raise rejected(
                FAILED_PRECONDITION,
                f"the chain would hold {deltas} deltas; at most {MAX_DELTAS_IN_CHAIN} are allowed, "
                "publish a full checkpoint to start a new chain",
            )


def links_to_check(state: DeploymentInput, chain: list[SnapshotRef]) -> list[SnapshotRef]:
    """The links of a resolved chain that admission checks in the bucket: the new one (last), and
    each earlier one some replica will read in this hot-load, in chain order. A link every replica
    already applied is read by no one, so a delta on top of what every replica serves is one check,
    however long the chain.
    """
    ids = [link.identity for link in chain]
    first = len(chain) - 1
    for replica in state.replicas:
        served = replica.current_snapshot_identity
        at = len(ids) - 1 - ids[::-1].index(served) if served in ids else -1
        first = min(first, at + 1)
    return chain[first:]


def resolve_chain(state: DeploymentInput, cmd: CreateHotLoadCommand) -> list[SnapshotRef]:
    this = SnapshotRef(identity=cmd.identity, type=cmd.type, hot_load_id=cmd.hot_load_id)
    if cmd.type == SnapshotType.FULL:
        return [this]
    meta = cmd.incremental_snapshot_metadata
    assert meta is not None
    this.compression_format = meta.compression_format
    this.checksum_format = meta.checksum_format
    return [link.model_copy() for link in state.chains[meta.previous_snapshot_identity]] + [this]
