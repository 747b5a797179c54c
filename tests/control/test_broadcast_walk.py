"""The walk's branches on the real Temporal dev server with test replicas: after the first replica
(from the bucket), every receiver stages at once and commits as soon as its own stage is ready,
in walk order, one at a time. For a delta the first replica offers from its checked stage
before its swap (else after its commit); a receiver whose stage or commit fails reads the
bucket; a replica that fails from the bucket too fails the walk (a failed workflow naming it)
and leaves the replicas after it on their weights; without peer transfer every replica reads
the bucket."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError

from contracts import names
from contracts.records import (
    HotLoad,
    HotLoadConfig,
    HotLoadInput,
    HotLoadSpec,
    HotLoadState,
    HotLoadStatus,
    SnapshotRef,
    SnapshotType,
)
from contracts.search import hot_load_attributes
from control.hot_load.workflow import HotLoadWorkflow
from tests.helpers.harness import ORG, ZONE, Fleet, write_delta, write_full
from tests.helpers.workflow_checks import deployment_state, on_base


async def _workflow_failure(f: Fleet, hot_load_id: str) -> str:
    """The hot-load workflow's failure message, after checking that it closed FAILED."""
    handle = f.client.get_workflow_handle(names.hot_load_workflow_id(ORG, hot_load_id))
    with pytest.raises(WorkflowFailureError) as failed:
        await handle.result()
    assert (await handle.describe()).status == WorkflowExecutionStatus.FAILED
    assert isinstance(failed.value.cause, ApplicationError)
    return failed.value.cause.message


async def sources(f: Fleet, hl_id: str) -> list[str]:
    """Each replica's source (``bucket`` or ``peer:<sender>``), replica-0 first."""
    replicas = {r["name"]: r for r in await f.hot_load_replicas(hl_id)}
    return [replicas[f"replica-{i}"]["source"] for i in range(len(replicas))]


