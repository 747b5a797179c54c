"""`PATCH /deployments/{id}` on the real Temporal dev server: the hotLoad section must come back
unchanged, only runtime.version, runtime.engineConfig and traffic may change, nothing changes
while a hot-load runs, and a new runtime rolls the replicas onto it one at a time (test replicas,
tests/helpers/harness.py; tests/e2e/test_deployment_lifecycle.py checks the engines' flags on real replicas)."""

from __future__ import annotations

import asyncio

import httpx

from contracts.records import ReplicaFailure
from control.deployment import DeploymentWorkflow
from tests.helpers.harness import ADMIN, OTHER_ORG, VIEWER, Fleet, poll, write_full
from tests.helpers.workflow_checks import error, every


def hot_load_section(dep: str) -> dict:
    return {"bucket": "rollouts", "pathPrefix": f"ckpt/{dep}", "transitionMode": "TRANSITION_MODE_ASYNC"}


async def update(f: Fleet, dep: str, body: dict, token: str = ADMIN) -> httpx.Response:
    """``PATCH /deployments/{dep}`` with ``body``."""
    return await f.call("PATCH", f"/deployments/{dep}", token=token, json=body)


async def hot_load_refused(f: Fleet, dep: str, status: str, reason: str) -> None:
    """A hot-load of a published snapshot is refused while the deployment is ``status`` (its
    condition's reason ``reason``)."""
    write_full(f.bucket_root / f"ckpt/{dep}", "s1")
    error(await f.create_hot_load(dep, "s1"), 412, "failed_precondition", f"{status}, not STATUS_READY", reason)


