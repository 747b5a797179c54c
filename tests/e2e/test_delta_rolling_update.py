"""Delta hot-loads on a 3-replica deployment (real vLLM CPU replicas, real S3, real Temporal).

The first replica reads the chain from the bucket; the second and third receive the changed
tensors from an updated peer (gloo between the engine processes) and read zero bytes from the
bucket. After every hot-load, each replica's served weights (read back from its engine) equal a
locally materialized checkpoint, and no engine restarted. Requests in flight across a hot-load
all complete. A corrupted delta fails cleanly and changes nothing; a good one then completes.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from contracts.names import deployment_workflow_id
from replica.engine import EngineProcess
from snapshots.host import checkpoint_checksums
from snapshots.writer import write_delta
from tests.e2e.conftest import PREFIX
from tests.helpers.stack_fixtures import Api, cwtrain_python
from tests.helpers.trainer import train_step
from workers.stack import upload_dir

pytestmark = pytest.mark.stack


def engines(stack, dep_id: str) -> list[dict]:
    """The deployment's replicas as its workflow lists them, each with its engine's secret
    (``engineSecret``, derived from the stack's settings as the gateway does)."""
    from tests.e2e.test_full_hot_load import replicas_of

    workflow_id = deployment_workflow_id(stack.organization_id, dep_id)
    replicas = [{**r, "engineSecret": stack.engine_secret(workflow_id, r["name"])} for r in replicas_of(stack, dep_id)]
    return sorted(replicas, key=lambda r: r["name"])


def served_checksums(replica: dict, names: list[str] | None = None) -> dict[str, str]:
    async def read():
        engine = EngineProcess.attach(replica["engineUrl"], pid=replica["enginePid"], secret=replica["engineSecret"])
        try:
            return await engine.checksums(names)
        finally:
            await engine.aclose()

    return asyncio.run(read())


def hot_load(api: Api, dep_id: str, identity: str, previous: str | None, **extra) -> dict:
    body = {"deploymentId": dep_id, "identity": identity, **extra}
    if previous is None:
        body["type"] = "SNAPSHOT_TYPE_FULL"
    else:
        body["type"] = "SNAPSHOT_TYPE_INCREMENTAL"
        body["incrementalSnapshotMetadata"] = {
            "previousSnapshotIdentity": previous,
            "compressionFormat": "COMPRESSION_FORMAT_ZSTD",
            "checksumFormat": "CHECKSUM_FORMAT_ADLER32",
        }
    r = api.call("POST", "/hotLoads", json=body)
    assert r.status_code == 200, r.text
    return api.wait_hot_load(r.json()["hotLoad"]["spec"]["id"])


def cwtrain_write_delta(base: Path, new: Path, out: Path, version: str, base_version: str) -> None:
    code = (
        "import sys; from cwtrain.hotload.delta import write_delta; "
        "write_delta(sys.argv[1], sys.argv[2], sys.argv[3], version=sys.argv[4], base_version=sys.argv[5])"
    )
    subprocess.run([str(cwtrain_python()), "-c", code, str(base), str(new), str(out), version, base_version], check=True)


def publish_chain(stack, api, dep_id, tmp: Path, writer: str, tag: str, steps: int = 3) -> None:
    """Full base, then `steps` deltas; after each, every replica serves exactly the trainer's weights."""
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    full_id = f"{tag}-000000"
    upload_dir(s3, base, stack.bucket, f"{PREFIX}/{full_id}")
    pids = {r["name"]: r["enginePid"] for r in engines(stack, dep_id)}
    hl = hot_load(api, dep_id, full_id, None)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    prev_dir, prev_id = base, full_id
    for step in range(1, steps + 1):
        new_dir = train_step(prev_dir, tmp / f"{tag}-full-{step}", seed=step + (100 if writer == "cwtrain" else 0))
        identity = f"{tag}-{step:06d}"
        delta_dir = tmp / identity
        if writer == "cwtrain":
            cwtrain_write_delta(prev_dir, new_dir, delta_dir, identity, prev_id)
        else:
            stats = write_delta(prev_dir, new_dir, delta_dir, version=identity, base_version=prev_id)
            assert stats.changed > 0
        upload_dir(s3, delta_dir, stack.bucket, f"{PREFIX}/{identity}")
        hl = hot_load(api, dep_id, identity, prev_id)
        assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
        assert [l["identity"] for l in hl["spec"]["snapshotChain"]] == [full_id] + [
            f"{tag}-{i:06d}" for i in range(1, step + 1)
        ]
        reps = api.call("GET", f"/hotLoads/{hl['spec']['id']}/replicas").json()["replicas"]
        assert [r["state"] for r in reps] == ["READY"] * 3
        assert reps[0]["source"] == "bucket" and reps[0]["bytesReadFromBucket"] > 0
        for r in reps[1:]:
            assert r["source"].startswith("peer:"), r
            assert r["bytesReadFromBucket"] == 0, r
        expected = checkpoint_checksums(new_dir)
        for replica in engines(stack, dep_id):
            assert served_checksums(replica) == expected, f"{replica['name']} serves other weights"
        prev_dir, prev_id = new_dir, identity
    assert {r["name"]: r["enginePid"] for r in engines(stack, dep_id)} == pids


def test_chain_of_our_deltas_reaches_every_replica(stack, rolling, tmp_path):
    api, dep = rolling
    publish_chain(stack, api, dep["spec"]["id"], tmp_path, "ours", "ours")


def test_chain_of_cwtrain_deltas_reaches_every_replica(stack, rolling, tmp_path):
    api, dep = rolling
    publish_chain(stack, api, dep["spec"]["id"], tmp_path, "cwtrain", "cw")


def test_in_flight_requests_survive_a_delta_hot_load(stack, rolling, tmp_path):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    model = dep["spec"]["model"]["name"]
    s3 = stack.s3_client()
    full_id = "inflight-000000"
    upload_dir(s3, stack.home_path / "models" / "base", stack.bucket, f"{PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    new_dir = train_step(stack.home_path / "models" / "base", tmp_path / "new", seed=77)
    write_delta(stack.home_path / "models" / "base", new_dir, tmp_path / "inflight-000001", version="1", base_version="0")
    upload_dir(s3, tmp_path / "inflight-000001", stack.bucket, f"{PREFIX}/inflight-000001")

    results: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        stream = i % 2 == 0
        body = {"model": model, "prompt": [5, 6 + i, 7], "max_tokens": 48, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        headers = {"Authorization": f"Bearer {stack.admin_token}"}
        try:
            with httpx.stream("POST", f"{stack.gateway_url}/v1/completions", json=body, headers=headers, timeout=300) as r:
                if r.status_code != 200:
                    outcome = f"HTTP {r.status_code}"
                elif stream:
                    events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                    done = events and events[-1] == "data: [DONE]"
                    errors = [e for e in events if '"error"' in e]
                    finished = [e for e in events if '"finish_reason":"length"' in e.replace(" ", "")]
                    outcome = "ok" if done and not errors and finished else f"truncated stream ({len(events)} events)"
                else:
                    r.read()
                    usage = r.json()["usage"]["completion_tokens"]
                    outcome = "ok" if usage == 48 else f"truncated ({usage} tokens)"
        except Exception as exc:  # noqa: BLE001 - recorded, asserted below
            outcome = repr(exc)
        with lock:
            results.append(outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.5)  # the requests are running when the hot-load starts
    hl = hot_load(api, dep_id, "inflight-000001", full_id)
    for t in threads:
        t.join(timeout=300)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    assert results == ["ok"] * 16, results


def test_corrupted_delta_fails_cleanly_then_a_good_one_completes(stack, rolling, tmp_path):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    full_id = "corrupt-000000"
    upload_dir(s3, base, stack.bucket, f"{PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    before = {r["name"]: served_checksums(r) for r in engines(stack, dep_id)}

    new_dir = train_step(base, tmp_path / "new", seed=5)
    bad = tmp_path / "corrupt-000001"
    write_delta(base, new_dir, bad, version="1", base_version="0")
    from snapshots.inspect import read_delta_plan

    plan = read_delta_plan(bad)
    victim = sorted(plan.tensors.values(), key=lambda t: t.name)[0]
    shard = bad / victim.file
    data = bytearray(shard.read_bytes())
    data[(victim.begin + victim.end) // 2] ^= 0x01  # one flipped bit inside the frame
    shard.write_bytes(bytes(data))
    upload_dir(s3, bad, stack.bucket, f"{PREFIX}/corrupt-000001")

    hl = hot_load(api, dep_id, "corrupt-000001", full_id)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_FAILED", hl["status"]
    reps = api.call("GET", f"/hotLoads/{hl['spec']['id']}/replicas").json()["replicas"]
    assert reps[0]["state"] == "ERROR" and victim.name in reps[0]["errorReason"], reps[0]
    assert all(r["state"] == "PENDING_UPDATE" for r in reps[1:])
    assert all(r["currentSnapshotIdentity"] == full_id for r in reps)
    after = {r["name"]: served_checksums(r) for r in engines(stack, dep_id)}
    assert after == before, "a failed hot-load changed served weights"

    good = tmp_path / "corrupt-000002"
    write_delta(base, new_dir, good, version="2", base_version="0")
    upload_dir(s3, good, stack.bucket, f"{PREFIX}/corrupt-000002")
    hl = hot_load(api, dep_id, "corrupt-000002", full_id)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    expected = checkpoint_checksums(new_dir)
    for replica in engines(stack, dep_id):
        assert served_checksums(replica) == expected


def test_replica_killed_mid_update_restarts_and_catches_up(stack, rolling, tmp_path):
    import os
    import signal

    from common.processes import PidFile

    api, dep = rolling
    dep_id = dep["spec"]["id"]
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    full_id = "kill-000000"
    upload_dir(s3, base, stack.bucket, f"{PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    new_dir = train_step(base, tmp_path / "new", seed=11)
    write_delta(base, new_dir, tmp_path / "kill-000001", version="1", base_version="0")
    upload_dir(s3, tmp_path / "kill-000001", stack.bucket, f"{PREFIX}/kill-000001")

    victim = engines(stack, dep_id)[-1]  # updated last: killed while the walk is under way
    body = {
        "deploymentId": dep_id, "identity": "kill-000001", "type": "SNAPSHOT_TYPE_INCREMENTAL",
        "incrementalSnapshotMetadata": {"previousSnapshotIdentity": full_id},
    }
    hl_id = api.call("POST", "/hotLoads", json=body).json()["hotLoad"]["spec"]["id"]
    agent = PidFile(stack.home_path / "replicas" / dep_id / victim["name"] / "replica.pid").alive_pid()
    assert agent is not None
    os.killpg(victim["enginePid"], signal.SIGKILL)
    os.killpg(agent, signal.SIGKILL)

    hl = api.wait_hot_load(hl_id, timeout=900)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    reps = {r["name"]: r for r in api.call("GET", f"/hotLoads/{hl_id}/replicas").json()["replicas"]}
    assert all(r["state"] == "READY" and r["currentSnapshotIdentity"] == "kill-000001" for r in reps.values()), reps
    now = {r["name"]: r for r in engines(stack, dep_id)}
    assert now[victim["name"]]["enginePid"] != victim["enginePid"], "the killed replica was not restarted"
    log = (stack.home_path / "replicas" / dep_id / victim["name"] / "replica.log").read_text()
    assert f"caught up to {full_id}" in log, "the restarted replica took traffic before loading the served chain"
    expected = checkpoint_checksums(new_dir)
    for replica in now.values():
        assert served_checksums(replica) == expected
