"""The deployment's status follows its replica set, on the real Temporal dev server with test
replicas (tests/helpers/harness.py): a deployment whose replica processes are gone is not READY and admits no
hot-load until they serve again; one whose node agent missed a check is asked again by the
admission. `tests/e2e/test_deployment_lifecycle.py` shows the same with
real vLLM replicas stopped as `rollouts down` stops them."""

from __future__ import annotations

from contracts.records import ReplicaFailure
from control.deployment import DeploymentWorkflow
from tests.helpers.harness import Fleet, poll, write_full
from tests.helpers.workflow_checks import error
from workers.control_worker import verify_deployments


async def _status(f: Fleet, dep: str) -> dict:
    return (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]["status"]


async def test_a_replica_found_gone_at_admission_refuses_the_hot_load(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        members = await f.members_losing(dep, 1)  # restarted replicas take their time
        assert len(members) == 2
        # The deployment still believes it is READY: nothing told it yet.
        assert (await _status(f, dep))["status"] == "STATUS_READY"
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        error(
            await f.create_hot_load(dep, "s1", hotLoadId="too-soon"),
            412,
            "failed_precondition",
            "STATUS_UPDATING, not STATUS_READY",
            "ReplicasRestarting",
            members[1],
        )
        st = await _status(f, dep)
        assert st["status"] == "STATUS_UPDATING" and st["readyReplicas"] == 1, st
        assert [(c["reason"], c["status"]) for c in st["conditions"]] == [("ReplicasRestarting", "STATUS_FALSE")]
        assert "1 of 2 serving" in st["conditions"][0]["message"]
        assert not st.get("activeHotLoadId")
        # Still restarting: refused again, by the status itself.
        error(
            await f.create_hot_load(dep, "s1", hotLoadId="still-too-soon"),
            412,
            "failed_precondition",
            "STATUS_UPDATING",
        )
        assert f.applied == []
        await f.signal_ready(dep, members[1])
        st = (await f.wait_deployment(dep))["status"]
        assert st["readyReplicas"] == 2 and st["conditions"][0]["reason"] == "AllReplicasReady", st
        r = await f.create_hot_load(dep, "s1", hotLoadId="now")
        assert r.status_code == 200, r.text
        assert (await f.wait_hot_load("now"))["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"


async def test_the_control_worker_on_start_finds_every_replica_gone(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        members = (await f.deployment_state(dep)).members
        f.report_ready = False
        await f.lose(dep, *members)  # `rollouts down`: no replica runs
        query = f"ResourceKind='deployment' AND ExecutionStatus='Running' AND TaskQueue='{f.task_queue}'"
        ids = await poll(lambda: _listed(f, query), 30, "the deployment listed")
        assert len(ids) == 1
        assert await verify_deployments(f.client, query) == {ids[0]: "STATUS_UPDATING"}
        st = await _status(f, dep)
        assert st["status"] == "STATUS_UPDATING" and st["readyReplicas"] == 0, st
        assert st["conditions"][0]["reason"] == "ReplicasRestarting"
        assert "0 of 2 serving" in st["conditions"][0]["message"]
        state = await f.deployment_state(dep)
        assert sorted(state.pending_replicas) == sorted(members) and state.replicas == []
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        error(await f.create_hot_load(dep, "s1"), 412, "failed_precondition", "STATUS_UPDATING, not STATUS_READY")
        # A second check starts nothing twice: both are already starting.
        assert await verify_deployments(f.client, query) == {ids[0]: "STATUS_UPDATING"}
        await f.signal_ready(dep, members[0])
        st = await _until(f, dep, lambda st: st["readyReplicas"] == 1)
        assert st["status"] == "STATUS_UPDATING" and "1 of 2 serving" in st["conditions"][0]["message"], st
        await f.signal_ready(dep, members[1])
        st = (await f.wait_deployment(dep))["status"]
        assert st["readyReplicas"] == 2, st
        await f.completed(dep, "s1")


async def test_a_replica_reporting_its_engine_dead_takes_the_deployment_out_of_ready(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        members = await f.members_losing(dep, 0)
        await f.deployment_handle(dep).signal(
            DeploymentWorkflow.replica_failed, ReplicaFailure(name=members[0], reason="engine process 7 exited")
        )
        st = await _until(f, dep, lambda st: st["readyReplicas"] == 1)
        assert st["status"] == "STATUS_UPDATING", st
        assert st["conditions"][0]["reason"] == "ReplicasRestarting" and members[0] in st["conditions"][0]["message"]
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        error(await f.create_hot_load(dep, "s1"), 412, "failed_precondition", "STATUS_UPDATING")
        # The periodic check restarts it (it is still a member), then it reports ready.
        await poll(lambda: _pending(f, dep, members[0]), 30, f"{members[0]} restarted")
        await f.signal_ready(dep, members[0])
        assert (await f.wait_deployment(dep))["status"]["readyReplicas"] == 2


async def test_a_node_agent_that_missed_a_check_is_asked_again_by_the_admission(temporal_env, tmp_path):
    """One missed periodic check (a slow node agent, a short partition) makes the deployment
    UPDATING, reason NodeUnreachable; a hot-load's admission asks every node agent again: still
    silent, `unavailable` (try again) naming the node; answering now, admitted at once, without
    waiting for the next periodic check."""
    async with Fleet(temporal_env.client, tmp_path) as f:
        dep = await f.ready_deployment()
        write_full(f.bucket_root / f"ckpt/{dep}", "s1")
        f.node_silent = "activity StartToClose timeout (test: the node agent is silent)"
        st = await _until(f, dep, lambda st: st["status"] == "STATUS_UPDATING")  # the next periodic check
        assert [c["reason"] for c in st["conditions"]] == ["NodeUnreachable"], st
        assert f.node in st["conditions"][0]["message"] and "silent" in st["conditions"][0]["message"], st
        checks = len(f.start_inputs)
        error(
            await f.create_hot_load(dep, "s1", hotLoadId="silent"),
            503,
            "unavailable",
            "did not answer",
            f.node,
            "try again",
        )
        assert len(f.start_inputs) == checks + 1, "the admission asked the node agent itself"
        f.node_silent = None
        assert (await _status(f, dep))["status"] == "STATUS_UPDATING"  # the premise: not READY before the create
        r = await f.create_hot_load(dep, "s1", hotLoadId="answered")
        assert r.status_code == 200, r.text
        assert (await f.wait_hot_load("answered"))["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        st = await _status(f, dep)
        assert st["status"] == "STATUS_READY" and st["conditions"][0]["reason"] == "AllReplicasReady", st


async def _until(f: Fleet, dep: str, done) -> dict:
    """The deployment's status once `done(status)` holds (a signal is processed asynchronously)."""

    async def check() -> dict | None:
        st = await _status(f, dep)
        return st if done(st) else None

    return await poll(check, 30, f"deployment {dep} status")


async def _listed(f: Fleet, query: str) -> list[str] | None:
    ids = [wf.id async for wf in f.client.list_workflows(query)]
    return ids or None


async def _pending(f: Fleet, dep: str, name: str) -> bool | None:
    return True if name in (await f.deployment_state(dep)).pending_replicas else None
