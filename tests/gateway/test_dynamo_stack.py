"""The shared 2-replica deployment (``runtime.engine: dynamo-vllm``) is served by NVIDIA Dynamo:
real Dynamo vLLM workers behind Dynamo's frontend and router, behind the gateway.

- Its replicas are Dynamo workers: each entry names its Dynamo worker and namespace, and Dynamo's
  frontend knows the deployment's model by its Dynamo name.
- ``X-Dynamo-Session-ID`` keeps each trajectory on the worker its first turn went to, with
  Dynamo's router spreading the first turns over both workers.
- A request that arrives while no worker is in Dynamo's routing pool (every one paused) waits
  for one to return instead of failing.
- Dynamo's own 400s reach the client in the gateway's error shape.

The rest of the trainer-facing contract (tokens, nvext, spans, the gateway's 400s, the load test)
runs on these same workers in the other modules of this folder; hot-loads on Dynamo workers are
tests/e2e's.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from contracts.names import deployment_workflow_id, dynamo_model
from tests.helpers.gateway import GatewayDeployment
from tests.helpers.replicas import control, engines

pytestmark = pytest.mark.stack


def _headers(settings, session: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {settings.admin_token}", **({"X-Dynamo-Session-ID": session} if session else {})}


def test_replicas_are_dynamo_workers(gw: GatewayDeployment):
    replicas = engines(gw.settings, gw.id)
    assert len(replicas) == 2
    assert all(r["dynamoWorker"] and r["dynamoNamespace"] for r in replicas), replicas
    # The frontend knows the deployment's model by its Dynamo name; the gateway maps it.
    models = httpx.get(f"{gw.settings.dynamo_frontend_url}/v1/models", timeout=10).json()["data"]
    assert any(m["id"] == _dynamo_model(gw) for m in models), models


def _dynamo_model(gw: GatewayDeployment) -> str:
    return dynamo_model(deployment_workflow_id(gw.settings.organization_id, gw.id))


def test_session_affinity_keeps_each_trajectory_on_one_worker(gw: GatewayDeployment):
    settings = gw.settings
    url = f"{settings.gateway_url}/v1/completions"
    sessions = [f"trajectory-{k}" for k in range(8)]
    first_turn: dict[str, str] = {}

    def turn(session: str, tokens: int) -> str:
        body = {"model": gw.model, "prompt": [9, 8, 7], "max_tokens": tokens, "ignore_eos": True}
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
    assert set(first_turn.values()) == {r["name"] for r in engines(settings, gw.id)}, first_turn
    for _ in range(2):
        for session in sessions:
            assert turn(session, 2) == first_turn[session], session


def test_a_request_waits_while_no_worker_is_in_the_pool(gw: GatewayDeployment):
    settings = gw.settings
    workers = engines(settings, gw.id)
    body = {"model": gw.model, "prompt": [4, 5, 6], "max_tokens": 3}
    out: dict = {}
    for w in workers:
        control(w, "leave")
    try:
        # The premise: Dynamo's frontend itself now refuses the deployment's requests.
        direct = httpx.post(f"{settings.dynamo_frontend_url}/v1/completions", timeout=30,
                            json={**body, "model": _dynamo_model(gw)})
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


def test_dynamos_own_400_comes_in_the_gateways_shape(gw: GatewayDeployment):
    r = httpx.post(f"{gw.settings.gateway_url}/v1/completions", headers=_headers(gw.settings), timeout=30,
                   json={"model": gw.model, "prompt": [1, 2], "max_tokens": 2, "temperature": -1})
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument" and "emperature" in r.json()["message"], r.json()
