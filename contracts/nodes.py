"""Node agents and placement: what a node agent reports, and where a deployment's replicas run.

A node agent (`rollouts node`, replica/node/) runs on every machine that hosts replicas. It sends
a `NodeHeartbeat` to the node registry (control/nodes.py, one workflow per control plane) every
few seconds: its name, the address others reach it at, its zone, its capacity (GPU devices, or
CPU `slots`: how many replicas without GPUs it runs), its free `/dev/shm` and the replicas it
runs. The registry is the single writer of `Placement`s: a deployment asks it to place replicas
(`PlaceRequest`: all-or-nothing) and to release them. A replica with `gpus` > 0 takes that many
distinct devices of one node (`Placement.devices`, handed to the replica as
`CUDA_VISIBLE_DEVICES`); a replica with none takes one CPU slot. A node with `max_replicas` runs
no more replicas than that, whatever its capacity.

A node whose heartbeat stops for `lost_after_s` is declared lost: its placements are released and
each deployment with a replica there is told (`ReplicasLost`), and places it elsewhere.
These are Temporal payloads (JSON, camelCase), never REST wire objects.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import Field
from temporalio.client import Client, WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy

from contracts import names
from contracts.records import Placement, WireModel

# How often a node agent reports, and how long the registry waits before it declares it lost.
HEARTBEAT_EVERY_S = 5.0
LOST_AFTER_S = 30.0


class NodeHeartbeat(WireModel):
    name: str
    address: str
    zone: str
    gpus: int = 0
    slots: int = 0
    # The most replicas it runs at once, whatever its GPUs or slots (0: no such limit). A node agent
    # whose Dynamo workers register through Kubernetes discovery reports 1: Dynamo knows a worker
    # by its pod, so a pod runs one.
    max_replicas: int = 0
    shm_free_bytes: int = 0
    shm_total_bytes: int = 0
    # What the node agent runs now: "<deployment workflow id>/<replica name>".
    replicas: list[str] = Field(default_factory=list)
    agent_pid: int = 0
    started_at: str = ""


class NodeRecord(WireModel):
    """A node as the registry knows it."""

    heartbeat: NodeHeartbeat
    last_seen: str
    lost: bool = False
    lost_at: str | None = None
    # "<deployment workflow id>/<replica name>" -> where it runs.
    placements: dict[str, Placement] = Field(default_factory=dict)


class RegistryState(WireModel):
    """The node registry's state, also what it carries across continue-as-new."""

    nodes: dict[str, NodeRecord] = Field(default_factory=dict)
    lost_after_s: float = LOST_AFTER_S


class PlaceRequest(WireModel):
    deployment_workflow_id: str
    replicas: list[str]
    gpus_per_replica: int = 0
    zone: str = ""


class ReleaseRequest(WireModel):
    deployment_workflow_id: str
    replicas: list[str]


class ReplicasLost(WireModel):
    """The registry tells a deployment that these replicas went with their node."""

    node: str
    names: list[str]
    reason: str


def placement_key(deployment_workflow_id: str, replica: str) -> str:
    return f"{deployment_workflow_id}/{replica}"


async def report_heartbeat(
    client: Client, heartbeat: NodeHeartbeat, rpc_timeout: timedelta
) -> WorkflowHandle[Any, Any]:
    """Send one heartbeat to the node registry, starting the registry if it does not run (a
    node agent's, real or simulated, every `HEARTBEAT_EVERY_S`); the registry's handle."""
    return await client.start_workflow(
        names.NODE_REGISTRY_WORKFLOW,
        RegistryState(),
        id=names.NODE_REGISTRY_ID,
        task_queue=names.CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal=names.NODE_HEARTBEAT,
        start_signal_args=[heartbeat],
        rpc_timeout=rpc_timeout,
    )
