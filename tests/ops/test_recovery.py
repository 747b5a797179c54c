"""`rollouts replay` and `rollouts rollback` (workers/ops.py) against the real API and workflows
on the Temporal dev server (replicas are test activities): they start the right hot-load, print
progress, and fail with the reason."""

from __future__ import annotations

import io

import httpx
import pytest

from api.app import PREFIX
from tests.helpers.harness import ADMIN, Fleet, write_delta, write_full
from tests.helpers.workflow_checks import delta_body, every
from workers.cli import main as cli_main
from workers.ops import OpsError, replay, rollback


def api_client(f: Fleet) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=f.app),
        base_url=f"http://api{PREFIX}",
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=60,
    )


async def test_replay_recovers_a_failed_delta_with_the_same_type_and_metadata(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f, api_client(f) as http:
        dep = await f.ready_deployment()
        await f.completed(dep, "s0")
        write_delta(f.bucket_root / f"ckpt/{dep}", "s1", "s0")
        f.apply_behaviour = every(f.broken)
        r = await f.create_hot_load(
            dep, "s1", hotLoadId="broken-1", promptCachePolicy="PROMPT_CACHE_POLICY_RESET_ALL", **delta_body("s0")
        )
        assert (await f.wait_hot_load("broken-1"))["status"]["state"] == "HOT_LOAD_STATE_FAILED"
        await f.wait_idle(dep)

        # Still broken: replay fails, naming the replica's reason.
        out = io.StringIO()
        with pytest.raises(OpsError, match="ended HOT_LOAD_STATE_FAILED.*Adler-32 mismatch in s1"):
            await replay(http, "broken-1", out=out, poll_s=0.05)
        await f.wait_idle(dep)

        f.apply_behaviour = {}  # the cause is fixed
        out = io.StringIO()
        assert await replay(http, "broken-1", out=out, poll_s=0.05) == 0
        lines = out.getvalue().splitlines()
        assert lines[0].startswith("replaying broken-1 (s1, SNAPSHOT_TYPE_INCREMENTAL) as ")
        assert "COMPLETED 2/2 ready" in lines[-1]
        new_id = lines[0].split(" as ")[1].split(";")[0]
        new = (await f.call("GET", f"/hotLoads/{new_id}")).json()["hotLoad"]
        assert new["spec"]["incrementalSnapshotMetadata"] == r.json()["hotLoad"]["spec"]["incrementalSnapshotMetadata"]
        assert new["spec"]["promptCachePolicy"] == "PROMPT_CACHE_POLICY_RESET_ALL"
        assert [c["identity"] for c in new["spec"]["snapshotChain"]] == ["s0", "s1"]


async def test_rollback_reserves_an_earlier_completed_snapshot(temporal_env, tmp_path):
    async with Fleet(temporal_env.client, tmp_path) as f, api_client(f) as http:
        dep = await f.ready_deployment()
        await f.completed(dep, "s0")
        s1 = await f.completed(dep, "s1", **delta_body("s0"))
        await f.completed(dep, "s2")
        out = io.StringIO()
        assert await rollback(http, "s1", dep, out=out, poll_s=0.05) == 0
        assert out.getvalue().startswith(f"rolling {dep} back to s1 (as {s1['spec']['id']} loaded it)")
        await f.wait_idle(dep)
        listed = (await f.call("GET", "/hotLoads", params={"parentDeploymentId": dep})).json()["hotLoads"]
        newest = listed[0]
        assert newest["spec"]["identity"] == "s1" and newest["spec"]["type"] == "SNAPSHOT_TYPE_INCREMENTAL"
        assert newest["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        dep_view = (await f.call("GET", f"/deployments/{dep}")).json()["deployment"]
        assert dep_view["status"]["currentSnapshotIdentity"] == "s1"

        with pytest.raises(OpsError, match="no COMPLETED hot-load of 'never'"):
            await rollback(http, "never", dep, out=io.StringIO())
        # Refused by admission: the API's code and message, unchanged.
        write_full(f.bucket_root / f"ckpt/{dep}", "s3")
        f.apply_behaviour = every(f.held)
        assert (await f.create_hot_load(dep, "s3")).status_code == 200
        with pytest.raises(OpsError, match="failed_precondition: .*already in progress"):
            await rollback(http, "s0", dep, out=io.StringIO())
        f.hold.set()


def test_cli_exits_non_zero_with_the_reason(monkeypatch, capsys):
    monkeypatch.setenv("ROLLOUTS_API_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("CW_API_TOKEN", "t")
    assert cli_main(["replay", "hl-1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("rollouts: ") and "unreachable" in err
    assert cli_main(["rollback", "s1", "--deployment", "d"]) == 1