async def test_update_changes_engine_config_and_traffic(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        before = [r.name for r in (await f.deployment_state(dep)).replicas]  # walk order
        body = {
            "hotLoad": hot_load_section(dep),
            "runtime": {
                "engine": "dynamo-vllm",
                "version": "0.32.1",
                "engineConfig": {"enable-return-routed-experts": ""},
            },
            "traffic": {"weight": 40},
        }
        r = await update(f, dep, body)
        assert r.status_code == 200, r.text
        spec = r.json()["deployment"]["spec"]
        assert spec["runtime"]["engineConfig"] == {"enable-return-routed-experts": ""}
        assert spec["runtime"]["version"] == "0.32.1" and spec["traffic"] == {"weight": 40}
        status = r.json()["deployment"]["status"]
        assert status["status"] == "STATUS_UPDATING" and status["conditions"][0]["reason"] == "RollingUpdate"
        # Stored: a later read (from the memo, no query) sees it, READY once both replicas were
        # replaced by replicas on the new runtime.
        got = await f.wait_deployment(dep)
        assert got["spec"]["traffic"] == {"weight": 40}
        assert got["spec"]["runtime"]["engineConfig"] == {"enable-return-routed-experts": ""}
        assert got["status"]["readyReplicas"] == 2
        # The section as sent, with the large-deployment settings (beyond the guide) at their defaults.
        assert got["spec"]["hotLoad"] == {
            **hot_load_section(dep),
            "maxConcurrentSwaps": 1,
            "peerFanOut": 4,
            "replicasPerGroup": 100,
        }
        after = (await f.deployment_state(dep)).members
        assert len(after) == 2 and not set(after) & set(before) and f.stopped == before
        # Traffic alone needs no new replicas: none is replaced, the deployment stays READY.
        r = await update(f, dep, {**body, "traffic": {"weight": 70}})
        assert r.status_code == 200 and r.json()["deployment"]["status"]["status"] == "STATUS_READY", r.text
        assert (await f.deployment_state(dep)).members == after and f.stopped == before


async def _new_pending(f: Fleet, dep: str, known: set[str]) -> str:
    """The replica the rolling update started next (it has not reported ready)."""

    async def check() -> str | None:
        fresh = [n for n in (await f.deployment_state(dep)).pending_replicas if n not in known]
        return fresh[0] if fresh else None

    return await poll(check, 30, "a new replica started")


async def test_update_rolls_one_replica_at_a_time_and_refuses_hot_loads_meanwhile(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        old = [r.name for r in (await f.deployment_state(dep)).replicas]  # walk order
        f.report_ready = False  # each new replica reports ready when the test says
        body = {
            "hotLoad": hot_load_section(dep),
            "runtime": {"engine": "dynamo-vllm", "version": "0.32.0", "engineConfig": {"max-num-seqs": "6"}},
        }
        r = await update(f, dep, body)
        assert r.status_code == 200 and r.json()["deployment"]["status"]["status"] == "STATUS_UPDATING", r.text
        first = await _new_pending(f, dep, set(old))
        state = await f.deployment_state(dep)
        assert [r.name for r in state.replicas] == old and state.outdated == old  # both still serve
        got = (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]["status"]
        assert got["status"] == "STATUS_UPDATING" and got["readyReplicas"] == 2, got
        assert (
            got["conditions"][0]["reason"] == "RollingUpdate"
            and "2 replica(s) still on the previous" in got["conditions"][0]["message"]
        )
        await hot_load_refused(f, dep, "STATUS_UPDATING", "RollingUpdate")
        error(await update(f, dep, body), 412, "failed_precondition", "STATUS_UPDATING")

        await f.signal_ready(dep, first)
        second = await _new_pending(f, dep, {*old, first})
        state = await f.deployment_state(dep)
        # The first old replica left only after its replacement served; the other still serves.
        assert f.stopped == [old[0]] and sorted(r.name for r in state.replicas) == sorted([first, old[1]])
        assert state.outdated == [old[1]]
        await f.signal_ready(dep, second)
        got = await f.wait_deployment(dep)
        assert got["status"]["readyReplicas"] == 2 and got["status"]["conditions"][0]["reason"] == "AllReplicasReady"
        state = await f.deployment_state(dep)
        assert state.members == [first, second] and state.outdated == [] and f.stopped == old
        hl = await f.completed(dep, "s1")
        assert sorted(r["name"] for r in await f.hot_load_replicas(hl["spec"]["id"])) == sorted([first, second])


async def test_a_failed_update_leaves_the_old_replicas_serving_until_updated_again(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        old = [r.name for r in (await f.deployment_state(dep)).replicas]
        f.report_ready = False
        bad = {
            "hotLoad": hot_load_section(dep),
            "runtime": {"engine": "dynamo-vllm", "version": "0.32.0", "engineConfig": {"max-num-seqs": "7"}},
        }
        assert (await update(f, dep, bad)).status_code == 200
        new = await _new_pending(f, dep, set(old))
        await f.deployment_handle(dep).signal(
            DeploymentWorkflow.replica_failed,
            ReplicaFailure(name=new, reason="start failed: engine exited (out of memory)"),
        )
        got = await f.wait_deployment(dep, status="STATUS_ERROR")
        cond = got["status"]["conditions"][0]
        assert cond["reason"] == "UpdateFailed" and new in cond["message"] and "out of memory" in cond["message"], cond
        assert "2 replica(s) still serve the previous runtime" in cond["message"]
        assert got["status"]["readyReplicas"] == 2 and f.stopped == [new]
        assert [r.name for r in (await f.deployment_state(dep)).replicas] == old
        await hot_load_refused(f, dep, "STATUS_ERROR", "UpdateFailed")
        # Updating again (here: back to the previous runtime) rolls again.
        back = {**bad, "runtime": {"engine": "dynamo-vllm", "version": "0.32.0", "engineConfig": {}}}
        r = await update(f, dep, back)
        assert r.status_code == 200 and r.json()["deployment"]["status"]["status"] == "STATUS_UPDATING", r.text
        first = await _new_pending(f, dep, {*old, new})
        await f.signal_ready(dep, first)
        second = await _new_pending(f, dep, {*old, new, first})
        await f.signal_ready(dep, second)
        assert (await f.wait_deployment(dep))["status"]["readyReplicas"] == 2
        await f.completed(dep, "s1")


async def test_update_that_omits_or_changes_hot_load_is_refused(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        error(await update(f, dep, {"traffic": {"weight": 10}}), 400, "invalid_argument", "hotLoad", "must include")
        changed = {**hot_load_section(dep), "pathPrefix": "elsewhere"}
        error(await update(f, dep, {"hotLoad": changed}), 400, "invalid_argument", "hotLoad", "immutable")
        error(
            await update(f, dep, {"hotLoad": hot_load_section(dep), "autoscaling": {"min": 3, "max": 3}}),
            400,
            "invalid_argument",
            "autoscaling",
            "cannot be changed",
        )
        error(
            await update(
                f, dep, {"hotLoad": hot_load_section(dep), "model": {"name": "x", "bucket": "rollouts", "path": "p"}}
            ),
            400,
            "invalid_argument",
            "model",
        )
        assert (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]["spec"]["traffic"] == {"weight": 100}
        plain = await f.ready_deployment(hot_load=False)
        error(await update(f, plain, {"hotLoad": hot_load_section(plain)}), 400, "invalid_argument", "cannot be added")
        r = await update(f, plain, {"traffic": {"weight": 5}})
        assert r.status_code == 200 and r.json()["deployment"]["spec"]["traffic"] == {"weight": 5}


async def test_no_update_while_a_hot_load_runs(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        f.apply_behaviour = every(f.held)
        await f.accepted(dep, "s1", hotLoadId="busy")
        await asyncio.wait_for(f.started.wait(), 30)
        body = {"hotLoad": hot_load_section(dep), "traffic": {"weight": 10}}
        error(await update(f, dep, body), 412, "failed_precondition", "busy is already in progress")
        f.hold.set()
        await f.wait_hot_load("busy")
        await f.wait_idle(dep)
        assert (await update(f, dep, body)).status_code == 200


async def test_update_roles_and_organizations(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        body = {"hotLoad": hot_load_section(dep), "traffic": {"weight": 10}}
        error(await update(f, dep, body, token=VIEWER), 403, "permission_denied", "updating a deployment")
        error(await update(f, dep, body, token=OTHER_ORG), 404, "not_found")
        error(await update(f, "nope", body), 404, "not_found")


async def test_no_update_before_the_deployment_is_ready(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path, report_ready=False) as f:
        dep = await f.ready_deployment(wait=False)
        body = {"hotLoad": hot_load_section(dep), "traffic": {"weight": 10}}
        error(await update(f, dep, body), 412, "failed_precondition", "STATUS_CREATING, not STATUS_READY")
