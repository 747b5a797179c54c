"""Node agents and placement on the real Temporal dev server.

The node registry (control/nodes.py) runs on the test's own task queue under an id of its own
(it does not depend on its id), with `lost_after_s` of 4 s: heartbeats arrive by signal, `place`
and `release` are Updates, a node that stops heartbeating is declared lost and each deployment
with a replica there hears of it (`replicas_lost`; a stand-in workflow records it here), and a
lost node that heartbeats again takes placements again.

The deployment's side runs with the Fleet (tests/helpers/harness.py): a replica lost with its
node leaves rotation and is placed and started again; a hot-load held on it fails at once with
the registry's reason; a deployment that cannot be placed at creation is STATUS_FAILED with
reason `InsufficientCapacity`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from temporalio import workflow
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from contracts import names
from contracts.errors import FAILED_PRECONDITION
from contracts.nodes import NodeHeartbeat, PlaceRequest, RegistryState, ReleaseRequest, ReplicasLost
from contracts.records import Placement
from control.nodes import NodeRegistryWorkflow
from tests.helpers.harness import Fleet, poll, write_full
from tests.helpers.workflow_checks import every

LOST_AFTER_S = 4.0  # the test beats every 0.3 s: a loaded machine still keeps the others up


@workflow.defn(name="TestLostRecorder", sandboxed=False)
class LostRecorder:
    """Stands in for a deployment workflow: records every `replicas_lost` it is sent."""

    def __init__(self) -> None:
        self.lost: list[ReplicasLost] = []
        self.done = False

    @workflow.run
    async def run(self) -> None:
        await workflow.wait_condition(lambda: self.done)

    @workflow.signal(name=names.REPLICAS_LOST)
    def replicas_lost(self, lost: ReplicasLost) -> None:
        self.lost.append(lost)

    @workflow.signal
    def finish(self) -> None:
        self.done = True

    @workflow.query
    def seen(self) -> list[ReplicasLost]:
        return self.lost


@dataclass
class Registry:
    client: Client
    handle: WorkflowHandle
    task_queue: str
    # Nodes whose heartbeat the background task keeps sending.
    alive: dict[str, NodeHeartbeat] = field(default_factory=dict)

    async def heartbeat(self, name: str, *, slots: int = 1, gpus: int = 0, zone: str = "Z1", keep: bool = True) -> None:
        hb = NodeHeartbeat(name=name, address=f"10.9.0.{len(self.alive) + 1}", zone=zone, gpus=gpus, slots=slots)
        await self.handle.signal(names.NODE_HEARTBEAT, hb)
        if keep:
            self.alive[name] = hb

    async def place(self, deployment: str, *replicas: str, gpus: int = 0, zone: str = "") -> dict[str, Placement]:
        req = PlaceRequest(deployment_workflow_id=deployment, replicas=list(replicas), gpus_per_replica=gpus, zone=zone)
        return await self.handle.execute_update(names.PLACE, req, result_type=dict[str, Placement])

    async def release(self, deployment: str, *replicas: str) -> int:
        req = ReleaseRequest(deployment_workflow_id=deployment, replicas=list(replicas))
        return await self.handle.execute_update(names.RELEASE, req, result_type=int)

    async def placements_of(self, node: str) -> list[str]:
        return await self.handle.query(NodeRegistryWorkflow.placements_of, node)

    async def memo_nodes(self) -> dict:
        return (await (await self.handle.describe()).memo()).get("nodes", {})

    async def until_memo(self, done: Callable[[dict], bool], what: str) -> dict:
        async def check() -> dict | None:
            nodes = await self.memo_nodes()
            return nodes if done(nodes) else None

        return await poll(check, 20, what, every=0.1)

    async def recorder(self) -> WorkflowHandle:
        """A stand-in deployment workflow; its id is what placements name."""
        return await self.client.start_workflow(
            LostRecorder.run, id=f"test-deployment-{uuid.uuid4().hex[:8]}", task_queue=self.task_queue
        )


@asynccontextmanager
async def registry(client: Client) -> AsyncIterator[Registry]:
    task_queue = f"test-nodes-{uuid.uuid4().hex[:12]}"
    async with Worker(client, task_queue=task_queue, workflows=[NodeRegistryWorkflow, LostRecorder]):
        handle = await client.start_workflow(
            NodeRegistryWorkflow.run,
            RegistryState(lost_after_s=LOST_AFTER_S),
            id=f"test-registry-{uuid.uuid4().hex[:8]}",
            task_queue=task_queue,
        )
        reg = Registry(client, handle, task_queue)

        async def keep_alive() -> None:
            while True:
                for hb in list(reg.alive.values()):
                    await handle.signal(names.NODE_HEARTBEAT, hb)
                await asyncio.sleep(0.3)

        beats = asyncio.create_task(keep_alive())
        try:
            yield reg
        finally:
            beats.cancel()
            await handle.terminate("test over")


async def test_place_records_placements_and_release_frees_them(temporal_env) -> None:
    async with registry(temporal_env.client) as reg:
        await reg.heartbeat("n1", slots=1)
        await reg.heartbeat("n2", slots=1)
        await reg.heartbeat("g1", gpus=4, zone="Z2")
        nodes = await reg.until_memo(lambda n: len(n) == 3, "three nodes in the memo")
        assert nodes["n1"]["heartbeat"]["slots"] == 1 and nodes["g1"]["heartbeat"]["gpus"] == 4
        assert all(not rec.get("lost") for rec in nodes.values())

        placed = await reg.place("dep-a", "r0", "r1", zone="Z1")
        assert {p.node for p in placed.values()} == {"n1", "n2"}  # spread: one on each
        where = {r: p.node for r, p in placed.items()}
        assert await reg.placements_of(where["r0"]) == ["dep-a/r0"]
        assert await reg.placements_of(where["r1"]) == ["dep-a/r1"]
        # Placing again is idempotent: the same answer, nothing more taken.
        assert await reg.place("dep-a", "r0", "r1", zone="Z1") == placed
        gpu = await reg.place("dep-g", "r0", "r1", gpus=2, zone="Z2")
        assert sorted(p.devices for p in gpu.values()) == [[0, 1], [2, 3]]
        assert await reg.placements_of("g1") == ["dep-g/r0", "dep-g/r1"]
        nodes = await reg.until_memo(lambda n: len(n["g1"].get("placements", {})) == 2, "g1's placements")
        assert nodes["g1"]["placements"]["dep-g/r1"]["node"] == "g1"

        # Z1 is full: one more is refused, naming each node's state, and nothing changes.
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await reg.place("dep-b", "x0", zone="Z1")
        cause = err.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == FAILED_PRECONDITION, cause
        assert (
            "cannot place replica(s) x0 of dep-b" in cause.message and "not enough capacity in zone Z1" in cause.message
        )
        assert "n1: 0/0 GPU(s), 1/1 slot(s) used" in cause.message and "g1: zone Z2" in cause.message, cause.message
        assert await reg.placements_of("n1") == [f"dep-a/{next(r for r, n in where.items() if n == 'n1')}"]

        # Release frees the place: the refused replica now fits there.
        on_n1 = next(r for r, n in where.items() if n == "n1")
        assert await reg.release("dep-a", on_n1) == 1
        assert await reg.placements_of("n1") == []
        assert (await reg.place("dep-b", "x0", zone="Z1"))["x0"].node == "n1"
        assert await reg.placements_of("n1") == ["dep-b/x0"]
        assert await reg.release("dep-b", "x0", "never-placed") == 1


async def test_a_request_that_does_not_fit_whole_places_none(temporal_env) -> None:
    async with registry(temporal_env.client) as reg:
        await reg.heartbeat("n1", slots=1)
        await reg.heartbeat("n2", slots=1)
        await reg.until_memo(lambda n: len(n) == 2, "two nodes")
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await reg.place("dep-a", "r0", "r1", "r2")
        cause = err.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == FAILED_PRECONDITION, cause
        assert "r0, r1, r2" in cause.message and "each need 1 CPU slot" in cause.message, cause.message
        assert await reg.placements_of("n1") == [] and await reg.placements_of("n2") == []
        assert len(await reg.place("dep-a", "r0", "r1")) == 2  # two did fit: none was placed above


async def test_no_node_at_all_is_a_failed_precondition_saying_so(temporal_env) -> None:
    async with registry(temporal_env.client) as reg:
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await reg.place("dep-a", "r0")
        cause = err.value.cause
        assert isinstance(cause, ApplicationError) and cause.type == FAILED_PRECONDITION, cause
        assert "no node agent has registered" in cause.message, cause.message


async def test_a_silent_node_is_lost_its_deployments_are_told_and_it_comes_back(temporal_env) -> None:
    async with registry(temporal_env.client) as reg:
        dep = await reg.recorder()
        bystander = await reg.recorder()  # holds nothing on the node that goes: told nothing
        await reg.heartbeat("n1", slots=2)
        await reg.heartbeat("n2", slots=1)
        await reg.until_memo(lambda n: len(n) == 2, "two nodes")
        placed = await reg.place(dep.id, "r0", "r1")
        assert {p.node for p in placed.values()} == {"n1", "n2"}
        gone = next(r for r, p in placed.items() if p.node == "n2")
        stays = next(r for r, p in placed.items() if p.node == "n1")
        await reg.place(bystander.id, "b0")
        assert (await reg.placements_of("n1")) == sorted([f"{dep.id}/{stays}", f"{bystander.id}/b0"])

        del reg.alive["n2"]  # n2 stops heartbeating; n1 keeps on
        nodes = await reg.until_memo(lambda n: n["n2"].get("lost"), "n2 declared lost")
        assert not nodes["n1"].get("lost") and nodes["n2"].get("lostAt")
        assert nodes["n2"].get("placements", {}) == {} and await reg.placements_of("n2") == []

        seen = await poll(lambda: _seen(dep), 20, "the deployment told", every=0.1)
        assert len(seen) == 1, seen
        (lost,) = seen
        assert lost.node == "n2" and lost.names == [gone], lost
        assert "node n2" in lost.reason and "lost" in lost.reason and "no heartbeat" in lost.reason, lost.reason
        assert await bystander.query(LostRecorder.seen) == []
        assert await reg.placements_of("n1") == sorted([f"{dep.id}/{stays}", f"{bystander.id}/b0"])

        # The lost replica cannot go back to n2 while it is lost; n1 is full.
        with pytest.raises(WorkflowUpdateFailedError) as err:
            await reg.place(dep.id, gone)
        message = err.value.cause.message
        assert "n2: lost (no heartbeat since" in message and "n1: 0/0 GPU(s), 2/2 slot(s) used" in message, message

        # n2 reports again: up, and it takes the replica.
        await reg.heartbeat("n2", slots=1)
        nodes = await reg.until_memo(lambda n: not n["n2"].get("lost"), "n2 up again")
        assert nodes["n2"].get("lostAt") is None
        assert (await reg.place(dep.id, gone))[gone].node == "n2"
        assert await reg.placements_of("n2") == [f"{dep.id}/{gone}"]
        assert len(await _seen(dep)) == 1  # told once
        for handle in (dep, bystander):
            await handle.signal(LostRecorder.finish)


async def _seen(handle: WorkflowHandle) -> list[ReplicasLost] | None:
    return await handle.query(LostRecorder.seen) or None


# --------------------------------------------------------------------------- the deployment's side
def lost_reason(f: Fleet) -> str:
    """What the registry says of a lost node (control/nodes.py), unique to this test."""
    return f"node {f.node} (127.0.0.1) lost: no heartbeat for 31 s (test {uuid.uuid4().hex[:6]})"


async def _status(f: Fleet, dep: str) -> dict:
    return (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]["status"]


async def _until(f: Fleet, dep: str, done: Callable[[dict], bool]) -> dict:
    async def check() -> dict | None:
        st = await _status(f, dep)
        return st if done(st) else None

    return await poll(check, 30, f"deployment {dep} status")


async def _placed_and_started_again(f: Fleet, dep: str, name: str) -> None:
    """The supervision placed `name` again and started it: it waits in pending for its ready."""

    async def check() -> bool | None:
        state = await f.deployment_state(dep)
        again = f.placed.count(name) == 2 and name in state.pending_replicas and name in state.placements
        return True if again else None

    await poll(check, 30, f"{name} placed and started again")


async def test_a_replica_lost_with_its_node_leaves_rotation_and_is_placed_and_started_again(
    temporal_env, tmp_path
) -> None:
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        gone, stays = (await f.deployment_state(dep)).members
        assert f.placed.count(gone) == 1 and f.placed.count(stays) == 1
        f.report_ready = False  # the replica started again reports ready when the test says so
        await f.lose(dep, gone)  # its process went with its node
        reason = lost_reason(f)
        await f.deployment_handle(dep).signal(
            names.REPLICAS_LOST, ReplicasLost(node=f.node, names=[gone, "not-a-member"], reason=reason)
        )
        st = await _until(f, dep, lambda st: st["readyReplicas"] == 1)
        assert st["status"] == "STATUS_UPDATING", st
        (cond,) = st["conditions"]
        assert cond["reason"] == "ReplicasRestarting" and gone in cond["message"], cond
        assert "1 of 2 serving" in cond["message"], cond
        replicas = (await f.deployment_state(dep)).replicas
        assert [r.name for r in replicas] == [stays]  # out of rotation
        # No hot-load runs: the supervision places it again (the other keeps its place) and starts it.
        await _placed_and_started_again(f, dep, gone)
        assert f.placed.count(stays) == 1 and "not-a-member" not in f.placed
        assert (await _status(f, dep))["status"] == "STATUS_UPDATING"
        await f.signal_ready(dep, gone)
        st = (await f.wait_deployment(dep))["status"]
        assert st["readyReplicas"] == 2 and st["conditions"][0]["reason"] == "AllReplicasReady", st


async def test_a_hot_load_held_on_a_replica_lost_with_its_node_fails_at_once(temporal_env, tmp_path) -> None:
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        # Every replica's update holds (heartbeating) until released: it never ends by itself,
        # so only the lost node can end the step.
        f.apply_behaviour = every(f.held)
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        r = await f.create_hot_load(dep, "s1")
        assert r.status_code == 200, r.text
        hl = r.json()["hotLoad"]["spec"]["id"]
        await asyncio.wait_for(f.started.wait(), 30)
        walk = await f.hot_load_replicas(hl)
        held, after = walk[0]["name"], walk[1]["name"]
        assert walk[0]["state"] == "UPDATING", walk
        reason = lost_reason(f)
        await f.deployment_handle(dep).signal(
            names.REPLICAS_LOST, ReplicasLost(node=f.node, names=[held], reason=reason)
        )
        end = await f.wait_hot_load(hl)
        assert not f.hold.is_set() and f.applied == []  # the held step was still running
        assert end["status"]["state"] == "HOT_LOAD_STATE_FAILED", end["status"]
        assert any(held in c["message"] and reason in c["message"] for c in end["status"]["conditions"]), end
        walk = {r["name"]: r for r in await f.hot_load_replicas(hl)}
        assert walk[held]["state"] == "ERROR", walk
        assert reason in walk[held]["errorReason"], walk[held]
        assert walk[after]["state"] == "PENDING_UPDATE" and walk[after]["currentSnapshotIdentity"] == "initial", walk
        # The operation over, the supervision places the lost replica again and starts it.
        f.report_ready = False
        await f.lose(dep, held)
        await f.wait_idle(dep)
        await _placed_and_started_again(f, dep, held)
        await f.signal_ready(dep, held)
        assert (await f.wait_deployment(dep))["status"]["readyReplicas"] == 2


async def test_a_deployment_that_cannot_be_placed_at_creation_is_failed(temporal_env, tmp_path) -> None:
    async with Fleet(temporal_env.client, tmp_path) as f:
        f.place_error = (
            "cannot place replica(s) of the test: not enough capacity in zone LOCAL-1A: 2 replica(s) each "
            "need 1 CPU slot; nodes: n1: 0/0 GPU(s), 1/1 slot(s) used"
        )
        dep = await f.ready_deployment(wait=False)
        st = (await f.wait_deployment(dep, "STATUS_FAILED"))["status"]
        (cond,) = st["conditions"]
        assert cond["reason"] == "InsufficientCapacity" and cond["status"] == "STATUS_FALSE", cond
        assert f.place_error in cond["message"], cond
        state = await f.deployment_state(dep)
        assert state.placements == {} and state.replicas == [] and f.placed == []  # nothing started
