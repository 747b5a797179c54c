"""Delta hot-loads on the shared 3-replica deployment (real Dynamo vLLM workers on CPU, real S3, real
Temporal).

The first replica reads the chain from the bucket; the second stages the delta's files from it and
the third from the second (the deployment's `peerFanOut` is 1: a replica that staged passes its
stage on; gloo between the engine processes); both read zero bytes from the bucket. After
every hot-load, each replica's served weights (read back from its engine) equal a locally
materialized checkpoint, each replica's entry says it proved exactly the tensors the step changed
(``verifiedTensors``) inside a pause (``pauseMs`` > 0), and no engine restarted.

Requests in flight across a hot-load, through the gateway and Dynamo's frontend: while they are
sent, the other replicas are out of Dynamo's routing pool (as a pause takes a replica out), so
they run on the first replica; its swap is held inside its pause (fault point ``swap``,
replica/faults.py) until the engine says which requests it froze there; each of those answers
names both identities in its weight-version spans, and every request completes.
A corrupted delta fails cleanly and changes nothing; a good one then completes. A replica killed
mid-walk is restarted, catches up, and ends on the new weights.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest

from common.processes import PidFile
from snapshots.host import checkpoint_checksums
from snapshots.inspect import read_delta_plan
from snapshots.writer import write_delta
from tests.helpers.chains import publish_chain
from tests.helpers.replicas import (
    ROLLING_PREFIX,
    assert_every_replica_serves,
    engines,
    hot_load,
    requests_frozen_in_first_pause,
    served_checksums,
    start_hot_load,
    walk_order,
)
from tests.helpers.trainer import train_step
from workers.stack import upload_dir

pytestmark = pytest.mark.stack
# Tokens per in-flight request (the deployment's max-model-len is 2048).
LONG = 1900


def test_chain_of_our_deltas_reaches_every_replica(stack, rolling, tmp_path):
    api, dep = rolling
    publish_chain(stack, api, dep["spec"]["id"], tmp_path, "ours", "ours", prefix=ROLLING_PREFIX, relay=True)


def test_chain_of_cwtrain_deltas_reaches_every_replica(stack, rolling, tmp_path):
    api, dep = rolling
    publish_chain(stack, api, dep["spec"]["id"], tmp_path, "cwtrain", "cw", prefix=ROLLING_PREFIX, relay=True)


def _headers(settings) -> dict[str, str]:
    return {"Authorization": f"Bearer {settings.admin_token}"}


def long_request(settings, model: str, i: int, started: threading.Event, out: dict) -> None:
    """One long greedy completion through the gateway (streamed for even ``i``); ``out`` gets its
    outcome, token count (``usage``) and ``nvext.weight_versions``."""
    stream = i % 2 == 0
    if not stream:
        started.set()
    body = {
        "model": model,
        "prompt": [5, 6 + i, 7],
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    try:
        with httpx.stream(
            "POST", f"{settings.gateway_url}/v1/completions", json=body, headers=_headers(settings), timeout=900
        ) as r:
            if r.status_code != 200:
                out["outcome"] = f"HTTP {r.status_code}: {r.read()!r}"
                return
            if not stream:
                data = json.loads(r.read())
                out.update(
                    tokens=data["usage"]["completion_tokens"],
                    finish=data["choices"][0]["finish_reason"],
                    weight_versions=data["nvext"]["weight_versions"],
                )
            else:
                tokens, finish, nvext, done = 0, None, None, False
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        nvext = chunk.get("nvext") or nvext
                        tokens = (chunk.get("usage") or {}).get("completion_tokens") or tokens
                        for c in chunk["choices"]:
                            finish = c.get("finish_reason") or finish
                            if c.get("text"):
                                started.set()
                out.update(
                    tokens=tokens,
                    finish=finish if done else "no [DONE]",
                    weight_versions=(nvext or {}).get("weight_versions"),
                )
            out["outcome"] = "ok" if (out["tokens"], out["finish"]) == (LONG, "length") else "truncated"
    except Exception as exc:  # noqa: BLE001 - recorded, asserted below
        out["outcome"] = repr(exc)
    finally:
        started.set()


def test_in_flight_requests_span_a_pause_and_all_finish(stack, rolling, tmp_path):
    api, dep = rolling
    settings, dep_id, model = stack, dep["spec"]["id"], dep["spec"]["model"]["name"]
    s3 = settings.s3_client()
    base = settings.home_path / "models" / "base"
    full_id, delta_id = "inflight-000000", "inflight-000001"
    upload_dir(s3, base, settings.bucket, f"{ROLLING_PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    new_dir = train_step(base, tmp_path / "new", seed=77)
    write_delta(base, new_dir, tmp_path / delta_id, version=delta_id, base_version=full_id)
    upload_dir(s3, tmp_path / delta_id, settings.bucket, f"{ROLLING_PREFIX}/{delta_id}")
    first = walk_order(settings, dep_id)[0]

    # Nine requests, generating on the old weights on the first replica when its stage is ready
    # (held there, at fault point ``pause``, until they all generate, so its pause begins moments
    # after they start); its swap is then held inside its pause (fault point ``swap``).
    outs: list[dict] = [{} for _ in range(9)]
    started = [threading.Event() for _ in outs]
    threads = [
        threading.Thread(target=long_request, args=(settings, model, i, e, o))
        for i, (e, o) in enumerate(zip(started, outs))
    ]
    # Dynamo's router decides where requests go; for some to be surely on the first worker when
    # it pauses, the others are out of the pool while they are sent.
    held = requests_frozen_in_first_pause(
        settings, api, dep_id, lambda: start_hot_load(api, dep_id, delta_id, full_id), threads, started
    )
    hl, was_paused, frozen = held.hot_load, held.was_paused, held.frozen
    assert was_paused, "the held swap was not inside a pause"
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    assert [o.get("outcome") for o in outs] == ["ok"] * len(outs), outs
    spanned = 0
    for o in outs:
        spans = o["weight_versions"]["spans"]
        assert [s["start"] for s in spans] == [0] + [s["end"] for s in spans[:-1]], spans
        assert spans[-1]["end"] == LONG, spans
        identities = [s["identity"] for s in spans]
        assert identities in ([full_id], [delta_id], [full_id, delta_id]), spans
        spanned += identities == [full_id, delta_id]
    # The premise, from the answers: a request whose tokens come from both identities was in
    # flight across the swap, inside the pause (the engine's running gauge, ``frozen``, may lag).
    assert spanned >= 1, (
        f"no answer names both identities: nothing was in flight on {first['name']} across "
        f"its swap (its running gauge read {frozen} in the pause)"
    )
    assert spanned >= frozen, f"{frozen} request(s) were frozen in a pause, {spanned} answer(s) name both identities"
    assert_every_replica_serves(settings, dep_id, new_dir)


def test_corrupted_delta_fails_cleanly_then_a_good_one_completes(stack, rolling, tmp_path):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    full_id = "corrupt-000000"
    upload_dir(s3, base, stack.bucket, f"{ROLLING_PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    before = {r["name"]: served_checksums(r) for r in engines(stack, dep_id)}

    new_dir = train_step(base, tmp_path / "new", seed=5)
    bad = tmp_path / "corrupt-000001"
    write_delta(base, new_dir, bad, version="1", base_version="0")
    plan = read_delta_plan(bad)
    victim = sorted(plan.tensors.values(), key=lambda t: t.name)[0]
    shard = bad / victim.file
    data = bytearray(shard.read_bytes())
    data[(victim.begin + victim.end) // 2] ^= 0x01  # one flipped bit inside the frame
    shard.write_bytes(bytes(data))
    upload_dir(s3, bad, stack.bucket, f"{ROLLING_PREFIX}/corrupt-000001")

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
    upload_dir(s3, good, stack.bucket, f"{ROLLING_PREFIX}/corrupt-000002")
    hl = hot_load(api, dep_id, "corrupt-000002", full_id)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    assert_every_replica_serves(stack, dep_id, new_dir)


def test_replica_killed_mid_update_restarts_and_catches_up(stack, rolling, tmp_path):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    full_id = "kill-000000"
    upload_dir(s3, base, stack.bucket, f"{ROLLING_PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    new_dir = train_step(base, tmp_path / "new", seed=11)
    write_delta(base, new_dir, tmp_path / "kill-000001", version="1", base_version="0")
    upload_dir(s3, tmp_path / "kill-000001", stack.bucket, f"{ROLLING_PREFIX}/kill-000001")

    victim = engines(stack, dep_id)[-1]  # updated last: killed while the walk is under way
    body = {
        "deploymentId": dep_id,
        "identity": "kill-000001",
        "type": "SNAPSHOT_TYPE_INCREMENTAL",
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
