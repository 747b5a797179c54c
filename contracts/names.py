"""Workflow types, ids, updates and signals, task queues and activity names: what the API, the
control worker and each replica agent address each other by.

Client-chosen ids (deployments, gateways, hot-loads) are unique per organization, not globally:
every workflow id built from one carries the organization, `KIND/ORG/ID` (`deployments/org-a/foo`,
`gateways/org-a/gw`, `hotLoads/org-a/step-1-load`), so two organizations can each have their own
`foo` and creating one reveals nothing about the other's. A client-chosen id has no '/', so the
last segment is always the id. A replica's task queue hangs under its deployment's workflow id.
"""

CONTROL_TASK_QUEUE = "rollouts-control"

# Workflow types (the class names the control worker registers) and what they answer.
DEPLOYMENT_WORKFLOW = "DeploymentWorkflow"
GATEWAY_WORKFLOW = "GatewayWorkflow"
HOT_LOAD_WORKFLOW = "HotLoadWorkflow"
# Deployment workflow updates, signals and queries.
UPDATE_CONFIG = "update_config"
CREATE_HOT_LOAD = "create_hot_load"
DELETE = "delete"  # also the gateway workflow's
VERIFY_REPLICAS = "verify_replicas"
REPLICA_READY = "replica_ready"
REPLICA_FAILED = "replica_failed"
HOT_LOAD_FINISHED = "hot_load_finished"
DESCRIBE = "describe"
# The engine every hot-loadable deployment runs (the guide: hot-loading requires it).
HOT_LOAD_ENGINE = "dynamo-vllm"

# Activities on the control queue.
START_REPLICAS = "start_replicas"
STOP_REPLICAS = "stop_replicas"
CHECK_SNAPSHOT = "check_snapshot_files"
# Activities on each replica's own queue (run by its agent, next to the engine).
# An update from the bucket: stage, pause, swap and prove in place, resume.
APPLY_SNAPSHOT = "apply_snapshot"
# The broadcast: the first replica offers and sends to every other at once (each stages off the
# serving path), then each receiver swaps its stage in, one at a time.
OFFER_TO_PEER = "offer_to_peer"
SEND_TO_PEERS = "send_to_peers"
STAGE_FROM_PEER = "stage_from_peer"
COMMIT_PEER_STAGE = "commit_peer_stage"


def deployment_workflow_id(organization_id: str, deployment_id: str) -> str:
    return f"deployments/{organization_id}/{deployment_id}"


def gateway_workflow_id(organization_id: str, gateway_id: str) -> str:
    return f"gateways/{organization_id}/{gateway_id}"


def hot_load_workflow_id(organization_id: str, hot_load_id: str) -> str:
    return f"hotLoads/{organization_id}/{hot_load_id}"


def replica_task_queue(deployment_workflow_id: str, replica_name: str) -> str:
    return f"{deployment_workflow_id}/replicas/{replica_name}"
