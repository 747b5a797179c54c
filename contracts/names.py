"""Workflow types, ids, updates and signals, task queues and activity names: what the API, the
control worker and each replica agent address each other by.

Client-chosen ids (deployments, gateways, hot-loads) are unique per organization, not globally:
every workflow id built from one carries the organization, `KIND/ORG/ID` (`deployments/org-a/foo`,
`gateways/org-a/gw`, `hotLoads/org-a/step-1-load`), so two organizations can each have their own
`foo` and creating one reveals nothing about the other's. A client-chosen id has no '/', so the
last segment is always the id. A replica's task queue hangs under its deployment's workflow id;
a node agent's is `nodes/NAME`.
"""

CONTROL_TASK_QUEUE = "rollouts-control"

# Workflow types (the class names the control worker registers) and what they answer.
DEPLOYMENT_WORKFLOW = "DeploymentWorkflow"
GATEWAY_WORKFLOW = "GatewayWorkflow"
STAGE_GROUP_WORKFLOW = "StageGroupWorkflow"
HOT_LOAD_WORKFLOW = "HotLoadWorkflow"
# Deployment workflow updates, signals and queries.
UPDATE_CONFIG = "update_config"
CREATE_HOT_LOAD = "create_hot_load"
DELETE = "delete"  # also the gateway workflow's
REPLICA_READY = "replica_ready"
REPLICA_FAILED = "replica_failed"
REPLICA_RETRYING = "replica_retrying"
HOT_LOAD_FINISHED = "hot_load_finished"
# runtime.engine values. dynamo-vllm: each replica is NVIDIA Dynamo's vLLM worker behind Dynamo's
# frontend; the only engine that hot-loads (the guide). vllm: vLLM's OpenAI server behind the gateway
# alone; it serves, without hot-loading.
HOT_LOAD_ENGINE = "dynamo-vllm"
VLLM_ENGINE = "vllm"
ENGINES = (HOT_LOAD_ENGINE, VLLM_ENGINE)

# The node registry (one per control plane, on the control queue): node agents report to it by
# signal; deployments place and release replicas through it (by activity: a workflow cannot call
# another's Update).
NODE_REGISTRY_WORKFLOW = "NodeRegistryWorkflow"
NODE_REGISTRY_ID = "rollouts/nodes"
NODE_HEARTBEAT = "node_heartbeat"
PLACE = "place"
RELEASE = "release"
# The registry tells a deployment its replicas went with a lost node; the deployment tells its
# running hot-load.
REPLICAS_LOST = "replicas_lost"
# A gateway's judgement of a deployment's load (contracts/autoscaling.py).
LOAD_REPORT = "load_report"

# Activities on the control queue.
PLACE_REPLICAS = "place_replicas"
RELEASE_REPLICAS = "release_replicas"
CHECK_SNAPSHOT = "check_snapshot_files"
# Activities on each node agent's own queue (`node_task_queue`): the replica processes it runs.
START_REPLICAS = "start_replicas"
STOP_REPLICAS = "stop_replicas"
# Activities on each replica's own queue (run by its agent, next to the engine).
# An update from the bucket: stage, pause, swap and prove in place, resume.
APPLY_SNAPSHOT = "apply_snapshot"
# The broadcast: the first replica offers and sends to every other at once (each stages off the
# serving path), then each receiver swaps its stage in, one at a time.
OFFER_TO_PEER = "offer_to_peer"
SEND_TO_PEERS = "send_to_peers"
STAGE_FROM_PEER = "stage_from_peer"
COMMIT_PEER_STAGE = "commit_peer_stage"
# Scale-in: the replica leaves its engine's routing pool, then waits for the requests it holds.
DRAIN_REPLICA = "drain_replica"
# Scale-out: a joining replica enters its engine's routing pool as it becomes a member.
SERVE_REPLICA = "serve_replica"


def deployment_workflow_id(organization_id: str, deployment_id: str) -> str:
    return f"deployments/{organization_id}/{deployment_id}"


def gateway_workflow_id(organization_id: str, gateway_id: str) -> str:
    return f"gateways/{organization_id}/{gateway_id}"


def hot_load_workflow_id(organization_id: str, hot_load_id: str) -> str:
    return f"hotLoads/{organization_id}/{hot_load_id}"


def stage_group_workflow_id(hot_load_workflow_id: str, group: int) -> str:
    """A hot-load's stage group J (a child workflow of a large hot-load)."""
    return f"{hot_load_workflow_id}/stage-{group}"


def node_task_queue(node: str) -> str:
    return f"nodes/{node}"


def replica_task_queue(deployment_workflow_id: str, replica_name: str) -> str:
    return f"{deployment_workflow_id}/replicas/{replica_name}"


def dynamo_namespace(workflow_id: str) -> str:
    """The Dynamo namespace of a deployment's workers (one per deployment: a worker counts its
    siblings there; `replica.agent.dynamo`): ``rollouts-`` and the workflow id, every character
    other than a lowercase letter or digit replaced by ``-``."""
    return "rollouts-" + "".join(
        c if c.isascii() and (c.isdigit() or c.islower()) else "-" for c in workflow_id.lower()
    )


def dynamo_model(workflow_id: str) -> str:
    """The model name a deployment's Dynamo workers register under (unique across deployments and
    organizations; the gateway rewrites a request's ``model`` to it and the answer's back)."""
    return workflow_id
