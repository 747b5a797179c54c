"""`POST /hotLoads/{id}:cancel` on the real Temporal dev server: roles, organizations, the end
state (CANCELED, canceledAt, a condition) and what each replica is reported to serve afterwards.

A cancel stops the walk before the next replica even when the step in flight completes its
all-or-nothing swap anyway, and a step given up before it changed its replica reports that
replica PENDING_UPDATE, never UPDATING.
"""

from __future__ import annotations

import asyncio

from tests.helpers.harness import OTHER_ORG, VIEWER, Fleet, write_full
from tests.helpers.workflow_checks import error, every


async def start_held(f: Fleet, behaviour) -> tuple[str, str]:
    dep = await f.ready_deployment()
    f.apply_behaviour = every(behaviour)
    write_full(f.bucket_root / f"ckpt/{dep}", "s1")
    r = await f.create_hot_load(dep, "s1")
    assert r.status_code == 200, r.text
    await asyncio.wait_for(f.started.wait(), 30)
    return dep, r.json()["hotLoad"]["spec"]["id"]


async def test_viewer_cannot_cancel_and_other_org_sees_nothing(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        _, hl = await start_held(f, f.held)
        error(await f.call("POST", f"/hotLoads/{hl}:cancel", token=VIEWER, json={}), 403, "permission_denied",
              "canceling a hot-load")
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
        replicas = await f.hot_load_replicas(hl)
        # The replica mid-step finished it (all-or-nothing) and says so; the others were not touched.
        assert [(r["state"], r["currentSnapshotIdentity"]) for r in replicas] == [
            ("READY", "s1"), ("PENDING_UPDATE", "initial"), ("PENDING_UPDATE", "initial"),
        ]
        assert "different snapshots" in end["status"]["conditions"][-1]["message"]
