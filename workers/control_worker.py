"""The control-plane worker: runs the deployment, gateway and hot-load workflows and the
control activities on the `rollouts-control` task queue."""

from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor

from temporalio.worker import Worker

from activities.control import ControlActivities
from workers.settings import Settings, temporal_client
from workflows import names
from workflows.deployment import DeploymentWorkflow
from workflows.gateway import GatewayWorkflow
from workflows.hot_load import HotLoadWorkflow

WORKFLOWS = [DeploymentWorkflow, GatewayWorkflow, HotLoadWorkflow]


def control_activities(settings: Settings) -> list:
    acts = ControlActivities(settings)
    return [acts.start_replicas, acts.stop_replicas, acts.check_snapshot_files]


async def run_control_worker(settings: Settings) -> None:
    from workers.telemetry import setup_tracing, temporal_interceptors

    setup_tracing("rollouts-worker")
    client = await temporal_client(settings, interceptors=temporal_interceptors())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    with ThreadPoolExecutor(max_workers=8) as pool:
        worker = Worker(
            client,
            task_queue=names.CONTROL_TASK_QUEUE,
            workflows=WORKFLOWS,
            activities=control_activities(settings),
            activity_executor=pool,
        )
        async with worker:
            ready = settings.home_path / "run" / "worker.ready"
            ready.parent.mkdir(parents=True, exist_ok=True)
            ready.write_text("ok\n")
            logging.getLogger("rollouts.worker").info("control worker polling %s", names.CONTROL_TASK_QUEUE)
            await stop.wait()
