"""The node agent process (`rollouts node`): reports this machine and runs its replicas.

It polls `nodes/NAME` for the activities that start and stop replica processes here
(replica/node/activities.py) and reports to the node registry (control/nodes.py) every
`HEARTBEAT_EVERY_S` seconds by signal-with-start. Invariants: after each report it stops any
replica it runs that the registry places elsewhere (after its first `ORPHAN_GRACE_S` seconds),
so a replacement's queue has one poller; a partition leaves its replicas running; replicas
outlive the agent (a restarted one finds them by their pid files); SIGTERM stops the agent only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from temporalio.client import Client
from temporalio.worker import Worker

from common.processes import PidFile, stop_pid
from common.settings import Settings, temporal_client
from contracts import names
from contracts.nodes import HEARTBEAT_EVERY_S, NodeHeartbeat, report_heartbeat
from contracts.records import rfc3339
from replica.node.activities import NodeActivities, NodeIdentity, running_replicas
from replica.node.capacity import shm_bytes

ORPHAN_GRACE_S = 60.0
RPC_TIMEOUT = timedelta(seconds=HEARTBEAT_EVERY_S)

log = logging.getLogger("rollouts.node")


class NodeAgent:
    def __init__(self, client: Client, node: NodeIdentity, gpus: int, slots: int, max_replicas: int = 0) -> None:
        self.client = client
        self.node = node
        self.gpus = gpus
        self.slots = slots
        self.max_replicas = max_replicas
        self.started_at = rfc3339(datetime.now(UTC))
        self.reachable = True

    def _running_keys(self) -> dict[str, tuple[PidFile, int]]:
        out = {}
        for workdir, pid in running_replicas(self.node.home).items():
            data = PidFile(workdir / "replica.pid").read() or {}
            workflow_id = data.get("workflow_id") or ""
            out[f"{workflow_id}/{workdir.name}"] = (PidFile(workdir / "replica.pid"), pid)
        return out

    def heartbeat(self) -> NodeHeartbeat:
        free, total = shm_bytes()
        return NodeHeartbeat(
            name=self.node.name,
            address=self.node.address,
            zone=self.node.zone,
            gpus=self.gpus,
            slots=self.slots,
            max_replicas=self.max_replicas,
            shm_free_bytes=free,
            shm_total_bytes=total,
            replicas=sorted(self._running_keys()),
            agent_pid=os.getpid(),
            started_at=self.started_at,
        )

    async def report(self) -> None:
        """One heartbeat (starting the registry if it does not run), then stop orphans."""
        handle = await report_heartbeat(self.client, self.heartbeat(), RPC_TIMEOUT)
        try:
            placed = set(
                await handle.query("placements_of", self.node.name, result_type=list[str], rpc_timeout=RPC_TIMEOUT)
            )
        except Exception as exc:  # noqa: BLE001 - no control worker answers yet: check next time
            log.debug("placements of %s unknown: %s", self.node.name, exc)
            return
        for key, (pid_file, pid) in self._running_keys().items():
            age = time.time() - pid_file.path.stat().st_mtime
            if key not in placed and age > ORPHAN_GRACE_S:
                log.warning("stopping replica %s (pid %d): the registry places it elsewhere", key, pid)
                await asyncio.to_thread(stop_pid, pid, timeout=30)
                pid_file.remove()

    async def report_forever(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.report()
                if not self.reachable:
                    log.info("control plane reachable again")
                self.reachable = True
            except Exception as exc:  # noqa: BLE001 - a partition: keep the replicas, keep trying
                if self.reachable:
                    log.warning("cannot report to the control plane (%s): replicas keep running; retrying", exc)
                self.reachable = False
            try:
                await asyncio.wait_for(stop.wait(), timeout=HEARTBEAT_EVERY_S)
            except asyncio.TimeoutError:
                pass


async def run_node(settings: Settings, node: NodeIdentity, gpus: int, slots: int) -> int:
    client = await temporal_client(settings)
    # Dynamo's Kubernetes discovery knows a worker by its pod: this pod runs one replica at a time.
    max_replicas = 1 if settings.dynamo_discovery_backend == "kubernetes" else 0
    if max_replicas:
        log.info("Dynamo discovery through Kubernetes: this node agent runs one replica at a time")
    agent = NodeAgent(client, node, gpus, slots, max_replicas)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    acts = NodeActivities(node)
    with ThreadPoolExecutor(max_workers=8) as pool:
        worker = Worker(
            client,
            task_queue=names.node_task_queue(node.name),
            activities=[acts.start_replicas, acts.stop_replicas],
            activity_executor=pool,
        )
        async with worker:
            await agent.report()  # registered before it says ready
            ready = node.home / "run" / "node.ready"
            ready.parent.mkdir(parents=True, exist_ok=True)
            ready.write_text(f"{node.name}\n")
            log.info(
                "node %s (%s, zone %s, %d GPU(s), %d slot(s)) polling %s",
                node.name,
                node.address,
                node.zone,
                gpus,
                slots,
                names.node_task_queue(node.name),
            )
            await agent.report_forever(stop)
    return 0
