"""Autoscaling on the real stack, with real Dynamo vLLM workers on CPU and real load through the
gateway: a min-1/max-2 deployment (`targetInFlight` 2, both durations 0, so each step follows
the gateway's judgement of its 10 s window at once) serving a trained snapshot.

- Load beyond one replica (CLIENTS clients, each sending request after request): the gateway
  judges the deployment BUSY and a second replica starts; the load pauses while it starts (a
  second engine barely starts on two cores beside a busy one) on the base weights; it takes the
  deployment's current snapshot from the serving replica (its agent counts bytes from a peer
  and none from the bucket; the serving one counts them sent), joins, and the load, sent
  again, is answered by both replicas, each answer labelled with that snapshot.
- The load stops: once the gateway's window is empty it reports IDLE, and SCALE_IN_AFTER_S
  later the newest replica
  leaves the replica list, drains and stops; the deployment is READY on one replica again.
- No request failed, before, during or after either step.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from common.processes import alive
from tests.helpers.deployments import delete_deployment
from tests.helpers.prometheus import scrape, value
from tests.helpers.replicas import engines, hot_load
from tests.helpers.stack_fixtures import Api, deployment_body
from tests.helpers.trainer import train_step
from workers.stack import upload_dir

pytestmark = pytest.mark.stack

PREFIX = "checkpoints/autoscaling"
TRAINED = "scale-000001"
# Each waits between its requests (a new connection, its answer parsed): 3 kept the mean under 2 for up to 40 s.
CLIENTS = 4
MAX_TOKENS = 48
# Idle this long after the new replica joined (and after the load ends) before it is removed.
SCALE_IN_AFTER_S = 30


def _ask(stack, model: str, i: int) -> tuple[int, str, str | None, str | None]:
    """One completion through the gateway: (status, error text or "", replica, identity)."""
    body = {"model": model, "prompt": [5, 9 + i, 7], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    try:
        r = httpx.post(
            f"{stack.gateway_url}/v1/completions",
            json=body,
            timeout=300,
            headers={"Authorization": f"Bearer {stack.admin_token}"},
        )
    except httpx.HTTPError as exc:
        return 0, repr(exc), None, None
    if r.status_code != 200:
        return r.status_code, r.text[:300], None, None
    data = r.json()
    labels = data["nvext"]["weight_versions"]
    ok = data["usage"]["completion_tokens"] == MAX_TOKENS
    return (
        200,
        "" if ok else f"{data['usage']['completion_tokens']} tokens",
        labels.get("replica"),
        labels.get("identity"),
    )


def test_load_scales_out_to_a_replica_on_the_current_snapshot_and_idle_scales_back_in(stack, tmp_path):
    api = Api(stack)
    body = deployment_body(stack, "autoscaled", replicas=1, path_prefix=PREFIX)
    body["autoscaling"] = {
        "min": 1,
        "max": 2,
        "targetInFlight": 2,
        "scaleOutAfterSeconds": 0,
        "scaleInAfterSeconds": SCALE_IN_AFTER_S,
    }
    dep = api.call("POST", "/deployments", json=body).json()["deployment"]
    dep_id, model = dep["spec"]["id"], body["model"]["name"]
    stops = [threading.Event() for _ in range(CLIENTS)]
    answers: list[tuple[int, str, str | None, str | None]] = []

    def client(i: int) -> None:
        while not stops[i].is_set():
            answers.append(_ask(stack, model, i))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
    marks = {"start": time.monotonic()}
    try:
        assert api.wait_deployment(dep_id)["status"]["status"] == "STATUS_READY"
        trained = train_step(stack.home_path / "models" / "base", tmp_path / TRAINED, seed=43)
        upload_dir(stack.s3_client(), trained, stack.bucket, f"{PREFIX}/{TRAINED}")
        assert hot_load(api, dep_id, TRAINED, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
        (first,) = [r["name"] for r in engines(stack, dep_id)]

        for t in threads:
            t.start()
        marks["load"] = time.monotonic()
        deadline = time.monotonic() + 900
        while (
            "joining"
            not in api.call("GET", f"/deployments/{dep_id}").json()["deployment"]["status"]["conditions"][0]["message"]
        ):
            assert time.monotonic() < deadline, "no scale-out under load"
            time.sleep(0.5)
        marks["scale-out"] = time.monotonic()
        for stop in stops:  # a second engine barely starts on two cores beside a busy one
            stop.set()
        for t in threads:
            t.join(timeout=300)
        while len(engines(stack, dep_id)) < 2:
            assert time.monotonic() < deadline, "no second replica joined under load"
            time.sleep(1)
        (new,) = [r for r in engines(stack, dep_id) if r["name"] != first]
        joined = new["name"]
        marks["joined"] = time.monotonic()
        serving = next(r for r in engines(stack, dep_id) if r["name"] == first)
        took, gave = scrape(new["metricsUrl"]), scrape(serving["metricsUrl"])
        assert value(took, "rollouts_replica_bytes_total", source="peer") > 0, (
            "the new replica took nothing from its peer"
        )
        assert value(took, "rollouts_replica_bytes_total", source="bucket") == 0
        assert value(gave, "rollouts_replica_bytes_sent_total") == value(
            took, "rollouts_replica_bytes_total", source="peer"
        )
        stops = [threading.Event() for _ in range(CLIENTS)]  # the load again, within SCALE_IN_AFTER_S
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        seen = len(answers)
        while not any(replica == joined for _, _, replica, _ in answers[seen:]):
            assert time.monotonic() < deadline, "the new replica served no request"
            time.sleep(0.5)
        marks["served"] = time.monotonic()
        for stop in stops:
            stop.set()
        for t in threads:
            t.join(timeout=300)
        served = {replica for _, _, replica, _ in answers}
        assert served == {first, joined}, served
        assert {identity for status, _, _, identity in answers if status == 200} == {TRAINED}

        while len(engines(stack, dep_id)) > 1:
            assert time.monotonic() < deadline, "the idle deployment did not scale in"
            time.sleep(1)
        marks["scale-in"] = time.monotonic()
        assert [r["name"] for r in engines(stack, dep_id)] == [first]  # the newest one left
        while any(alive(pid) for pid in (new["agentPid"], new["enginePid"])):  # drained, then stopped
            assert time.monotonic() < deadline, "the replica that left did not stop"
            time.sleep(1)
        status = api.call("GET", f"/deployments/{dep_id}").json()["deployment"]["status"]
        assert status["status"] == "STATUS_READY" and status["readyReplicas"] == 1, status
        assert _ask(stack, model, 0)[:3] == (200, "", first)
        failed = [a for a in answers if a[0] != 200 or a[1]]
        assert not failed, f"{len(failed)} of {len(answers)} requests failed: {failed[:5]}"
        steps = list(marks.items())
        print(
            f"\n[autoscaling] {len(answers)} requests, none failed; served by {sorted(served)}; "
            + ", ".join(f"{b} at +{tb - steps[0][1]:.0f} s" for b, tb in steps[1:])
        )
    finally:
        for stop in stops:
            stop.set()
        for t in threads:
            if t.is_alive():
                t.join(timeout=300)
        delete_deployment(api, dep_id)
