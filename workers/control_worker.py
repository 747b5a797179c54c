"""The control-plane worker: runs the deployment, gateway and hot-load workflows and the
control activities on the `rollouts-control` task queue.

On start it makes sure the node registry runs (control/nodes.py; a node is declared lost after
`ROLLOUTS_NODE_LOST_AFTER_S` seconds without a heartbeat, 30 by default). Before it reports ready (`run/worker.ready`,
which `rollouts up` waits for before it starts the API), it asks every running deployment to verify its replicas
(`verify_replicas`): after a stack restart no replica process runs, and each deployment restarts them and says
STATUS_UPDATING until they serve again, instead of the READY it last recorded.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDConflictPolicy
from temporalio.worker import Worker

from common.metrics import serve as serve_metrics
from common.settings import Settings, temporal_client
from common.telemetry import setup_tracing, temporal_interceptors
from contracts import names
from contracts.nodes import LOST_AFTER_S, RegistryState
from contracts.search import KIND as RESOURCE_KIND
from control import metrics
from control.activities import ControlActivities
from control.deployment import DeploymentWorkflow
from control.gateway import GatewayWorkflow
from control.hot_load.group import StageGroupWorkflow
from control.hot_load.workflow import HotLoadWorkflow
from control.nodes import NodeRegistryWorkflow

WORKFLOWS = [DeploymentWorkflow, GatewayWorkflow, HotLoadWorkflow, NodeRegistryWorkflow, StageGroupWorkflow]
RUNNING_DEPLOYMENTS = (
    f"ResourceKind='deployment' AND ExecutionStatus='Running' AND TaskQueue='{names.CONTROL_TASK_QUEUE}'"
)
VERIFY_TIMEOUT_S = 120.0

log = logging.getLogger("rollouts.worker")


def control_activities(settings: Settings, client: Client | None = None) -> list:
    acts = ControlActivities(settings, client)
    return [acts.place_replicas, acts.release_replicas, acts.check_snapshot_files]


async def ensure_node_registry(client: Client, lost_after_s: float = LOST_AFTER_S) -> None:
    """Start the node registry if it does not run (node agents may have started it already)."""
    await client.start_workflow(
        NodeRegistryWorkflow.run,
        RegistryState(lost_after_s=lost_after_s),
        id=names.NODE_REGISTRY_ID,
        task_queue=names.CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=TypedSearchAttributes([SearchAttributePair(RESOURCE_KIND, "nodes")]),
    )


async def verify_deployments(client: Client, query: str = RUNNING_DEPLOYMENTS) -> dict[str, str]:
    """Each running deployment restarts the replicas whose process is gone; returns each one's
    status after (or the error, which is logged: one broken deployment does not stop the rest)."""
    ids = [wf.id async for wf in client.list_workflows(query)]

    async def verify(workflow_id: str) -> str:
        handle = client.get_workflow_handle(workflow_id)
        return await asyncio.wait_for(handle.execute_update(DeploymentWorkflow.verify_replicas), VERIFY_TIMEOUT_S)

    results = await asyncio.gather(*(verify(i) for i in ids), return_exceptions=True)
    out: dict[str, str] = {}
    for workflow_id, result in zip(ids, results):
        if isinstance(result, BaseException):
            log.warning("verifying the replicas of %s failed: %r", workflow_id, result)
            out[workflow_id] = f"error: {result!r}"
        else:
            log.info("%s: replicas verified, %s", workflow_id, result)
            out[workflow_id] = result
    return out


async def run_control_worker(settings: Settings) -> None:
    setup_tracing("rollouts-worker")
    runtime, buffer = metrics.buffered_runtime()  # the workflows' metrics, mirrored into Prometheus
    metrics.TemporalMirror(buffer).start()
    metrics_url = serve_metrics(settings.host, settings.ports["worker_metrics"])
    client = await temporal_client(settings, interceptors=temporal_interceptors(), runtime=runtime)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with ThreadPoolExecutor(max_workers=8) as pool:
        worker = Worker(
            client,
            task_queue=names.CONTROL_TASK_QUEUE,
            workflows=WORKFLOWS,
            activities=control_activities(settings, client),
            activity_executor=pool,
        )
        async with worker:
            await ensure_node_registry(client, settings.node_lost_after_s or LOST_AFTER_S)
            try:
                await verify_deployments(client)
            except Exception as exc:  # noqa: BLE001 - the periodic check still restarts them
                log.warning("verifying the deployments' replicas failed: %r", exc)
            ready = settings.home_path / "run" / "worker.ready"
            ready.parent.mkdir(parents=True, exist_ok=True)
            ready.write_text("ok\n")
            log.info("control worker polling %s; metrics at %s", names.CONTROL_TASK_QUEUE, metrics_url)
            await stop.wait()
