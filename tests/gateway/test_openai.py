"""The gateway speaks OpenAI's API as the guide's "Generate rollouts" uses it, on real Dynamo vLLM workers on CPU:
chat and completions, streamed and not, token-id prompts, n > 1, logprobs with token
ids, sampling parameters and stops passed through; the OpenAI Python SDK and cwtrain's rollout
client work against it unmodified."""

from __future__ import annotations

import json
import subprocess
import uuid

import httpx
import openai
import pytest

from tests.helpers.gateway import random_prompt, serve_base
from tests.helpers.stack_fixtures import cwtrain_python
from workers.base_model import EOS, SPECIAL_TOKENS

pytestmark = pytest.mark.stack
EOS_ID = SPECIAL_TOKENS.index(EOS)  # the served base model's end of sequence


@pytest.fixture(scope="module")
def sdk(gw):
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=gw.settings.admin_token, max_retries=0, timeout=300)


def test_models_lists_the_deployment(gw, sdk):
    ids = [m.id for m in sdk.models.list().data]
    assert gw.model in ids
    assert httpx.get(f"{gw.url}/v1/models").status_code == 401


def test_chat_logprobs_carry_token_ids_as_in_the_guide(gw, sdk):
    resp = sdk.chat.completions.create(
        model=gw.model,
        messages=[{"role": "user", "content": "What is 17 times 23?"}],
        temperature=1.0,
        top_p=1.0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=2,
        extra_body={"nvext": {"cache_salt": "policy-v1"}, "ignore_eos": True},  # twelve tokens, always
        extra_headers={"X-Dynamo-Session-ID": "traj-1"},
    )
    choice = resp.choices[0]
    content = choice.logprobs.content
    assert len(content) == resp.usage.completion_tokens == 12
    for entry in content:
        extra = entry.model_extra or {}
        assert isinstance(extra.get("token_id"), int), entry
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
    assert "token_ids" not in (choice.model_extra or {})  # asked for by the gateway, not the client
    # The ids are the sampled tokens: the same request asking for nvext.completion_token_ids (the
    # guide's way) reports the same list.
    raw = gw.post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": True,
            "nvext": {"extra_fields": ["completion_token_ids"]},
        },
    ).json()
    ids = raw["nvext"]["completion_token_ids"]
    assert [e["token_id"] for e in raw["choices"][0]["logprobs"]["content"]] == ids and len(ids) == 8


def test_chat_stream_with_the_sdk(gw, sdk):
    stream = sdk.chat.completions.create(
        model=gw.model,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=10,
        temperature=1.0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"nvext": {"extra_fields": ["worker_id", "timing"]}, "ignore_eos": True},  # ten tokens, always
    )
    chunks = list(stream)
    token_ids = [
        e.model_extra["token_id"] for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content
    ]
    assert len(token_ids) == 10
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == "length"
    nvext = final[0].model_extra["nvext"]
    assert nvext["worker_id"]["decode_worker_id"] == nvext["weight_versions"]["replica"]
    assert nvext["timing"]["ttft_ms"] > 0 and nvext["timing"]["total_time_ms"] >= nvext["timing"]["ttft_ms"]
    assert chunks[-1].usage.completion_tokens == 10


