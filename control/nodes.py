"""The node registry workflow (type `NodeRegistryWorkflow`, id `rollouts/nodes`): the node agents
and every replica placement of this control plane, with one writer.

Node agents report by signal-with-start (`node_heartbeat`); deployments `place` replicas (an
Update, from the `place_replicas` activity; all or nothing, control/placement.py) and `release`
them; `placements_of(node)` (a query) is what a node agent should run. A node silent for
`lost_after_s` is declared lost: its placements are released and each deployment with a replica
there gets `replicas_lost`. The memo (`nodes`, what `rollouts nodes` shows) changes only when
something a person would read changes. docs/design.md, "Nodes and placement".
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts import names
    from contracts.errors import FAILED_PRECONDITION
    from contracts.nodes import (
        NodeHeartbeat,
        NodeRecord,
        PlaceRequest,
        RegistryState,
        ReleaseRequest,
        ReplicasLost,
        placement_key,
    )
    from contracts.records import Placement, rfc3339
    from control.placement import PlacementError, describe_nodes, place

CHECK_EVERY = timedelta(seconds=3)


def _parse(ts: str) -> datetime:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).astimezone(UTC)


@workflow.defn(name=names.NODE_REGISTRY_WORKFLOW)
class NodeRegistryWorkflow:
    @workflow.init
    def __init__(self, state: RegistryState) -> None:
        self.state = state

    def _now(self) -> str:
        return rfc3339(workflow.now())

    def _memo(self) -> dict[str, Any]:
        return {"nodes": {n: r.wire() for n, r in sorted(self.state.nodes.items())}}

    def _publish(self) -> None:
        workflow.upsert_memo(self._memo())

    @workflow.run
    async def run(self, state: RegistryState) -> None:
        self._publish()
        while True:
            if workflow.info().is_continue_as_new_suggested() and workflow.all_handlers_finished():
                # With its memo as it stands: a new run starts with the memo given here (else the
                # first run's start memo) until its first upsert, and readers see it meanwhile.
                workflow.continue_as_new(self.state, memo=self._memo())
            await workflow.sleep(CHECK_EVERY)
            await self._declare_lost()

    async def _declare_lost(self) -> None:
        now = workflow.now()
        for name, rec in sorted(self.state.nodes.items()):
            silent = (now - _parse(rec.last_seen)).total_seconds()
            if rec.lost or silent <= self.state.lost_after_s:
                continue
            rec.lost, rec.lost_at = True, self._now()
            reason = (
                f"node {name} ({rec.heartbeat.address}) lost: no heartbeat for {silent:.0f} s (last at {rec.last_seen})"
            )
            workflow.logger.warning(reason)
            by_deployment: dict[str, list[str]] = {}
            for key in rec.placements:
                deployment, _, replica = key.rpartition("/")
                by_deployment.setdefault(deployment, []).append(replica)
            rec.placements = {}
            self._publish()
            for deployment, replicas in sorted(by_deployment.items()):
                try:
                    await workflow.get_external_workflow_handle(deployment).signal(
                        names.REPLICAS_LOST, ReplicasLost(node=name, names=sorted(replicas), reason=reason)
                    )
                except Exception as exc:  # noqa: BLE001 - the deployment may be gone
                    workflow.logger.warning("could not tell %s its replicas were lost: %s", deployment, exc)

    @workflow.signal(name=names.NODE_HEARTBEAT)
    def node_heartbeat(self, hb: NodeHeartbeat) -> None:
        rec = self.state.nodes.get(hb.name)
        if rec is None:
            self.state.nodes[hb.name] = NodeRecord(heartbeat=hb, last_seen=self._now())
            workflow.logger.info(
                "node %s joined at %s (zone %s, %d GPU(s), %d slot(s))", hb.name, hb.address, hb.zone, hb.gpus, hb.slots
            )
            self._publish()
            return
        visible = (
            rec.lost,
            rec.heartbeat.address,
            rec.heartbeat.zone,
            rec.heartbeat.gpus,
            rec.heartbeat.slots,
            rec.heartbeat.agent_pid,
        ) != (False, hb.address, hb.zone, hb.gpus, hb.slots, hb.agent_pid)
        if rec.lost:
            workflow.logger.warning("node %s reports again after it was declared lost at %s", hb.name, rec.lost_at)
        rec.heartbeat, rec.last_seen, rec.lost, rec.lost_at = hb, self._now(), False, None
        if visible:
            self._publish()

    @workflow.update(name=names.PLACE)
    def place(self, req: PlaceRequest) -> dict[str, Placement]:
        try:
            result = place(self.state.nodes, req.deployment_workflow_id, req.replicas, req.gpus_per_replica, req.zone)
        except PlacementError as exc:
            raise ApplicationError(
                f"cannot place replica(s) {', '.join(req.replicas)} of {req.deployment_workflow_id}: {exc}",
                type=FAILED_PRECONDITION,
                non_retryable=True,
            ) from None
        for replica, p in result.items():
            self.state.nodes[p.node].placements[placement_key(req.deployment_workflow_id, replica)] = p
        self._publish()
        return result

    @workflow.update(name=names.RELEASE)
    def release(self, req: ReleaseRequest) -> int:
        keys = {placement_key(req.deployment_workflow_id, r) for r in req.replicas}
        released = 0
        for rec in self.state.nodes.values():
            for key in keys & set(rec.placements):
                del rec.placements[key]
                released += 1
        if released:
            self._publish()
        return released

    @workflow.query(name="placements_of")
    def placements_of(self, node: str) -> list[str]:
        rec = self.state.nodes.get(node)
        return sorted(rec.placements) if rec is not None else []

    @workflow.query(name="describe")
    def describe(self) -> str:
        return describe_nodes(self.state.nodes, "")
