"""The fan-out, stage groups and concurrent swaps on the real Temporal dev server with test
replicas (tests/helpers/harness.py):

- `peerFanOut`: replicas that staged pass the update on, a few receivers at a time; each
  replica's `peerRound` is one more than its sender's, and a receiver whose stage fails reads
  the bucket and passes nothing on while the others still stage from peers.
- `replicasPerGroup`: a hot-load larger than a group stages in child workflows, one per group,
  and its own history holds no stage of a group member.
- `maxConcurrentSwaps`: up to k replicas swap at once (never more), and a cancel during such a
  wave leaves each of them on the old weights or the new ones, none UPDATING, and starts no step.
"""

from __future__ import annotations

import asyncio

from temporalio import activity

from contracts import names
from tests.helpers.harness import ORG, Fleet, write_delta
from tests.helpers.workflow_checks import every, on_base

DELTA = {"type": "SNAPSHOT_TYPE_INCREMENTAL", "incrementalSnapshotMetadata": {"previousSnapshotIdentity": "base"}}


def _by_name(replicas: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in replicas}


async def test_the_update_fans_out_in_rounds_and_a_failed_receiver_reads_the_bucket(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "tree", 8, peer_fan_out=2)

        async def broken(replica: str) -> None:
            raise RuntimeError("gloo: connection reset")

        f.stage_behaviour = {"replica-2": broken}
        hl = await f.completed(dep, "step-1", hotLoadId="tree-1", **DELTA)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
        replicas = _by_name(await f.hot_load_replicas("tree-1"))
        assert all(r["state"] == "READY" and r["currentSnapshotIdentity"] == "step-1" for r in replicas.values())
        assert replicas["replica-2"]["source"] == "bucket" and "peerRound" not in replicas["replica-2"]
        peers = {n: r for n, r in replicas.items() if n not in ("replica-0", "replica-2")}
        assert all(r["source"].startswith("peer:") for r in peers.values()), peers
        senders = {r["source"].removeprefix("peer:") for r in peers.values()}
        # A tree, not a broadcast: replicas that staged passed it on; the failed one passed nothing.
        assert senders - {"replica-0"} and "replica-2" not in senders, senders
        for r in peers.values():
            sender = r["source"].removeprefix("peer:")
            assert r["peerRound"] == 1 + (replicas[sender].get("peerRound") or 0), r
        # 7 receivers, 2 per sender and round: 3 rounds, one more for the failed stage's retry at most.
        assert max(r["peerRound"] for r in peers.values()) <= 3
        staged_per_sender: dict[str, int] = {}
        for r in peers.values():
            staged_per_sender[r["source"]] = staged_per_sender.get(r["source"], 0) + 1
        assert max(staged_per_sender.values()) <= 2 * 3  # at most fan_out per round


async def test_a_hot_load_larger_than_a_group_stages_in_child_workflows(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "groups", 10, peer_fan_out=2, replicas_per_group=3)
        hl = await f.completed(dep, "step-1", hotLoadId="groups-1", **DELTA)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
        replicas = await f.hot_load_replicas("groups-1")
        assert [r["name"] for r in replicas] == [f"replica-{i}" for i in range(10)]
        assert all(r["state"] == "READY" and r["currentSnapshotIdentity"] == "step-1" for r in replicas)
        assert [r["source"] == "bucket" for r in replicas] == [True] + [False] * 9
        parent_id = names.hot_load_workflow_id(ORG, "groups-1")
        # 9 receivers in groups of 3: the hot-load stages each group's first member (replica-1, -4,
        # -7), a child workflow per group stages the others.
        staged_here = []
        async for event in f.client.get_workflow_handle(parent_id).fetch_history_events():
            if event.HasField("activity_task_scheduled_event_attributes"):
                attrs = event.activity_task_scheduled_event_attributes
                if attrs.activity_type.name == names.STAGE_FROM_PEER:
                    staged_here.append(attrs.task_queue.name.rsplit("/", 1)[-1])
        assert sorted(staged_here) == ["replica-1", "replica-4", "replica-7"]
        for j, members in enumerate(
            (["replica-2", "replica-3"], ["replica-5", "replica-6"], ["replica-8", "replica-9"])
        ):
            child = f.client.get_workflow_handle(names.stage_group_workflow_id(parent_id, j))
            result = await child.result()
            assert sorted(result["staged"]) == members, result


async def test_up_to_k_replicas_swap_at_once(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "waves", 7, max_concurrent_swaps=3)
        in_flight, most = 0, 0

        async def overlapping(replica: str) -> None:
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            try:
                for _ in range(100):  # until a wave of 3 overlaps (or 5 s: the assertion below fails)
                    if in_flight >= 3:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.1)
            finally:
                in_flight -= 1

        f.commit_behaviour = every(overlapping)
        hl = await f.completed(dep, "step-1", hotLoadId="waves-1", **DELTA)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
        assert most == 3  # the premise: 3 swaps overlapped, and never more
        replicas = await f.hot_load_replicas("waves-1")
        assert all(r["state"] == "READY" and r["currentSnapshotIdentity"] == "step-1" for r in replicas)


async def test_a_cancel_during_a_wave_stops_it_with_every_replica_on_old_or_new_weights(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "wave-cancel", 7, max_concurrent_swaps=3)
        in_flight: set[str] = set()

        async def held(replica: str) -> None:
            in_flight.add(replica)
            while not f.hold.is_set():  # heartbeating, so the cancel reaches the step
                activity.heartbeat()
                await asyncio.sleep(0.05)

        f.commit_behaviour = every(held)
        write_delta(f.bucket_root / f"ckpt/{dep}", "step-1", "base")
        r = await f.create_hot_load(dep, "step-1", hotLoadId="wave-cancel-1", **DELTA)
        assert r.status_code == 200, r.text
        for _ in range(200):
            if len(in_flight) == 3:
                break
            await asyncio.sleep(0.05)
        assert in_flight == {"replica-1", "replica-2", "replica-3"}  # the premise: a wave of 3 in flight
        r = await f.call("POST", "/hotLoads/wave-cancel-1:cancel", json={})
        assert r.status_code == 200, r.text
        hl = await f.wait_hot_load("wave-cancel-1")
        assert hl["status"]["state"] == "HOT_LOAD_STATE_CANCELED", hl["status"]
        replicas = _by_name(await f.hot_load_replicas("wave-cancel-1"))
        assert replicas["replica-0"]["state"] == "READY"
        for name in ("replica-1", "replica-2", "replica-3", "replica-4", "replica-5", "replica-6"):
            assert replicas[name]["state"] == "PENDING_UPDATE", replicas[name]
            assert replicas[name]["currentSnapshotIdentity"] == "base"
        # No step started after the cancel: the replicas past the wave never committed.
        commits = [n for n, e in f.peer_events if e == "commit"]
        assert sorted(commits) == ["replica-1", "replica-2", "replica-3"]
        assert [n for n, _ in f.applied] == ["replica-0"]
