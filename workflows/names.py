"""Workflow ids, task queues and activity names shared by api/, workflows/ and activities/.

Hot-load workflows use the hot-load id itself (so the Temporal UI finds an operation by its id);
entity workflows carry a `kind/` prefix, which a client-chosen id (no '/') can never collide with.
"""

CONTROL_TASK_QUEUE = "rollouts-control"

# Activities on the control queue.
START_REPLICAS = "start_replicas"
STOP_REPLICAS = "stop_replicas"
CHECK_SNAPSHOT = "check_snapshot_files"
# Activities on each replica's own queue (run by its agent, next to the engine).
APPLY_SNAPSHOT = "apply_snapshot"
OFFER_TO_PEER = "offer_to_peer"
SEND_TO_PEER = "send_to_peer"
RECEIVE_FROM_PEER = "receive_from_peer"
# The broadcast walk: one updated replica sends to every other at once (staged, off the serving
# path), then each receiver swaps its stage in, one at a time.
SEND_TO_PEERS = "send_to_peers"
STAGE_FROM_PEER = "stage_from_peer"
COMMIT_PEER_STAGE = "commit_peer_stage"


def deployment_workflow_id(deployment_id: str) -> str:
    return f"deployments/{deployment_id}"


def gateway_workflow_id(gateway_id: str) -> str:
    return f"gateways/{gateway_id}"


def hot_load_workflow_id(hot_load_id: str) -> str:
    return hot_load_id


def replica_task_queue(deployment_id: str, replica_name: str) -> str:
    return f"replica/{deployment_id}/{replica_name}"
