"""What the Temporal UI shows of a hot-load, on the real Temporal dev server with test replicas: its
workflow closes as the operation ended (COMPLETED, FAILED with the replica and the reason,
CANCELED), carries a static summary and details naming the operation and, while it runs, live
details of the walk; the API still answers from the memo and the deployment goes on."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError, CancelledError

from contracts import names
from contracts.records import HotLoadState
from contracts.search import STATE
from tests.helpers.harness import ORG, ZONE, Fleet, poll
from tests.helpers.workflow_checks import deployment_state


async def _deployment(f: Fleet, name: str, replicas: int = 3) -> str:
    state = deployment_state(name, zones=[ZONE])
    state.replicas = f.replica_endpoints(name, replicas)
    return await f.deployment_from_state(state)


def _handle(f: Fleet, hot_load_id: str):
    return f.client.get_workflow_handle(names.hot_load_workflow_id(ORG, hot_load_id))


async def _live_details(f: Fleet, hot_load_id: str) -> str:
    meta = await _handle(f, hot_load_id).query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    return meta.current_details


async def _deployment_goes_on(f: Fleet, dep: str, identity: str) -> None:
    """The deployment still runs, took note of the end, and completes the next hot-load."""
    await f.wait_idle(dep)
    assert (await f.deployment_handle(dep).describe()).status == WorkflowExecutionStatus.RUNNING
    f.apply_behaviour = {}
    f.hold.set()
    hl = await f.completed(dep, identity)
    assert (await _handle(f, hl["spec"]["id"]).describe()).status == WorkflowExecutionStatus.COMPLETED


async def test_a_failed_hot_load_is_a_failed_workflow_naming_the_replica(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await _deployment(f, "outcome-failed")
        f.apply_behaviour = {"replica-1": f.broken}
        await f.accepted(dep, "s1", hotLoadId="outcome-failed-1")
        hl = await f.wait_hot_load("outcome-failed-1")

        # The API answers from the memo, as before.
        assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
        (cond,) = [c for c in hl["status"]["conditions"] if c["type"] == "Failed"]
        assert cond["reason"] == "ReplicaFailed" and "replica replica-1: tensor w: Adler-32 mismatch" in cond["message"]
        replicas = await f.hot_load_replicas("outcome-failed-1")
        assert [(r["name"], r["state"]) for r in replicas] == [
            ("replica-0", "READY"),
            ("replica-1", "ERROR"),
            ("replica-2", "PENDING_UPDATE"),
        ]

        # The workflow failed, and says which replica and why.
        # (The memo is final a moment before the workflow closes: it signals its deployment between.)
        handle = _handle(f, "outcome-failed-1")
        with pytest.raises(WorkflowFailureError) as failed:
            await handle.result()
        desc = await handle.describe()
        assert desc.status == WorkflowExecutionStatus.FAILED
        assert desc.typed_search_attributes.get(STATE) == HotLoadState.FAILED.value
        cause = failed.value.cause
        assert isinstance(cause, ApplicationError) and cause.non_retryable and cause.type == "ReplicaFailed"
        assert cause.message == "hot-load outcome-failed-1 failed: replica replica-1: tensor w: Adler-32 mismatch in s1"
        assert await desc.static_summary() == "hot-load outcome-failed-1: s1 (full) on outcome-failed"
        assert "replicas, in walk order: replica-0, replica-1, replica-2" in await desc.static_details()

        # The deployment learned what each replica serves (replica-0 moved) and goes on.
        served = {r.name: r.current_snapshot_identity for r in (await f.deployment_state(dep)).replicas}
        assert served == {"replica-0": "s1", "replica-1": "initial", "replica-2": "initial"}
        await _deployment_goes_on(f, dep, "s2")


async def test_a_canceled_hot_load_is_a_canceled_workflow(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await _deployment(f, "outcome-canceled")
        f.apply_behaviour = {"replica-0": f.held}
        await f.accepted(dep, "s1", hotLoadId="outcome-canceled-1")
        await asyncio.wait_for(f.started.wait(), 30)

        # While it runs, the UI's details say where the walk is.
        details = await poll(
            lambda: _details_if(f, "outcome-canceled-1", "replica-0 UPDATING"),
            30,
            "live details name the replica in flight",
        )
        assert details == "IN_PROGRESS: 0/3 replicas READY; replica-0 UPDATING (from the bucket)"

        r = await f.call("POST", "/hotLoads/outcome-canceled-1:cancel", json={})
        assert r.status_code == 200, r.text
        hl = await f.wait_hot_load("outcome-canceled-1")
        assert hl["status"]["state"] == "HOT_LOAD_STATE_CANCELED", hl["status"]
        assert [r["state"] for r in await f.hot_load_replicas("outcome-canceled-1")] == ["PENDING_UPDATE"] * 3

        handle = _handle(f, "outcome-canceled-1")
        with pytest.raises(WorkflowFailureError) as canceled:
            await handle.result()
        assert isinstance(canceled.value.cause, CancelledError)
        desc = await handle.describe()
        assert desc.status == WorkflowExecutionStatus.CANCELED
        assert desc.typed_search_attributes.get(STATE) == HotLoadState.CANCELED.value
        await _deployment_goes_on(f, dep, "s2")


async def _details_if(f: Fleet, hot_load_id: str, needle: str) -> str | None:
    details = await _live_details(f, hot_load_id)
    return details if needle in details else None


async def test_a_completed_hot_load_returns_its_outcome_and_shows_it_done(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await _deployment(f, "outcome-completed", replicas=2)
        await f.completed(dep, "s1", hotLoadId="outcome-completed-1")
        handle = _handle(f, "outcome-completed-1")
        assert (await handle.describe()).status == WorkflowExecutionStatus.COMPLETED
        outcome = await handle.result()
        assert outcome["state"] == HotLoadState.COMPLETED.value
        assert await _live_details(f, "outcome-completed-1") == "COMPLETED: 2/2 replicas READY"