def test_completions_token_id_prompt_n_choices_token_ids(gw, sdk):
    prompt = random_prompt(12)
    resp = sdk.completions.create(
        model=gw.model,
        prompt=prompt,
        n=3,
        max_tokens=9,
        temperature=1.0,
        logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "nvext": {"cache_salt": "r1"}, "ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert resp.usage.prompt_tokens == 12 and resp.usage.completion_tokens == 27
    for c in resp.choices:
        assert len(c.logprobs.tokens) == 9 and all(t.startswith("token_id:") for t in c.logprobs.tokens)
        assert all(lp is not None and lp <= 0 for lp in c.logprobs.token_logprobs)


def test_completions_text_prompt_stream_completion_token_ids(gw):
    body = {
        "prompt": "the quick",
        "max_tokens": 7,
        "temperature": 0,
        "stream": True,
        "nvext": {"extra_fields": ["completion_token_ids"]},
    }
    with httpx.stream(
        "POST", f"{gw.url}/v1/completions", json={"model": gw.model, **body}, headers=gw.headers, timeout=300
    ) as r:
        assert r.status_code == 200
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = next(c["nvext"]["completion_token_ids"] for c in chunks if "nvext" in c)
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert len(ids) == 7 and text
    # The same greedy request, not streamed, gives the same tokens.
    again = gw.post("/v1/completions", {**body, "stream": False}).json()
    assert again["nvext"]["completion_token_ids"] == ids and again["choices"][0]["text"] == text
    # vLLM's own return_token_ids (which Dynamo's frontend refuses) is answered in vLLM's shape,
    # with the same ids (tests/gateway/test_dynamo_stack.py has the rest of its shape).
    vllm_way = gw.post("/v1/completions", {**body, "stream": False, "return_token_ids": True})
    assert vllm_way.status_code == 200, vllm_way.text
    assert vllm_way.json()["choices"][0]["token_ids"] == ids, vllm_way.text


def test_seed_temperature_top_p_pass_through(gw):
    serve_base(gw)  # another test may have left the counting model, which samples like greedy
    session = {"X-Dynamo-Session-ID": f"seed-{uuid.uuid4()}"}  # one replica: same engine for all
    prompt = random_prompt(8)

    def sample(**kw):
        r = gw.post(
            "/v1/completions",
            {"prompt": prompt, "max_tokens": 16, "nvext": {"extra_fields": ["completion_token_ids"]}, **kw},
            session,
        )
        assert r.status_code == 200, r.text
        return r.json()["nvext"]["completion_token_ids"]

    greedy = sample(temperature=0)
    assert sample(temperature=1.0, seed=1234) == sample(temperature=1.0, seed=1234)
    assert sample(temperature=1.0, seed=1234) != greedy  # sampling happened (16 random tokens of 2048)
    # A nucleus of one token leaves nothing to chance: any seed gives the same tokens. (Not
    # compared with greedy: the base model's BF16 logits have exact ties, which argmax and the
    # sorted top-p path break differently.)
    assert sample(temperature=1.0, top_p=1e-9, seed=9) == sample(temperature=1.0, top_p=1e-9, seed=77)


def test_stop_strings_and_stop_token_ids(gw):
    session = {"X-Dynamo-Session-ID": f"stop-{uuid.uuid4()}"}
    prompt = random_prompt(8)
    ids_asked = {"nvext": {"extra_fields": ["completion_token_ids"]}}
    full = gw.post(
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **ids_asked},
        session,
    ).json()
    ids = full["nvext"]["completion_token_ids"]
    stop_id = ids[4]
    first = ids.index(stop_id)
    r = gw.post(
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [stop_id], **ids_asked},
        session,
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["nvext"]["completion_token_ids"] == ids[: first + 1]
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = gw.post(
        "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop": [stop]}, session
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == text[: text.index(stop)]
    too_many = gw.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "stop": list("abcde")})
    assert too_many.status_code == 400 and "at most 4 stop strings" in too_many.json()["error"]["message"]


def test_engine_errors_keep_their_message_and_unknown_model_is_404(gw):
    r = gw.post("/v1/completions", {"prompt": [1, 2], "max_tokens": 100000})
    # Dynamo's own validation, its details spelled out ...
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text
    assert "context length" in r.json()["error"]["message"], r.text
    assert r.json()["code"] == r.json()["error"]["code"] == "invalid_argument"  # ... in the gateway's shape
    r = httpx.post(f"{gw.url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=gw.headers)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"] and r.json()["code"] == "not_found"


def test_cwtrain_rollout_client_samples_a_group(gw):
    """cwtrain's CompletionSampler (what slime/miles/NeMo-RL use) against the gateway, unmodified:
    token-id prompt, n choices, logprobs with exact token ids, a cache salt."""
    code = """
import asyncio, json, sys
from cwtrain.integrations.rollout import CompletionSampler, RolloutConfig
cfg = RolloutConfig(base_url=sys.argv[1], model=sys.argv[2], api_key=sys.argv[3])
async def main():
    s = CompletionSampler(cfg)
    out = await s.sample(json.loads(sys.argv[4]), 4, max_tokens=6, temperature=1.0, cache_salt="run-r1")
    await s.aclose()
    print(json.dumps([[list(c.token_ids), list(c.token_logprobs), c.finish_reason] for c in out]))
asyncio.run(main())
"""
    prompt = random_prompt(10)
    proc = subprocess.run(
        [str(cwtrain_python()), "-c", code, f"{gw.url}/v1", gw.model, gw.settings.admin_token, json.dumps(prompt)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    completions = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(completions) == 4
    for ids, logprobs, finish in completions:
        # cwtrain sends no ignore_eos: a sampled end-of-sequence token ends a choice early, and
        # is its last token id.
        assert len(ids) == len(logprobs), (ids, logprobs)
        assert (len(ids), finish) == (6, "length") or (finish == "stop" and ids[-1] == EOS_ID and len(ids) <= 6), (
            ids,
            finish,
        )
