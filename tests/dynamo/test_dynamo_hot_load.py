"""Hot-loads and rollouts on a dynamo stack: real Dynamo vLLM workers (two replicas) behind Dynamo's
frontend and router, behind the gateway; real Temporal, S3, cwtrain and HTTP.

- cwtrain publishes a FULL snapshot and three deltas; each reaches both workers (the first from
  the bucket, the second from its peer, 0 bytes from the bucket), each proved in a pause, and
  both serve exactly the trainer's weights (read back from the engines); no worker restarted.
- Requests in flight through Dynamo's frontend across a hot-load all finish; those frozen in the
  first worker's pause carry both identities in exact per-token spans.
- ``X-Dynamo-Session-ID`` keeps each trajectory on the worker its first turn went to, with
  Dynamo's router spreading the first turns over both workers.
- A request that arrives while no worker is in Dynamo's routing pool (every one paused) waits
  for one to return instead of failing.
- The trainer-facing contract holds: tokens, the gateway's own 400s, Dynamo's 400s in the
  gateway's error shape.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from contracts.names import deployment_workflow_id, dynamo_model
from snapshots.host import checkpoint_checksums
from snapshots.writer import write_delta
from tests.helpers.chains import publish_chain
from tests.helpers.dynamo_stack import DYNAMO_PREFIX, REPLICAS, control
from tests.helpers.replicas import (
    engines,
    fault,
    faults,
    hot_load,
    paused,
    running_requests,
    served_checksums,
    start_hot_load,
    walk_order,
    write_faults,
)
from tests.helpers.trainer import train_step
from workers.stack import upload_dir

pytestmark = pytest.mark.stack
LONG = 1900  # tokens per in-flight request (max-model-len 2048)


def _headers(settings, session: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {settings.admin_token}", **({"X-Dynamo-Session-ID": session} if session else {})}


def test_replicas_are_dynamo_workers(dynamo_stack, dyn):
    api, dep = dyn
    replicas = engines(dynamo_stack, dep["spec"]["id"])
    assert len(replicas) == REPLICAS
    assert all(r["dynamoWorker"] and r["dynamoNamespace"] for r in replicas), replicas
    # The frontend knows the deployment's model by its Dynamo name; the gateway maps it.
    models = httpx.get(f"{dynamo_stack.dynamo_frontend_url}/v1/models", timeout=10).json()["data"]
    assert any(m["id"].endswith(dep["spec"]["id"]) for m in models), models


def test_cwtrain_full_then_three_deltas_reach_every_dynamo_worker(dynamo_stack, dyn, tmp_path):
    api, dep = dyn
    publish_chain(dynamo_stack, api, dep["spec"]["id"], tmp_path, "cwtrain", "dyncw", prefix=DYNAMO_PREFIX)
    # An answer through Dynamo names the last identity, exactly (the engine's own record).
    body = {"model": dep["spec"]["model"]["name"], "prompt": [1, 2, 3], "max_tokens": 4, "n": 2}
    r = httpx.post(f"{dynamo_stack.gateway_url}/v1/completions", json=body, headers=_headers(dynamo_stack), timeout=60)
    assert r.status_code == 200, r.text
    versions = r.json()["nvext"]["weight_versions"]
    assert versions["identity"] == "dyncw-000003" and versions["exact"], versions
    assert [(s["choice"], s["start"], s["end"]) for s in versions["spans"]] == [(0, 0, 4), (1, 0, 4)]


def dynamo_model_of(settings, dep) -> str:
    return dynamo_model(deployment_workflow_id(settings.organization_id, dep["spec"]["id"]))


def long_request(settings, model: str, i: int, started: threading.Event, out: dict) -> None:
    """One long greedy completion through the gateway (streamed for even ``i``); ``out`` gets its
    outcome, token count (``usage``) and ``nvext.weight_versions``."""
    stream = i % 2 == 0
    if not stream:
        started.set()
    body = {"model": model, "prompt": [5, 6 + i, 7], "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}
    try:
        with httpx.stream("POST", f"{settings.gateway_url}/v1/completions", json=body, headers=_headers(settings),
                          timeout=900) as r:
            if r.status_code != 200:
                out["outcome"] = f"HTTP {r.status_code}: {r.read()!r}"
                return
            if not stream:
                data = json.loads(r.read())
                out.update(tokens=data["usage"]["completion_tokens"], finish=data["choices"][0]["finish_reason"],
                           weight_versions=data["nvext"]["weight_versions"])
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
                out.update(tokens=tokens, finish=finish if done else "no [DONE]",
                           weight_versions=(nvext or {}).get("weight_versions"))
            out["outcome"] = "ok" if (out["tokens"], out["finish"]) == (LONG, "length") else "truncated"
    except Exception as exc:  # noqa: BLE001 - recorded, asserted below
        out["outcome"] = repr(exc)
    finally:
        started.set()


def test_in_flight_requests_through_dynamo_span_a_pause(dynamo_stack, dyn, tmp_path):
    api, dep = dyn
    settings, dep_id, model = dynamo_stack, dep["spec"]["id"], dep["spec"]["model"]["name"]
    s3 = settings.s3_client()
    base = settings.home_path / "models" / "base"
    full_id, delta_id = "dyninflight-000000", "dyninflight-000001"
    upload_dir(s3, base, settings.bucket, f"{DYNAMO_PREFIX}/{full_id}")
    assert hot_load(api, dep_id, full_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    new_dir = train_step(base, tmp_path / "new", seed=78)
    write_delta(base, new_dir, tmp_path / delta_id, version=delta_id, base_version=full_id)
    upload_dir(s3, tmp_path / delta_id, settings.bucket, f"{DYNAMO_PREFIX}/{delta_id}")
    first, *others = walk_order(settings, dep_id)

    # Three requests per worker's worth, generating on the old weights on the first worker when
    # its step starts; its swap is then held inside its pause (fault point ``swap``).
    outs: list[dict] = [{} for _ in range(3 * REPLICAS)]
    started = [threading.Event() for _ in outs]
    threads = [threading.Thread(target=long_request, args=(settings, model, i, e, o))
               for i, (e, o) in enumerate(zip(started, outs))]
    at_start = fault("apply_snapshot", first["name"], "hold")
    hold = fault("swap", first["name"], "hold")
    hl_id, frozen, was_paused = None, -1, False
    try:
        with faults(settings, at_start, hold):
            hl_id = start_hot_load(api, dep_id, delta_id, full_id)
            at_start.wait_fired(settings, dep_id)
            # Dynamo's router decides where requests go; for some to be surely on the first
            # worker when it pauses, the others are out of the pool while they are sent.
            for other in others:
                control(other, "leave")
            try:
                for t in threads:
                    t.start()
                assert all(e.wait(600) for e in started)
            finally:
                for other in others:
                    control(other, "join")
            write_faults(settings, [hold])
            hold.wait_fired(settings, dep_id)
            was_paused, frozen = paused(first), running_requests(first)
    finally:
        hl = api.wait_hot_load(hl_id) if hl_id else None
        for t in threads:
            t.join(900)
    assert was_paused, "the held swap was not inside a pause"
    assert frozen >= 1, f"no request was running on {first['name']} when its pause began"
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
    assert spanned >= frozen, f"{frozen} request(s) were frozen in a pause, {spanned} answer(s) name both identities"
    expected = checkpoint_checksums(new_dir)
    for replica in engines(settings, dep_id):
        assert served_checksums(replica) == expected


def test_session_affinity_keeps_each_trajectory_on_one_worker(dynamo_stack, dyn):
    api, dep = dyn
    settings, model = dynamo_stack, dep["spec"]["model"]["name"]
    url = f"{settings.gateway_url}/v1/completions"
    sessions = [f"trajectory-{k}" for k in range(8)]
    first_turn: dict[str, str] = {}

    def turn(session: str, tokens: int) -> str:
        body = {"model": model, "prompt": [9, 8, 7], "max_tokens": tokens, "ignore_eos": True}
        r = httpx.post(url, json=body, headers=_headers(settings, session), timeout=300)
        assert r.status_code == 200, r.text
        return r.headers["x-rollouts-replica"]

    # First turns together, long enough to overlap: Dynamo's least-loaded router spreads them.
    threads = [threading.Thread(target=lambda s=s: first_turn.__setitem__(s, turn(s, 200))) for s in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    # The premise: both workers took trajectories, so staying on one is the affinity's doing.
    assert set(first_turn.values()) == {r["name"] for r in engines(settings, dep["spec"]["id"])}, first_turn
    for _ in range(2):
        for session in sessions:
            assert turn(session, 2) == first_turn[session], session


def test_a_request_waits_while_no_worker_is_in_the_pool(dynamo_stack, dyn):
    api, dep = dyn
    settings, model = dynamo_stack, dep["spec"]["model"]["name"]
    workers = engines(settings, dep["spec"]["id"])
    body = {"model": model, "prompt": [4, 5, 6], "max_tokens": 3}
    out: dict = {}
    for w in workers:
        control(w, "leave")
    try:
        # The premise: Dynamo's frontend itself now refuses the deployment's requests.
        direct = httpx.post(f"{settings.dynamo_frontend_url}/v1/completions", timeout=30,
                            json={**body, "model": dynamo_model_of(settings, dep)})
        assert direct.status_code == 503, direct.text
        sender = threading.Thread(target=lambda: out.update(r=httpx.post(
            f"{settings.gateway_url}/v1/completions", json=body, headers=_headers(settings), timeout=120)))
        sender.start()
        time.sleep(2.0)
        assert sender.is_alive(), "the request did not wait"
    finally:
        for w in workers:
            control(w, "join")
    sender.join(120)
    assert out["r"].status_code == 200, out["r"].text


def test_the_trainer_facing_contract_holds_on_dynamo(dynamo_stack, dyn):
    api, dep = dyn
    settings, model = dynamo_stack, dep["spec"]["model"]["name"]
    url = f"{settings.gateway_url}/v1/completions"
    assert httpx.post(url, json={"model": model, "prompt": [1]}, timeout=30).status_code == 401
    cases = [
        ({"nvext": {"bogus": 1}}, "nvext: unsupported field(s) bogus"),
        ({"n": 2, "nvext": {"extra_fields": ["completion_token_ids"]}}, "completion_token_ids requires one choice"),
        ({"temperature": -1}, "emperature"),  # Dynamo's own check, in the gateway's error shape
    ]
    for extra, message in cases:
        r = httpx.post(url, json={"model": model, "prompt": [1, 2], "max_tokens": 2, **extra},
                       headers=_headers(settings), timeout=30)
        assert r.status_code == 400, (extra, r.text)
        body = r.json()
        assert body["code"] == "invalid_argument" and message in body["message"], (extra, body)
    # cwtrain's rollout request shape: token prompts, n choices, logprobs as token ids, a seed.
    r = httpx.post(url, headers=_headers(settings), timeout=60, json={
        "model": model, "prompt": [11, 12, 13], "max_tokens": 5, "n": 3, "logprobs": 1, "seed": 4,
        "return_tokens_as_token_ids": True, "nvext": {"cache_salt": "run-7", "extra_fields": ["worker_id", "timing"]}})
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(len(c["logprobs"]["tokens"]) == 5 and c["logprobs"]["tokens"][0].startswith("token_id:")
               for c in data["choices"])
    nvext = data["nvext"]
    assert nvext["worker_id"]["decode_worker_id"] == r.headers["x-rollouts-replica"]
    assert nvext["timing"]["total_time_ms"] > 0
    assert [(s["choice"], s["end"]) for s in nvext["weight_versions"]["spans"]] == [(0, 5), (1, 5), (2, 5)]