async def test_receivers_commit_as_their_stages_finish_and_a_failed_stage_reads_the_bucket(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        state = deployment_state("walk", zones=[ZONE])
        state.replicas = f.replica_endpoints("walk", 4)
        dep = await f.deployment_from_state(state)
        slow_done = asyncio.Event()

        async def slow(replica: str) -> None:
            await asyncio.sleep(1.5)
            slow_done.set()

        async def broken(replica: str) -> None:
            raise RuntimeError("gloo: connection reset")

        f.stage_behaviour = {"replica-2": slow, "replica-3": broken}
        await f.completed(dep, "step-1", hotLoadId="walk-1")
        assert await sources(f, "walk-1") == [
            "bucket",
            "peer:replica-0",
            "peer:replica-0",
            "bucket",
        ]
        outcomes = await f.replica_outcomes("walk-1")
        assert all(state == "READY" for state, _ in outcomes), outcomes
        # One replica at a time, in walk order: replica-1 committed while replica-2 still staged.
        commits = [name for name, event in f.peer_events if event == "commit"]
        assert commits == ["replica-1", "replica-2"]
        assert f.peer_events.index(("replica-1", "commit")) < f.peer_events.index(("replica-2", "staged"))
        assert [name for name, _ in f.applied] == ["replica-0", "replica-1", "replica-2", "replica-3"]
        # A full snapshot has no delta files to offer early: the offer came after the commit.
        assert ("replica-0", "offered") not in f.peer_events
        assert f.peer_events.index(("replica-0", "applied")) < f.peer_events.index(("replica-1", "staged"))


DELTA = {"type": "SNAPSHOT_TYPE_INCREMENTAL", "incrementalSnapshotMetadata": {"previousSnapshotIdentity": "base"}}


async def _all_staged(f: Fleet, receivers: int, timeout: float = 20.0) -> bool:
    """True once `receivers` broadcast stages were seen (False after `timeout`)."""
    for _ in range(int(timeout / 0.05)):
        if sum(1 for _, event in f.peer_events if event == "staged") >= receivers:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_receivers_stage_while_the_first_replica_swaps_and_commit_after_it(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "early", 4)

        async def swap_once_all_staged(replica: str) -> None:
            # Only an offer made from replica-0's stage, before its swap, lets this return.
            if not await _all_staged(f, 3):
                raise ApplicationError("no receiver staged during the first replica's swap", non_retryable=True)

        f.swap_behaviour = {"replica-0": swap_once_all_staged}
        await f.completed(dep, "step-1", hotLoadId="early-1", **DELTA)
        assert await sources(f, "early-1") == ["bucket"] + ["peer:replica-0"] * 3
        events = f.peer_events
        assert events.index(("replica-0", "offered")) < min(i for i, (_, e) in enumerate(events) if e == "staged")
        # The receivers commit only after the first replica serves the update, in walk order.
        first_commit = min(i for i, (_, e) in enumerate(events) if e == "commit")
        assert events.index(("replica-0", "applied")) < first_commit
        assert [n for n, e in events if e == "commit"] == ["replica-1", "replica-2", "replica-3"]
        assert [name for name, _ in f.applied] == ["replica-0", "replica-1", "replica-2", "replica-3"]


async def test_a_first_replica_that_fails_its_swap_leaves_the_receivers_on_their_weights(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "early-fail", 3)

        async def swap_fails(replica: str) -> None:
            await _all_staged(f, 2)
            raise ApplicationError("engine: load_weights failed; it serves its previous weights", non_retryable=True)

        f.swap_behaviour = {"replica-0": swap_fails}
        write_delta(f.bucket_root / f"ckpt/{dep}", "step-1", "base")
        r = await f.create_hot_load(dep, "step-1", hotLoadId="early-fail-1", **DELTA)
        assert r.status_code == 200, r.text
        hl = await f.wait_hot_load("early-fail-1")
        assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
        replicas = {r["name"]: r for r in await f.hot_load_replicas("early-fail-1")}
        assert replicas["replica-0"]["state"] == "ERROR"
        assert "load_weights failed" in replicas["replica-0"]["errorReason"]
        # The receivers staged at most: none committed, none moved.
        assert [e for _, e in f.peer_events if e == "commit"] == []
        assert {replicas[n]["state"] for n in ("replica-1", "replica-2")} == {"PENDING_UPDATE"}
        assert {replicas[n]["currentSnapshotIdentity"] for n in ("replica-1", "replica-2")} == {"base"}
        assert f.applied == []
        assert "replica replica-0: engine: load_weights failed" in await _workflow_failure(f, "early-fail-1")


async def test_without_an_early_offer_the_first_replica_broadcasts_after_its_commit(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "late", 3)
        f.refuse_early_offer = True
        await f.completed(dep, "step-1", hotLoadId="late-1", **DELTA)
        assert await sources(f, "late-1") == ["bucket"] + ["peer:replica-0"] * 2
        events = f.peer_events
        assert events.index(("replica-0", "applied")) < min(i for i, (_, e) in enumerate(events) if e == "staged")


async def test_a_receiver_whose_commit_fails_reads_the_bucket(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "commit-fails", 3)

        async def swap_fails(replica: str) -> None:
            raise ApplicationError("engine: commit_staged refused the stage", non_retryable=True)

        f.commit_behaviour = {"replica-1": swap_fails}
        await f.completed(dep, "step-1", hotLoadId="commit-fails-1", **DELTA)
        assert await sources(f, "commit-fails-1") == ["bucket", "bucket", "peer:replica-0"]
        assert await f.replica_outcomes("commit-fails-1") == [("READY", "step-1")] * 3
        assert [n for n, e in f.peer_events if e == "commit"] == ["replica-1", "replica-2"]


async def test_a_receiver_failing_from_the_bucket_too_fails_the_walk_and_later_replicas_keep_theirs(
    temporal_env, tmp_path
):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await on_base(f, "receiver-fails", 3)

        async def stage_fails(replica: str) -> None:
            raise RuntimeError("gloo: connection reset")

        f.stage_behaviour = {"replica-1": stage_fails}
        f.apply_behaviour = {"replica-1": f.broken}
        hl = await f.wait_hot_load(await f.accepted(dep, "step-1", hotLoadId="receiver-fails-1", **DELTA))
        assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
        replicas = await f.hot_load_replicas("receiver-fails-1")
        assert await f.replica_outcomes("receiver-fails-1") == [
            ("READY", "step-1"),
            ("ERROR", "base"),
            ("PENDING_UPDATE", "base"),
        ]
        assert "Adler-32 mismatch" in replicas[1]["errorReason"]
        # replica-2 had staged, but never committed: the walk stopped at replica-1.
        assert ("replica-2", "staged") in f.peer_events and ("replica-2", "commit") not in f.peer_events
        assert "replicas serving different snapshots: base, step-1" in hl["status"]["conditions"][-1]["message"]
        message = await _workflow_failure(f, "receiver-fails-1")
        assert message == "hot-load receiver-fails-1 failed: replica replica-1: tensor w: Adler-32 mismatch in step-1"


async def test_without_peer_transfer_every_replica_reads_the_bucket(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        endpoints = f.replica_endpoints("no-peers", 3)
        write_full(f.bucket_root / "ckpt/no-peers", "s1")
        now = "2026-01-01T00:00:00.000000Z"
        hot_load = HotLoad(
            spec=HotLoadSpec(
                id="no-peers-1",
                deployment_id="no-peers",
                organization_id=ORG,
                identity="s1",
                type=SnapshotType.FULL,
                snapshot_chain=[SnapshotRef(identity="s1", type=SnapshotType.FULL, hot_load_id="no-peers-1")],
            ),
            status=HotLoadStatus(state=HotLoadState.PENDING, created_at=now, updated_at=now),
        )
        # No deployment workflow: its signal fails, which the hot-load only logs.
        outcome = await f.client.execute_workflow(
            HotLoadWorkflow.run,
            HotLoadInput(
                hot_load=hot_load,
                hot_load_config=HotLoadConfig(bucket="rollouts", path_prefix="ckpt/no-peers"),
                replicas=endpoints,
                deployment_workflow_id=names.deployment_workflow_id(ORG, "absent"),
                peer_transfer=False,
            ),
            id=names.hot_load_workflow_id(ORG, "no-peers-1"),
            task_queue=f.task_queue,
            search_attributes=hot_load_attributes(hot_load),
            memo={"hotLoad": hot_load.wire()},
        )
        assert outcome.state == HotLoadState.COMPLETED
        assert [(r.name, r.source) for r in outcome.replicas] == [(f"replica-{i}", "bucket") for i in range(3)]
        assert [e for _, e in f.peer_events] == ["applied"] * 3
