"""Where the gateway itself sends requests: a ``runtime.engine: vllm`` deployment's replicas (real
vLLM OpenAI servers on CPU; a ``dynamo-vllm`` deployment's requests are Dynamo's router's to
place: test_dynamo_stack.py): session affinity, least-loaded spreading, queueing behind a paused
replica (through the stack's gateway); and, through a gateway in this process serving a routing
table the test controls, what happens when a replica is gone, fails before the first byte, or
breaks mid-stream (a TCP proxy cuts a real replica's answer)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import uuid
from urllib.parse import urlparse

import httpx
import openai
import pytest

from common.processes import free_port
from gateway.routing import ReplicaView, Router
from replica.agent.engine_process import EngineProcess
from tests.helpers.gateway import ChaosProxy, LocalGateway, random_prompt
from tests.helpers.replicas import engines, hot_load_body

pytestmark = pytest.mark.stack
REPLICA = "x-rollouts-replica"


def served_by(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["nvext"]["weight_versions"]["replica"] == resp.headers[REPLICA]
    return resp.headers[REPLICA]


def test_a_vllm_deployment_runs_vllm_servers_and_refuses_hot_loads(vllm_gw):
    replicas = engines(vllm_gw.settings, vllm_gw.id)
    assert len(replicas) == 2 and not any(r.get("dynamoWorker") for r in replicas), replicas
    assert all(httpx.get(f"{r['engineUrl']}/health", timeout=10).status_code == 200 for r in replicas)
    r = vllm_gw.api.call("POST", "/hotLoads", json=hot_load_body(vllm_gw.id, "vllm-000000", None))
    assert r.status_code == 412 and "hot-load is not enabled on deployment" in r.json()["message"], r.text


def test_session_affinity_keeps_a_trajectory_on_one_replica(vllm_gw):
    for _ in range(2):
        session = {"X-Dynamo-Session-ID": f"traj-{uuid.uuid4()}"}
        seen = {
            served_by(vllm_gw.post("/v1/completions", {"prompt": random_prompt(6), "max_tokens": 2}, session))
            for _ in range(6)
        }
        assert len(seen) == 1, seen


def test_least_loaded_spreads_concurrent_requests(vllm_gw):
    names: list[str] = []

    def one() -> None:
        names.append(
            served_by(
                vllm_gw.post("/v1/completions", {"prompt": random_prompt(6), "max_tokens": 48, "ignore_eos": True})
            )
        )

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(names) == 6 and len(set(names)) == 2, names


async def test_requests_queue_while_a_replica_is_paused(vllm_gw):
    session = {"X-Dynamo-Session-ID": f"pause-{uuid.uuid4()}"}
    name = served_by(
        await asyncio.to_thread(vllm_gw.post, "/v1/completions", {"prompt": [5, 6], "max_tokens": 1}, session)
    )
    view = await vllm_gw.view()
    url = next(r.engine_url for r in view.replicas if r.name == name)
    engine = EngineProcess.attach(url, secret=vllm_gw.settings.engine_secret(view.workflow_id, name))
    await engine.pause(mode="keep")
    try:
        body = {"prompt": random_prompt(6), "max_tokens": 8, "ignore_eos": True}
        pending = asyncio.ensure_future(asyncio.to_thread(vllm_gw.post, "/v1/completions", body, session))
        await asyncio.sleep(4)
        assert not pending.done(), f"answered while the replica was paused: {pending.result().text[:300]}"
        assert await engine.is_paused()
    finally:
        await engine.resume()
        await engine.aclose()
    resp = await asyncio.wait_for(pending, 120)
    assert served_by(resp) == name and resp.json()["usage"]["completion_tokens"] == 8


# ---------------------------------------------------------------------------- faults
@pytest.fixture
def local(vllm_gw):
    """A gateway in this process; the test edits ``router.views`` (see LocalGateway)."""
    # A cooldown longer than any test, so "tried last after a failure" does not depend on speed.
    router = Router(cooldown_s=600.0)
    view = asyncio.run(vllm_gw.view())
    assert len(view.replicas) == 2
    router.set_view(view)
    with LocalGateway(vllm_gw.settings, router) as local:
        yield local


def replace_replicas(router: Router, replicas: list[ReplicaView]) -> None:
    view = next(iter(router.views.values()))
    router.set_view(dataclasses.replace(view, replicas=tuple(replicas)))


def post(local: LocalGateway, vllm_gw, body: dict, session: str | None = None) -> httpx.Response:
    headers = {**vllm_gw.headers, **({"X-Dynamo-Session-ID": session} if session else {})}
    return httpx.post(
        f"{local.url}/v1/completions", json={"model": vllm_gw.model, **body}, headers=headers, timeout=300
    )


def test_a_replica_that_is_gone_is_not_routed_to_and_sessions_fall_over(vllm_gw, local):
    r1, r2 = sorted(next(iter(local.router.views.values())).replicas, key=lambda r: r.name)
    session = f"s-{uuid.uuid4()}"
    local.router.pin(session, r1.name)
    assert served_by(post(local, vllm_gw, {"prompt": [7, 8], "max_tokens": 1}, session)) == r1.name
    replace_replicas(local.router, [r2])  # r1 left the deployment (its memo no longer lists it)
    for _ in range(3):
        assert served_by(post(local, vllm_gw, {"prompt": [7, 8], "max_tokens": 1}, session)) == r2.name
    assert local.router.sessions[session][0] == r2.name  # the trajectory now lives on r2


def test_failure_before_the_first_byte_is_retried_on_another_replica(vllm_gw, local):
    r1, r2 = sorted(next(iter(local.router.views.values())).replicas, key=lambda r: r.name)
    dead = dataclasses.replace(r1, engine_url=f"http://127.0.0.1:{free_port()}")  # nothing listens
    with ChaosProxy(urlparse(r1.engine_url).port, limit=0) as reset:  # accepts, then resets
        resetting = dataclasses.replace(r1, name="resetting", engine_url=reset.url)
        replace_replicas(local.router, [dead, resetting, r2])
        for stream in (False, True, False, True):
            session = f"s-{uuid.uuid4()}"
            local.router.pin(session, dead.name if stream else resetting.name)
            local.router.failed_at.clear()  # make the broken replicas first choice again
            body = {"prompt": random_prompt(5), "max_tokens": 4, "stream": stream}
            resp = post(local, vllm_gw, body, session)
            assert resp.status_code == 200, resp.text
            assert resp.headers[REPLICA] == r2.name
            if stream:
                assert resp.text.rstrip().endswith("data: [DONE]")
        # A replica whose connection failed is tried last for a while. The last request may have
        # reached r2 without trying `resetting` (ties are broken at random): fail it once more.
        session = f"s-{uuid.uuid4()}"
        local.router.pin(session, resetting.name)
        assert served_by(post(local, vllm_gw, {"prompt": random_prompt(5), "max_tokens": 1}, session)) == r2.name
        order = [r.name for r in local.router.candidates(next(iter(local.router.views.values())), None)]
        assert order[0] == r2.name


def test_a_replica_that_dies_while_answering_unstreamed_is_retried(vllm_gw, local):
    r1, r2 = sorted(next(iter(local.router.views.values())).replicas, key=lambda r: r.name)
    with ChaosProxy(urlparse(r1.engine_url).port, limit=40) as cut:  # dies after 40 bytes of headers
        replace_replicas(local.router, [dataclasses.replace(r1, engine_url=cut.url), r2])
        session = f"s-{uuid.uuid4()}"
        local.router.pin(session, r1.name)
        resp = post(local, vllm_gw, {"prompt": random_prompt(5), "max_tokens": 16, "ignore_eos": True}, session)
        assert resp.status_code == 200 and resp.headers[REPLICA] == r2.name
        assert resp.json()["usage"]["completion_tokens"] == 16


def test_a_stream_that_breaks_midway_ends_with_an_error_event(vllm_gw, local):
    r1, _ = sorted(next(iter(local.router.views.values())).replicas, key=lambda r: r.name)
    # Cut right after the first event: the stream has more to send (at least its ``[DONE]``),
    # however vLLM groups the tokens into events on a loaded machine.
    with ChaosProxy(urlparse(r1.engine_url).port, events=1) as cut:
        replace_replicas(local.router, [dataclasses.replace(r1, engine_url=cut.url)])
        body = {
            "model": vllm_gw.model,
            "prompt": random_prompt(5),
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{local.url}/v1/completions", json=body, headers=vllm_gw.headers, timeout=300) as r:
            assert r.status_code == 200
            events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
        assert cut.cut_at is not None, "the replica ended the stream before the proxy cut it: the premise"
        assert len(events) >= 2 and "[DONE]" not in events
        tokens = [json.loads(e) for e in events[:-1]]
        assert all("choices" in t for t in tokens) and len(tokens) < 64
        last = json.loads(events[-1])
        assert last["error"]["code"] == 503 and "incomplete" in last["error"]["message"]
        # The OpenAI SDK turns that event into an exception: a trainer cannot miss it.
        sdk = openai.OpenAI(base_url=f"{local.url}/v1", api_key=vllm_gw.settings.admin_token, max_retries=0)
        with pytest.raises(openai.APIError, match="incomplete"):
            for _ in sdk.completions.create(
                model=vllm_gw.model,
                prompt=random_prompt(5),
                max_tokens=64,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                pass


def test_no_replica_left_is_a_clear_503(vllm_gw, local):
    replace_replicas(local.router, [])
    resp = post(local, vllm_gw, {"prompt": [1, 2], "max_tokens": 1})
    assert resp.status_code == 503 and "no running replica" in resp.json()["error"]["message"]
    dead = ReplicaView("r-dead", f"http://127.0.0.1:{free_port()}", "initial")
    replace_replicas(local.router, [dead])
    resp = post(local, vllm_gw, {"prompt": [1, 2], "max_tokens": 1})
    assert resp.status_code == 503 and "r-dead" in resp.json()["error"]["message"]
