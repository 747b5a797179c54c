"""`POST /hotLoads/{id}:cancel` on the real Temporal dev server: roles, organizations, the end
state (CANCELED, canceledAt, a condition) and what each replica is reported to serve afterwards.

A cancel stops the walk before the next replica even when the step in flight completes its
all-or-nothing swap anyway, and a step given up before it changed its replica reports that
replica PENDING_UPDATE, never UPDATING. The workflow closes CANCELED.
"""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError, CancelledError

from contracts import names
from tests.helpers.harness import OTHER_ORG, VIEWER, ZONE, Fleet
from tests.helpers.workflow_checks import deployment_state, error, every


async def assert_workflow_canceled(f: Fleet, hot_load_id: str) -> None:
    handle = f.client.get_workflow_handle(names.hot_load_workflow_id("org-a", hot_load_id))
    with pytest.raises(WorkflowFailureError) as ended:
        await handle.result()
    assert isinstance(ended.value.cause, CancelledError)
    assert (await handle.describe()).status == WorkflowExecutionStatus.CANCELED


async def cancel(f: Fleet, hl: str) -> dict:
    """Cancel hot-load ``hl`` (accepted) and wait for its end, which is CANCELED."""
    r = await f.call("POST", f"/hotLoads/{hl}:cancel", json={})
    assert r.status_code == 200, r.text
    end = await f.wait_hot_load(hl)
    assert end["status"]["state"] == "HOT_LOAD_STATE_CANCELED", end["status"]
    return end


async def start_held(f: Fleet, behaviour) -> tuple[str, str]:
    dep = await f.ready_deployment()
    f.apply_behaviour = every(behaviour)
    hl = await f.accepted(dep, "s1")
    await asyncio.wait_for(f.started.wait(), 30)
    return dep, hl


