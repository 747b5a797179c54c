"""A SIMULATED node agent (`rollouts sim-node`; a stand-in for scale runs, see
replica/simulated/__init__.py): many simulated replicas in one process.

It reports to the node registry as a real node agent does, with `slots` and SIMULATED `gpus`
(so a deployment asking `resources.gpuCount` lands only here, off a stack's real CPU node).
`start_replicas` creates each replica in this process (replica/simulated/replica.py) with a
Temporal worker on its own queue and signals `replica_ready` with engine URL
`simulated://NODE/NAME`; `stop_replicas` stops them. A replica started with a target chain
serves that chain's newest identity at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.worker import Worker

from contracts import names
from contracts.activities import StartReplicasInput, StopReplicasInput
from contracts.nodes import HEARTBEAT_EVERY_S, NodeHeartbeat, report_heartbeat
from contracts.records import ReplicaEndpoint, rfc3339
from replica.simulated.replica import ENGINE, Behaviour, SimulatedReplica, content

log = logging.getLogger("rollouts.sim-node")


@dataclass
class Running:
    replica: SimulatedReplica
    worker: Worker
    task: asyncio.Task[None]
    workflow_id: str


class SimulatedNode:
    def __init__(
        self,
        client: Client,
        *,
        name: str,
        address: str,
        zone: str,
        slots: int,
        behaviour: Behaviour,
        s3: Any,
        gpus: int = 0,
    ) -> None:
        self.client = client
        self.name, self.address, self.zone, self.slots, self.gpus = name, address, zone, slots, gpus
        self.behaviour = behaviour
        self.s3 = s3
        self.started_at = rfc3339(datetime.now(UTC))
        self.running: dict[str, Running] = {}  # "<deployment workflow id>/<replica>" -> it

    def heartbeat(self) -> NodeHeartbeat:
        return NodeHeartbeat(
            name=self.name,
            address=self.address,
            zone=self.zone,
            slots=self.slots,
            gpus=self.gpus,
            replicas=sorted(self.running),
            agent_pid=os.getpid(),
            started_at=self.started_at,
        )

    async def report(self) -> None:
        await report_heartbeat(self.client, self.heartbeat(), timedelta(seconds=HEARTBEAT_EVERY_S))

    async def report_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.report()
            except Exception as exc:  # noqa: BLE001 - keep the replicas, keep trying
                log.warning("cannot report to the control plane: %s", exc)
            try:
                await asyncio.wait_for(stop.wait(), timeout=HEARTBEAT_EVERY_S)
            except asyncio.TimeoutError:
                pass

    @activity.defn(name=names.START_REPLICAS)
    async def start_replicas(self, inp: StartReplicasInput) -> list[str]:
        started = []
        for name in inp.names:
            key = f"{inp.deployment_workflow_id}/{name}"
            if key in self.running:
                continue
            replica = SimulatedReplica(name=name, deployment=inp.deployment_id, behaviour=self.behaviour, s3=self.s3)
            if inp.target_chain:
                replica.serving = inp.target_chain[-1].identity
                replica.served = content(replica.serving, self.behaviour.state_bytes)
            task_queue = names.replica_task_queue(inp.deployment_workflow_id, name)
            worker = Worker(
                self.client,
                task_queue=task_queue,
                activities=replica.activities(),
                max_concurrent_activity_task_polls=1,
                max_concurrent_activities=4,
                max_heartbeat_throttle_interval=timedelta(seconds=1),
            )
            self.running[key] = Running(replica, worker, asyncio.create_task(worker.run()), inp.deployment_workflow_id)
            now = rfc3339(datetime.now(UTC))
            await self.client.get_workflow_handle(inp.deployment_workflow_id).signal(
                names.REPLICA_READY,
                ReplicaEndpoint(
                    name=name,
                    zone=inp.zone,
                    task_queue=task_queue,
                    node=self.name,
                    engine_url=f"{ENGINE}://{self.name}/{name}",
                    engine_pid=0,
                    agent_pid=os.getpid(),
                    current_snapshot_identity=replica.serving,
                    started_at=now,
                    transitioned_at=now,
                ),
            )
            started.append(name)
        return started

    @activity.defn(name=names.STOP_REPLICAS)
    async def stop_replicas(self, inp: StopReplicasInput) -> int:
        stopped = 0
        for key in [
            k
            for k in self.running
            if k.rsplit("/", 1)[-1] in inp.names and self.running[k].replica.deployment == inp.deployment_id
        ]:
            running = self.running.pop(key)
            await running.worker.shutdown()
            stopped += 1
        return stopped

    async def run(self, stop: asyncio.Event) -> None:
        worker = Worker(
            self.client,
            task_queue=names.node_task_queue(self.name),
            activities=[self.start_replicas, self.stop_replicas],
        )
        async with worker:
            await self.report()
            log.info(
                "SIMULATED node %s (%d slots, %d simulated GPUs) polling %s",
                self.name,
                self.slots,
                self.gpus,
                names.node_task_queue(self.name),
            )
            await self.report_forever(stop)
        await asyncio.gather(*(running.worker.shutdown() for running in self.running.values()))
