"""The shared 2-replica deployment (``runtime.engine: dynamo-vllm``) is served by NVIDIA Dynamo:
real Dynamo vLLM workers behind Dynamo's frontend and router, behind the gateway.

- Its replicas are Dynamo workers: each entry names its Dynamo worker and namespace, and Dynamo's
  frontend knows the deployment's model by its Dynamo name.
- ``X-Dynamo-Session-ID`` keeps each trajectory on the worker its first turn went to, with
  Dynamo's router spreading the first turns over both workers.
- A request that arrives while no worker is in Dynamo's routing pool (every one paused) waits
  for one to return instead of failing.
- Dynamo's own 400s reach the client in the gateway's error shape.
- Dynamo's frontend answers no one without the stack's client certificate
  (common/dynamo_tls.py), and a worker serves no request without its deployment's request-plane
  secret (common/dynamo_planes.py), whether it came through the frontend or straight to the
  worker's TCP request plane: only the gateway, which checks the caller's token, reaches a model.
- vLLM's ``return_token_ids`` (which Dynamo's frontend refuses) and ``prompt_logprobs`` are
  answered in vLLM's shape, streamed or not, on completions and chat: the ids decode to the text
  and are the ones the logprobs name; ``echo``, which Dynamo would ignore, is a 400.

The rest of the trainer-facing contract (tokens, nvext, spans, the gateway's 400s, the load test)
runs on these same workers in the other modules of this folder; hot-loads on Dynamo workers are
tests/e2e's.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from common import dynamo_tls
from common.dynamo_planes import request_annotation
from contracts.names import deployment_workflow_id, dynamo_model, dynamo_namespace
from tests.helpers.gateway import GatewayDeployment, random_prompt
from tests.helpers.replicas import control, engines

pytestmark = pytest.mark.stack
REPO = Path(__file__).resolve().parents[2]


def _headers(settings, session: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {settings.admin_token}", **({"X-Dynamo-Session-ID": session} if session else {})}


def test_replicas_are_dynamo_workers(gw: GatewayDeployment):
    replicas = engines(gw.settings, gw.id)
    assert len(replicas) == 2
    assert all(r["dynamoWorker"] and r["dynamoNamespace"] for r in replicas), replicas
    # The frontend knows the deployment's model by its Dynamo name; the gateway maps it.
    models = _frontend(gw.settings).get("/v1/models", timeout=10).json()["data"]
    assert any(m["id"] == _dynamo_model(gw) for m in models), models


def _frontend(settings) -> httpx.Client:
    """Dynamo's frontend as the gateway reaches it: the stack's client certificate."""
    tls = settings.dynamo_tls()
    assert tls is not None and settings.dynamo_frontend_url.startswith("https://"), settings.dynamo_frontend_url
    return httpx.Client(base_url=settings.dynamo_frontend_url, verify=tls.ssl_context())


def test_dynamos_frontend_answers_no_one_without_the_stacks_client_certificate(gw: GatewayDeployment):
    """Only the gateway (which checks the caller's token) reaches a model: a local process that
    calls Dynamo's frontend gets no model list and no completion, whether it speaks plain HTTP
    (curl), HTTPS trusting the stack's CA but holding no client certificate, or HTTPS with a
    certificate of its own making."""
    settings = gw.settings
    url = settings.dynamo_frontend_url
    plain = "http://" + url.removeprefix("https://")
    body = {"model": _dynamo_model(gw), "prompt": [1, 2], "max_tokens": 2}
    ca_only = ssl.create_default_context(cafile=str(settings.dynamo_tls_dir / "ca.pem"))
    ca_only.check_hostname = False
    stranger = dynamo_tls.ensure(settings.home_path / "stranger-tls").ssl_context()  # another CA's certificate
    stranger.load_verify_locations(str(settings.dynamo_tls_dir / "ca.pem"))
    for name, base, verify in (
        ("plain HTTP", plain, True),
        ("no client certificate", url, ca_only),
        ("another CA's certificate", url, stranger),
    ):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            try:
                r = httpx.request(
                    method,
                    base + path,
                    json=body if method == "POST" else None,
                    verify=verify,
                    timeout=10,
                    trust_env=False,
                )
            except httpx.HTTPError as exc:
                assert isinstance(exc, httpx.TransportError), exc  # refused before any HTTP answer
                continue
            assert r.status_code != 200 and _dynamo_model(gw) not in r.text, (name, method, path, r.status_code, r.text)
    # The premise: with the stack's client certificate and the request-plane secret the same
    # calls are answered; with the certificate alone the workers refuse the completion.
    with _frontend(settings) as client:
        refused = client.post("/v1/completions", json=body, timeout=60)
        assert refused.status_code != 200 and "choices" not in refused.text, refused.text
        secret = settings.dynamo_request_secret(deployment_workflow_id(settings.organization_id, gw.id))
        r = client.post(
            "/v1/completions", timeout=60, json={**body, "nvext": {"annotations": [request_annotation(secret)]}}
        )
        assert r.status_code == 200 and r.json()["choices"], r.text


def test_dynamos_own_engine_routes_need_the_engines_secret(gw: GatewayDeployment):
    """Dynamo's routes on each worker's system server (sleep, profiling, its RL routes that pause
    the engine or load weights from disk) answer a local process without the engine's secret
    with a 401 and do nothing; the premise: with the secret, a harmless one answers."""
    for replica in engines(gw.settings, gw.id):
        url = replica["engineUrl"] + "/engine/"
        for route in (
            "control/sleep",
            "control/start_profile",
            "pause_generation",
            "update_weights_from_disk",
            "get_weight_version",
        ):
            for body in ({}, {"secret": "guessed"}):
                r = httpx.post(url + route, json=body, timeout=30, trust_env=False)
                error = r.json().get("error") if r.status_code == 200 else None
                assert isinstance(error, dict) and error.get("code") == 401, (
                    replica["name"],
                    route,
                    r.status_code,
                    r.text,
                )
        r = httpx.post(
            url + "get_weight_version", json={"secret": replica["engineSecret"]}, timeout=30, trust_env=False
        )
        assert r.status_code == 200 and "error" not in r.json(), r.text
        assert not r.json().get("is_paused", False), r.text


def test_a_local_process_on_the_request_plane_gets_no_completion(gw: GatewayDeployment):
    """A process on the machine that reads the discovery directory and speaks Dynamo's request
    plane to each worker's TCP port (no gateway, no frontend) gets no token without the
    deployment's request-plane secret, and tokens with it (the premise: it reached every worker)."""
    settings = gw.settings
    workflow_id = deployment_workflow_id(settings.organization_id, gw.id)
    workers = {int(r["dynamoWorker"], 16) for r in engines(settings, gw.id)}
    secret = request_annotation(settings.dynamo_request_secret(workflow_id))
    for given, served in (([], False), ([request_annotation("guessed")], False), ([secret], True)):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tests.helpers.request_plane_caller",
                str(settings.dynamo_discovery_dir),
                dynamo_namespace(workflow_id),
                *given,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        assert {r["instance"] for r in results} == workers, (proc.returncode, proc.stdout, proc.stderr[-3000:])
        for r in results:
            if served:
                assert r["tokens"] and "error" not in r, r
            else:
                assert not r["tokens"] and "error" in r, f"a stranger on the request plane got tokens: {r}"


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
        direct = _frontend(settings).post("/v1/completions", timeout=30, json={**body, "model": _dynamo_model(gw)})
        assert direct.status_code == 503, direct.text
        sender = threading.Thread(
            target=lambda: out.update(
                r=httpx.post(
                    f"{settings.gateway_url}/v1/completions", json=body, headers=_headers(settings), timeout=120
                )
            )
        )
        sender.start()
        time.sleep(2.0)
        assert sender.is_alive(), "the request did not wait"
    finally:
        for w in workers:
            control(w, "join")
    sender.join(120)
    assert out["r"].status_code == 200, out["r"].text


def test_dynamos_own_400_comes_in_the_gateways_shape(gw: GatewayDeployment):
    r = httpx.post(
        f"{gw.settings.gateway_url}/v1/completions",
        headers=_headers(gw.settings),
        timeout=30,
        json={"model": gw.model, "prompt": [1, 2], "max_tokens": 2, "temperature": -1},
    )
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument" and "emperature" in r.json()["message"], r.json()


def _sse(resp: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]


def test_vllms_return_token_ids_and_prompt_logprobs_are_answered_in_vllms_shape(gw: GatewayDeployment):
    """Dynamo's frontend refuses ``return_token_ids`` (the premise); through the gateway it is
    answered as vLLM answers it, and the ids are the sampled ones: they decode to the text and are
    the ids the logprobs name."""
    settings = gw.settings
    tokenizer = Tokenizer.from_file(str(gw.base_model / "tokenizer.json"))
    prompt = random_prompt(5)
    asked = {"max_tokens": 6, "ignore_eos": True, "return_token_ids": True, "logprobs": 1}
    direct = _frontend(settings).post(
        "/v1/completions",
        timeout=60,
        json={"model": _dynamo_model(gw), "prompt": prompt, "max_tokens": 2, "return_token_ids": True},
    )
    assert direct.status_code == 400 and "return_token_ids" in direct.text, direct.text
    for stream in (False, True):
        r = gw.post(
            "/v1/completions", {**asked, "prompt": prompt, "n": 2, "stream": stream, "return_tokens_as_token_ids": True}
        )
        assert r.status_code == 200, r.text
        if stream:
            choices: dict[int, dict] = {}
            for chunk in _sse(r):
                for ch in chunk["choices"]:
                    c = choices.setdefault(ch["index"], {"text": "", "token_ids": [], "tokens": []})
                    c["text"] += ch.get("text") or ""
                    c["token_ids"] += ch.get("token_ids") or []
                    c["tokens"] += (ch.get("logprobs") or {}).get("tokens") or []
                    c.setdefault("prompt_token_ids", ch.get("prompt_token_ids"))
                    c["prompt_token_ids"] = c["prompt_token_ids"] or ch.get("prompt_token_ids")
            got = [choices[i] for i in sorted(choices)]
        else:
            got = [{**c, "tokens": c["logprobs"]["tokens"]} for c in r.json()["choices"]]
        assert len(got) == 2
        for c in got:
            assert len(c["token_ids"]) == 6 and c["prompt_token_ids"] == prompt, c
            assert [f"token_id:{t}" for t in c["token_ids"]] == c["tokens"], c
            assert tokenizer.decode(c["token_ids"]) == c["text"], c
    chat = {"messages": [{"role": "user", "content": "tell me"}], **asked, "logprobs": True}
    r = gw.post("/v1/chat/completions", {**chat, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == choice["token_ids"] and len(
        choice["token_ids"]
    ) == 6
    assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    prompt_ids = data["prompt_token_ids"]
    assert tokenizer.decode(prompt_ids).find("tell me") >= 0, prompt_ids
    # vLLM's prompt_logprobs: none for the first prompt token, then the prompt's own token among each position's.
    assert len(data["prompt_logprobs"]) == len(prompt_ids) and data["prompt_logprobs"][0] is None
    assert all(str(t) in pos for t, pos in zip(prompt_ids[1:], data["prompt_logprobs"][1:])), data["prompt_logprobs"]
    r = gw.post("/v1/chat/completions", {**chat, "stream": True})
    chunks = _sse(r)
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []] == [
        e["token_id"] for c in chunks for ch in c["choices"] for e in (ch.get("logprobs") or {}).get("content") or []
    ]
    assert [c["prompt_token_ids"] for c in chunks if c.get("prompt_token_ids")] == [prompt_ids]
    # What Dynamo would take without doing it is refused, naming the field.
    r = gw.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "echo": True})
    assert r.status_code == 400 and r.json()["message"].startswith("echo: "), r.text
