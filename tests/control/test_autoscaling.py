"""Autoscaling in the deployment workflow (control/autoscaler.py, contracts/autoscaling.py), on
the real Temporal dev server with test replicas (tests/helpers/harness.py), the load reports
sent as a gateway sends them (the gateway's side: tests/gateway/test_load_report.py).

- BUSY adds one replica, which joins without holding back a hot-load: the deployment stays
  READY and admits one while the new replica starts; the new replica becomes a member only
  after that hot-load ended, first taking the current snapshot from the serving member (it
  started on the base weights: offer, send, stage, commit), then entering the pool. IDLE then
  removes the newest member: out of the replica list, drained, stopped.
- A joiner whose peer stage fails reads the current snapshot from the bucket instead, and joins.
- Never past `max`, never below `min`, and no scale-in while a hot-load runs: it waits for the
  hot-load's end.
"""

from __future__ import annotations

import asyncio

from temporalio.exceptions import ApplicationError

from contracts import names
from contracts.autoscaling import BUSY, IDLE, LoadReport
from tests.helpers.harness import Fleet, poll, write_full

GATEWAY = "gw-load"


async def report(f: Fleet, dep: str, level: str) -> None:
    await f.deployment_handle(dep).signal(names.LOAD_REPORT, LoadReport(gateway_id=GATEWAY, level=level))


async def members(f: Fleet, dep: str) -> list[str]:
    return list((await f.deployment_state(dep)).members)


async def status(f: Fleet, dep: str) -> dict:
    return (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]["status"]


async def test_busy_adds_a_replica_that_joins_between_hot_loads_and_idle_removes_it(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment(
            autoscaling={"min": 1, "max": 2, "targetInFlight": 4, "scaleOutAfterSeconds": 0, "scaleInAfterSeconds": 1}
        )
        [first] = await members(f, dep)
        await f.completed(dep, "s1")
        f.report_ready = False  # the new replica takes its time to start
        await report(f, dep, BUSY)
        joiner = await poll(lambda: _new_placement(f, first), 30, "a new replica placed")

        async def joining() -> dict | None:
            st = await status(f, dep)
            return st if "1 joining" in st["conditions"][0]["message"] else None

        st = await poll(joining, 30, "the deployment says a replica joins")
        assert st["status"] == "STATUS_READY" and st["readyReplicas"] == 1, st
        # A hot-load is admitted while it starts, and walks only the member.
        await f.completed(
            dep, "s2", type="SNAPSHOT_TYPE_INCREMENTAL", incrementalSnapshotMetadata={"previousSnapshotIdentity": "s1"}
        )
        assert (first, "s2") in f.applied and not any(name == joiner for name, _ in f.applied)
        assert await members(f, dep) == [first]
        await f.signal_ready(dep, joiner)  # it serves what it started on, not s2

        async def joined() -> list | None:
            state = await f.deployment_state(dep)
            return state.replicas if len(state.members) == 2 else None

        replicas = await poll(joined, 30, "the new replica a member")
        assert {r.name: r.current_snapshot_identity for r in replicas} == {first: "s2", joiner: "s2"}
        [start] = [s for s in f.start_inputs if s.names == [joiner]]
        assert start.joining and start.target_chain is None  # on the base weights: nothing from the bucket
        assert f.applied[-1] == (joiner, "s2")  # took the current snapshot before it joined
        # From the member, as a hot-load's fan-out passes it on, then into the pool.
        assert [e for n, e in f.peer_events if n == joiner] == ["staged", "commit", "applied", "served"]
        assert (first, "sent") in f.peer_events
        st = await status(f, dep)
        assert st["status"] == "STATUS_READY" and st["readyReplicas"] == 2, st
        assert "joining" not in st["conditions"][0]["message"]

        await report(f, dep, IDLE)
        await asyncio.sleep(1.2)
        await report(f, dep, IDLE)  # the gateway's heartbeat: idle for scaleInAfterSeconds now
        await poll(lambda: _only(f, dep, [first]), 30, "scaled in to one member")
        await poll(lambda: _stopped(f, joiner), 30, "the removed replica stopped")
        assert f.drained == [joiner] and f.stopped == [joiner]
        assert [e for n, e in f.peer_events if n == joiner][-2:] == ["drained", "stopped"]
        st = await status(f, dep)
        assert st["status"] == "STATUS_READY" and st["readyReplicas"] == 1, st
        assert [r.name for r in (await f.deployment_state(dep)).replicas] == [first]


async def test_a_joiner_whose_peer_stage_fails_reads_the_bucket(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment(
            autoscaling={"min": 1, "max": 2, "scaleOutAfterSeconds": 0, "scaleInAfterSeconds": 600}
        )
        [first] = await members(f, dep)
        await f.completed(dep, "s1")
        f.report_ready = False
        await report(f, dep, BUSY)
        joiner = await poll(lambda: _new_placement(f, first), 30, "a new replica placed")

        async def refuse(replica: str) -> None:
            raise ApplicationError(
                f"{replica}: received bytes differ from the sender's checksums",
                type="EngineUpdateError",
                non_retryable=True,
            )

        f.stage_behaviour[joiner] = refuse
        await f.signal_ready(dep, joiner)
        await poll(lambda: _count(f, dep, 2), 30, "the new replica a member")
        state = await f.deployment_state(dep)
        assert {r.name: r.current_snapshot_identity for r in state.replicas} == {first: "s1", joiner: "s1"}
        assert [e for n, e in f.peer_events if n == joiner] == ["applied", "served"]  # from the bucket
        assert (first, "sent") in f.peer_events  # the peer transfer was tried


async def test_no_step_past_max_or_min_and_no_scale_in_while_a_hot_load_runs(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment(
            autoscaling={"min": 1, "max": 2, "scaleOutAfterSeconds": 0, "scaleInAfterSeconds": 0}
        )
        [first] = await members(f, dep)
        await report(f, dep, BUSY)
        await poll(lambda: _count(f, dep, 2), 30, "scaled out to two")
        both = await members(f, dep)
        await report(f, dep, BUSY)  # at max: nothing more
        # A hot-load held in its first replica's step; idle meanwhile must not remove a replica.
        f.apply_behaviour[first] = f.held
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        r = await f.create_hot_load(dep, "s1", hotLoadId="held")
        assert r.status_code == 200, r.text
        await asyncio.wait_for(f.started.wait(), 30)
        await report(f, dep, IDLE)
        await asyncio.sleep(1.0)
        await report(f, dep, IDLE)
        await asyncio.sleep(1.0)
        assert await members(f, dep) == both and f.drained == []
        f.hold.set()
        assert (await f.wait_hot_load("held"))["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        await report(f, dep, IDLE)
        await poll(lambda: _count(f, dep, 1), 30, "scaled in to one once the hot-load ended")
        [removed] = [n for n in both if n not in await members(f, dep)]
        await poll(lambda: _stopped(f, removed), 30, "the removed replica stopped")
        await report(f, dep, IDLE)  # at min: nothing more
        await asyncio.sleep(0.5)
        assert len(await members(f, dep)) == 1 and f.drained == [removed]


async def _new_placement(f: Fleet, first: str) -> str | None:
    return next((n for n in f.placed if n != first), None)


async def _only(f: Fleet, dep: str, names_: list[str]) -> bool | None:
    return True if await members(f, dep) == names_ else None


async def _count(f: Fleet, dep: str, n: int) -> bool | None:
    return True if len(await members(f, dep)) == n else None


async def _stopped(f: Fleet, name: str) -> bool | None:
    return True if name in f.stopped else None