async def test_viewer_cannot_cancel_and_other_org_sees_nothing(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        _, hl = await start_held(f, f.held)
        error(
            await f.call("POST", f"/hotLoads/{hl}:cancel", token=VIEWER, json={}),
            403,
            "permission_denied",
            "canceling a hot-load",
        )
        error(await f.call("POST", f"/hotLoads/{hl}:cancel", token=OTHER_ORG, json={}), 404, "not_found", hl)
        error(await f.call("GET", f"/hotLoads/{hl}", token=OTHER_ORG), 404, "not_found")
        error(await f.call("GET", f"/hotLoads/{hl}/replicas", token=OTHER_ORG), 404, "not_found")
        error(await f.call("POST", "/hotLoads/nope:cancel", json={}), 404, "not_found")
        # Still running: nobody canceled it.
        assert (await f.call("GET", f"/hotLoads/{hl}", token=VIEWER)).json()["hotLoad"]["status"]["state"] == (
            "HOT_LOAD_STATE_IN_PROGRESS"
        )
        f.hold.set()
        assert (await f.wait_hot_load(hl))["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        error(await f.call("POST", f"/hotLoads/{hl}:cancel", json={}), 412, "failed_precondition", "already ended")


async def test_cancel_mid_step_ends_canceled_and_untouched_replicas_keep_their_weights(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path, replicas_per_deployment=3) as f:
        dep, hl = await start_held(f, f.held)
        r = await f.call("POST", f"/hotLoads/{hl}:cancel", json={})
        assert r.status_code == 200, r.text
        st = r.json()["hotLoad"]["status"]
        assert st["state"] == "HOT_LOAD_STATE_CANCELED", st
        assert st["canceledAt"] and st["finishedAt"] and st["canceledAt"] >= st["createdAt"]
        (cond,) = [c for c in st["conditions"] if c["type"] == "Canceled"]
        assert cond["status"] == "STATUS_TRUE" and cond["message"]
        replicas = await f.hot_load_replicas(hl)
        assert [r["state"] for r in replicas[1:]] == ["PENDING_UPDATE", "PENDING_UPDATE"]
        assert all(r["currentSnapshotIdentity"] == "initial" for r in replicas)
        assert f.applied == []  # no step finished, none started after the cancel
        # The deployment is free again and still serves what it served.
        await f.wait_idle(dep)
        dep_view = (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]
        assert dep_view["status"]["currentSnapshotIdentity"] == "initial"
        await assert_workflow_canceled(f, hl)


async def test_cancel_mid_step_leaves_no_replica_updating(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path, replicas_per_deployment=2) as f:
        _, hl = await start_held(f, f.held)
        await f.call("POST", f"/hotLoads/{hl}:cancel", json={})
        await f.wait_hot_load(hl)
        replicas = await f.hot_load_replicas(hl)
        assert all(r["state"] != "UPDATING" for r in replicas), replicas
        assert replicas[0]["state"] == "PENDING_UPDATE" and replicas[0]["finishedAt"]


async def test_cancel_while_a_step_finishes_stops_before_the_next_replica(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path, replicas_per_deployment=3) as f:
        _, hl = await start_held(f, f.held_then_finish)
        f.app.state.cancel_wait_s = 0  # answer at once; the release below lets later steps run
        r = await f.call("POST", f"/hotLoads/{hl}:cancel", json={})
        assert r.status_code == 200
        await asyncio.wait_for(f.cancel_seen.wait(), 30)
        f.hold.set()  # a walk that wrongly goes on finishes at once instead of hanging
        end = await f.wait_hot_load(hl)
        assert f.cancel_seen.is_set()
        assert end["status"]["state"] == "HOT_LOAD_STATE_CANCELED", end["status"]
        # The replica mid-step finished it (all-or-nothing) and says so; the others were not touched.
        assert await f.replica_outcomes(hl) == [
            ("READY", "s1"),
            ("PENDING_UPDATE", "initial"),
            ("PENDING_UPDATE", "initial"),
        ]
        assert "different snapshots" in end["status"]["conditions"][-1]["message"]
        await assert_workflow_canceled(f, hl)


async def held_commit(f: Fleet, replica: str) -> None:
    await f.held(replica, None)


async def held_commit_then_fail(f: Fleet, replica: str) -> None:
    """A held fault point: the replica agent ends the commit it was asked to give up with an error."""
    try:
        await f.held(replica, None)
    except asyncio.CancelledError:
        raise ApplicationError(f"the step on {replica} was canceled while held") from None


@pytest.mark.parametrize(
    ("commit", "name"),
    [
        pytest.param(held_commit, "cancel-walk", id="held"),
        pytest.param(held_commit_then_fail, "cancel-fail", id="fails"),
    ],
)
async def test_cancel_while_a_receiver_commits_leaves_the_rest_on_their_weights(temporal_env, tmp_path, commit, name):
    """Whether the commit in flight ends or fails once the cancel is asked, the walk stops there,
    without starting a step from the bucket, and the deployment goes on."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        state = deployment_state(name, zones=[ZONE])
        state.replicas = f.replica_endpoints(name, 3)
        dep = await f.deployment_from_state(state)
        await f.completed(dep, "base", hotLoadId=f"{name}-base")
        f.peer_events.clear()
        f.commit_behaviour = {"replica-1": lambda replica: commit(f, replica)}
        hl = await f.accepted(
            dep,
            "step-1",
            hotLoadId=f"{name}-1",
            type="SNAPSHOT_TYPE_INCREMENTAL",
            incrementalSnapshotMetadata={"previousSnapshotIdentity": "base"},
        )
        await asyncio.wait_for(f.started.wait(), 30)
        assert ("replica-1", "commit") in f.peer_events  # the walk is at the second replica's commit
        await cancel(f, hl)
        assert await f.replica_outcomes(hl) == [
            ("READY", "step-1"),
            ("PENDING_UPDATE", "base"),
            ("PENDING_UPDATE", "base"),
        ]
        assert [n for n, e in f.peer_events if e in ("commit", "applied")] == ["replica-0", "replica-1"]
        await assert_workflow_canceled(f, hl)
        await f.wait_idle(dep)
        f.commit_behaviour = {}
        f.hold.set()
        await f.completed(dep, "step-2", hotLoadId=f"{name}-2")


async def test_a_first_step_failing_after_a_cancel_ends_canceled_with_every_replica_on_its_weights(
    temporal_env, tmp_path
):
    """The same for an update from the bucket: a step ended with an error once the cancel was
    asked changed nothing (all or nothing), so the operation is CANCELED, not FAILED."""
    async with Fleet(temporal_env.client, tmp_path, replicas_per_deployment=3) as f:

        async def held_then_fail(replica: str, inp) -> None:
            try:
                await f.held(replica, inp)
            except asyncio.CancelledError:
                raise ApplicationError(f"the step on {replica} was canceled while held") from None

        _, hl = await start_held(f, held_then_fail)
        await cancel(f, hl)
        assert await f.replica_outcomes(hl) == [("PENDING_UPDATE", "initial")] * 3
        assert f.applied == []
        await assert_workflow_canceled(f, hl)
