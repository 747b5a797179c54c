"""`nvext` through the stack's gateway on real Dynamo vLLM workers on CPU: cache_salt isolates prefix-cache
reuse per value (by behaviour: the prompt tokens the engine served from its prefix cache),
extra_fields (completion_token_ids, worker_id, timing), and clear 400s."""

from __future__ import annotations

import json
import re
import time
import uuid

import httpx
import pytest

from tests.helpers.gateway import random_prompt

pytestmark = pytest.mark.stack


def prefix_cache_hits(engine_url: str, engine_headers: dict[str, str]) -> float:
    text = httpx.get(f"{engine_url}/metrics", headers=engine_headers, timeout=30).text
    return sum(float(m) for m in re.findall(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def cached_tokens(gw, engine_url: str, engine_headers: dict[str, str], body: dict, session: dict) -> int:
    """Prompt tokens served from the prefix cache for one request: vLLM's
    usage.prompt_tokens_details.cached_tokens when the engine reports it
    (--enable-prompt-tokens-details), else the growth of its vllm:prefix_cache_hits counter
    (requests here are sequential and pinned to one replica, so the growth is this request's)."""
    before = prefix_cache_hits(engine_url, engine_headers)
    resp = gw.post("/v1/completions", body, session)
    assert resp.status_code == 200, resp.text
    details = resp.json()["usage"].get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    deadline = time.monotonic() + 5
    while True:  # the engine publishes its stats at the end of a step: allow a moment
        grown = prefix_cache_hits(engine_url, engine_headers) - before
        if grown or time.monotonic() > deadline:
            return int(grown)
        time.sleep(0.2)


async def test_cache_salt_isolates_prefix_cache_reuse(gw):
    session = {"X-Dynamo-Session-ID": f"salt-{uuid.uuid4()}"}
    prompt = random_prompt(256)  # many full KV blocks; never sent before
    first = gw.post("/v1/completions", {"prompt": [1], "max_tokens": 1}, session)
    name = first.headers["x-rollouts-replica"]
    view = await gw.view()
    url = next(r.engine_url for r in view.replicas if r.name == name)
    engine_headers = gw.settings.engine_headers(view.workflow_id, name)

    def ask(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1, **({"nvext": {"cache_salt": salt}} if salt else {})}
        return cached_tokens(gw, url, engine_headers, body, session)

    assert ask("policy-1") == 0  # first sight: computed
    reused = ask("policy-1")
    assert reused >= 128, reused  # same salt: the prompt's full blocks come from the cache
    assert ask("policy-2") == 0  # another salt: nothing reused
    assert ask(None) == 0  # no salt is a salt of its own
    assert ask("policy-2") == reused  # and each salt reuses its own blocks


def test_extra_fields_completion_token_ids_worker_id_timing(gw):
    body = {
        "prompt": random_prompt(6),
        "max_tokens": 5,
        "temperature": 1.0,
        "ignore_eos": True,  # five tokens
        "nvext": {"extra_fields": ["completion_token_ids", "worker_id", "timing"]},
    }
    # The sampled ids, also as cwtrain reads them (logprobs tokens as "token_id:N").
    as_ids = {"logprobs": 1, "return_tokens_as_token_ids": True}
    for stream in (False, True):
        resp = gw.post("/v1/completions", {**body, **as_ids, "stream": stream})
        assert resp.status_code == 200, resp.text
        if stream:
            chunks = [json.loads(ln[6:]) for ln in resp.text.splitlines() if ln.startswith("data: {")]
            nvext = next(c["nvext"] for c in chunks if "nvext" in c)
            tokens = [t for c in chunks for ch in c["choices"] for t in (ch.get("logprobs") or {}).get("tokens") or []]
        else:
            nvext = resp.json()["nvext"]
            tokens = resp.json()["choices"][0]["logprobs"]["tokens"]
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
        assert nvext["completion_token_ids"] == ids and len(ids) == 5
        assert nvext["worker_id"] == {
            "prefill_worker_id": resp.headers["x-rollouts-replica"],
            "decode_worker_id": resp.headers["x-rollouts-replica"],
        }
        assert nvext["timing"]["total_time_ms"] > 0 and nvext["timing"]["request_received_ms"] > 1.7e12
    # Without the client asking for token ids, only nvext carries them.
    resp = gw.post("/v1/completions", body).json()
    assert "token_ids" not in resp["choices"][0] and len(resp["nvext"]["completion_token_ids"]) == 5


@pytest.mark.parametrize(
    "body, message",
    [
        (
            {"n": 2, "nvext": {"extra_fields": ["completion_token_ids"]}},
            "requires one choice per request (n=1), got n=2",
        ),
        ({"nvext": {"extra_fields": ["routed_experts"]}}, "enable-return-routed-experts"),
        ({"nvext": {"agent_hints": {"osl": 4}}}, "unsupported field(s) agent_hints"),
        ({"nvext": {"extra_fields": ["everything"]}}, "unsupported value(s) everything"),
    ],
)
def test_nvext_errors_are_clear_400s(gw, body, message):
    for path, prompt in (
        ("/v1/completions", {"prompt": [1, 2]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ):
        resp = gw.post(path, {**prompt, "max_tokens": 1, **body})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "invalid_argument" and message in err["message"]
