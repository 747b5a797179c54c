"""`PATCH /deployments/{id}` on the real Temporal dev server: the hotLoad section must come back
unchanged, only what needs no new replicas may change, and nothing changes while a hot-load runs."""

from __future__ import annotations

import asyncio

from tests.workflows.harness import OTHER_ORG, VIEWER, Fleet, write_full
from tests.workflows.test_admission import _every, error


def hot_load_section(dep: str) -> dict:
    return {"bucket": "rollouts", "pathPrefix": f"ckpt/{dep}", "transitionMode": "TRANSITION_MODE_ASYNC"}


async def test_update_changes_engine_config_and_traffic(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        body = {
            "hotLoad": hot_load_section(dep),
            "runtime": {"engine": "dynamo-vllm", "version": "0.32.1", "engineConfig": {"enable-return-routed-experts": ""}},
            "traffic": {"weight": 40},
        }
        r = await f.call("PATCH", f"/deployments/{dep}", json=body)
        assert r.status_code == 200, r.text
        spec = r.json()["deployment"]["spec"]
        assert spec["runtime"]["engineConfig"] == {"enable-return-routed-experts": ""}
        assert spec["runtime"]["version"] == "0.32.1" and spec["traffic"] == {"weight": 40}
        # Stored: a later read (from the memo, no query) sees it; the replicas were not replaced.
        got = (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]
        assert got["spec"]["traffic"] == {"weight": 40}
        assert got["status"]["status"] == "STATUS_READY" and got["status"]["readyReplicas"] == 2
        assert got["spec"]["hotLoad"] == hot_load_section(dep)


async def test_update_that_omits_or_changes_hot_load_is_refused(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        error(await f.call("PATCH", f"/deployments/{dep}", json={"traffic": {"weight": 10}}), 400,
              "invalid_argument", "hotLoad", "must include")
        changed = {**hot_load_section(dep), "pathPrefix": "elsewhere"}
        error(await f.call("PATCH", f"/deployments/{dep}", json={"hotLoad": changed}), 400,
              "invalid_argument", "hotLoad", "immutable")
        error(await f.call("PATCH", f"/deployments/{dep}",
                           json={"hotLoad": hot_load_section(dep), "autoscaling": {"min": 3, "max": 3}}),
              400, "invalid_argument", "autoscaling", "cannot be changed")
        error(await f.call("PATCH", f"/deployments/{dep}",
                           json={"hotLoad": hot_load_section(dep), "model": {"name": "x", "bucket": "rollouts", "path": "p"}}),
              400, "invalid_argument", "model")
        assert (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]["spec"]["traffic"] == {"weight": 100}
        plain = await f.ready_deployment(hot_load=False)
        error(await f.call("PATCH", f"/deployments/{plain}", json={"hotLoad": hot_load_section(plain)}), 400,
              "invalid_argument", "cannot be added")
        r = await f.call("PATCH", f"/deployments/{plain}", json={"traffic": {"weight": 5}})
        assert r.status_code == 200 and r.json()["deployment"]["spec"]["traffic"] == {"weight": 5}


async def test_no_update_while_a_hot_load_runs(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        f.apply_behaviour = _every(f.held)
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        r = await f.create_hot_load(dep, "s1", hotLoadId="busy")
        assert r.status_code == 200
        await asyncio.wait_for(f.started.wait(), 30)
        body = {"hotLoad": hot_load_section(dep), "traffic": {"weight": 10}}
        error(await f.call("PATCH", f"/deployments/{dep}", json=body), 412, "failed_precondition",
              "busy is already in progress")
        f.hold.set()
        await f.wait_hot_load("busy")
        await f.wait_idle(dep)
        assert (await f.call("PATCH", f"/deployments/{dep}", json=body)).status_code == 200


async def test_update_roles_and_organizations(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        body = {"hotLoad": hot_load_section(dep), "traffic": {"weight": 10}}
        error(await f.call("PATCH", f"/deployments/{dep}", token=VIEWER, json=body), 403, "permission_denied",
              "updating a deployment")
        error(await f.call("PATCH", f"/deployments/{dep}", token=OTHER_ORG, json=body), 404, "not_found")
        error(await f.call("PATCH", "/deployments/nope", json=body), 404, "not_found")


async def test_no_update_before_the_deployment_is_ready(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path, report_ready=False) as f:
        dep = await f.ready_deployment(wait=False)
        body = {"hotLoad": hot_load_section(dep), "traffic": {"weight": 10}}
        error(await f.call("PATCH", f"/deployments/{dep}", json=body), 412, "failed_precondition",
              "STATUS_CREATING, not STATUS_READY")
