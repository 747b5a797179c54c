"""A control worker as its own process, for durability tests to kill -9: the real deployment,
gateway and hot-load workflows on a test's task queue, with the control activities under their
real names as the test's ``Fleet`` registers them (every replica placed on the fleet's stand-in
node, whose queue the test process serves; snapshot files are checked in a local directory).

    python -m tests.helpers.control_process ADDRESS TASK_QUEUE BUCKET_ROOT READY_FILE
"""

from __future__ import annotations

import asyncio
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from temporalio import activity
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Worker

from contracts import names
from contracts.activities import CheckSnapshotInput
from contracts.nodes import PlaceRequest, ReleaseRequest
from contracts.records import Placement
from control.deployment import DeploymentWorkflow
from control.gateway import GatewayWorkflow
from control.hot_load.group import StageGroupWorkflow
from control.hot_load.workflow import HotLoadWorkflow
from tests.helpers.harness import check_local_snapshot, fleet_node


async def main(address: str, task_queue: str, bucket_root: Path, ready: Path) -> None:
    @activity.defn(name=names.PLACE_REPLICAS)
    def place_replicas(req: PlaceRequest) -> dict[str, Placement]:
        return {name: Placement(node=fleet_node(task_queue), address="127.0.0.1") for name in req.replicas}

    @activity.defn(name=names.RELEASE_REPLICAS)
    def release_replicas(req: ReleaseRequest) -> int:
        return len(req.replicas)

    @activity.defn(name=names.CHECK_SNAPSHOT)
    def check_snapshot_files(inp: CheckSnapshotInput) -> list[str]:
        return check_local_snapshot(bucket_root, inp)

    client = await Client.connect(address, data_converter=pydantic_data_converter)
    with ThreadPoolExecutor(max_workers=4) as pool:
        async with Worker(
            client,
            task_queue=task_queue,
            workflows=[DeploymentWorkflow, GatewayWorkflow, HotLoadWorkflow, StageGroupWorkflow],
            activities=[place_replicas, release_replicas, check_snapshot_files],
            activity_executor=pool,
        ):
            ready.write_text("ok\n")
            await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])))
