"""PROMPT_CACHE_POLICY_PRESERVE vs RESET_ALL, request by request, on the first replica of the
shared deployment (a real Dynamo vLLM worker on CPU), through the gateway and Dynamo's frontend.

Two models built so that the KV cache decides the next token by a wide margin:

- OLD counts (after token i it says i+1): every layer's ``o_proj`` and ``down_proj`` are zero, so
  attention and MLP add nothing, whatever the cache holds; its layer-0 ``v_proj`` maps every
  token to (nearly) the same value vector, because every embedding shares one direction ``d``.
- NEW is OLD with layer-0 ``v_proj`` zero and a layer-0 ``o_proj`` that turns that shared value
  vector into a strong push towards token ``P``. With values it computed itself (all zero) it
  counts exactly like OLD; over values OLD computed, it says ``P``.

Sixteen greedy requests whose prompts end in ``P`` count ``P+1, P+2, ...`` on OLD (``P`` itself
comes back only after 2048 tokens), sent together through the gateway while the other replicas
are out of Dynamo's routing pool (their ``leave`` route, as a pause does), so all run on the
first replica (each answer's ``worker_id`` says so). Its
swap to NEW is held inside its pause (fault point ``swap``, replica/faults.py) while the test reads
how many requests the engine froze there (vLLM's running gauge); exactly those answers carry two
weight-version spans, and each one's spans give the exact token ``k`` where NEW took over. Under
RESET_ALL the pause drops the KV cache and they are recomputed on NEW: every token, ``k``
included, still counts. Under PRESERVE they keep OLD's cache: token ``k`` is ``P``. A request
that was not frozen (it ended before the pause: the machine may start the sixteen unevenly)
carries one span and counts throughout. (The margins are ~11 logits or more: NEW's argmax is never
near a tie.)
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from tests.helpers.kv_models import REQUESTS, N, P, kv_models
from tests.helpers.replicas import (
    ROLLING_PREFIX,
    hot_load,
    requests_frozen_in_first_pause,
    start_hot_load,
    walk_order,
)
from workers.base_model import VOCAB
from workers.stack import upload_dir

pytestmark = pytest.mark.stack


def streamed(
    settings, model: str, prompt: list[int], go: threading.Barrier, started: threading.Event, out: dict
) -> None:
    """A greedy streamed completion through the gateway: its token ids, spans and replica."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "nvext": {"extra_fields": ["completion_token_ids", "worker_id"]},
    }
    headers = {"Authorization": f"Bearer {settings.admin_token}"}
    try:
        go.wait(60)
        with httpx.stream(
            "POST", f"{settings.gateway_url}/v1/completions", json=body, headers=headers, timeout=900
        ) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if any(c.get("text") for c in chunk.get("choices") or []):
                    started.set()
                nvext = chunk.get("nvext")
                if nvext:
                    out["tokens"] = nvext["completion_token_ids"]
                    out["spans"] = nvext["weight_versions"].get("spans")
                    out["replica"] = nvext["worker_id"]["decode_worker_id"]
    finally:
        started.set()


@pytest.mark.parametrize("policy", ["PROMPT_CACHE_POLICY_RESET_ALL", "PROMPT_CACHE_POLICY_PRESERVE"])
def test_each_request_spanning_an_update_follows_the_policy(stack, rolling, tmp_path, policy):
    api, dep = rolling
    settings, dep_id, model = stack, dep["spec"]["id"], dep["spec"]["model"]["name"]
    tag = policy.rsplit("_", 1)[-1].lower().replace("all", "reset")
    old_id, new_id = f"kvcache-{tag}-0", f"kvcache-{tag}-1"
    old_dir, new_dir = kv_models(settings.home_path / "models" / "base", tmp_path)
    upload_dir(settings.s3_client(), old_dir, settings.bucket, f"{ROLLING_PREFIX}/{old_id}")
    upload_dir(settings.s3_client(), new_dir, settings.bucket, f"{ROLLING_PREFIX}/{new_id}")
    assert hot_load(api, dep_id, old_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    first = walk_order(settings, dep_id)[0]

    prompts = [[5, 17 + i, P] for i in range(REQUESTS)]
    outs: list[dict] = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]
    go = threading.Barrier(REQUESTS)
    threads = [
        threading.Thread(target=streamed, args=(settings, model, p, go, e, o))
        for p, e, o in zip(prompts, started, outs)
    ]
    held = requests_frozen_in_first_pause(
        settings,
        api,
        dep_id,
        lambda: start_hot_load(api, dep_id, new_id, None, promptCachePolicy=policy),
        threads,
        started,
    )
    hl, was_paused, frozen = held.hot_load, held.was_paused, held.frozen
    assert was_paused, "the held swap was not inside a pause"
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    assert {o.get("replica") for o in outs} == {first["name"]}, [o.get("replica") for o in outs]

    counting = [(P + 1 + i) % VOCAB for i in range(N)]
    spanning = 0
    for prompt, out in zip(prompts, outs):
        tokens, spans = out["tokens"], out.get("spans")
        assert len(tokens) == N and tokens[0] == counting[0], f"{prompt}: {len(tokens)} tokens"
        assert spans is not None and spans[0]["start"] == 0 and spans[-1]["end"] == N, (prompt, spans)
        if len(spans) == 1:
            assert spans == [{"choice": 0, "identity": old_id, "start": 0, "end": N}] and tokens == counting
            continue
        spanning += 1
        k = spans[1]["start"]
        assert spans == [
            {"choice": 0, "identity": old_id, "start": 0, "end": k},
            {"choice": 0, "identity": new_id, "start": k, "end": N},
        ]
        assert 0 < k < N and tokens[:k] == counting[:k], (prompt, k)
        if policy.endswith("RESET_ALL"):
            assert tokens == counting, f"{prompt}: NEW did not count from token {k} (it kept OLD's cache)"
        else:
            assert tokens[k] == P, f"{prompt}: token {k} is {tokens[k]}, not {P} (NEW did not read OLD's cache)"
    # The premise, from the answers themselves: a request whose tokens come from both snapshots
    # was in flight across the swap, which happens inside the pause. The engine's running gauge
    # (``frozen``) is read after its last logged step and may lag; it may not exceed what spans.
    assert spanning >= 1, f"no answer spans the update (the engine's running gauge read {frozen} in the pause)"
    assert spanning >= frozen, f"{frozen} request(s) frozen in the pause, {spanning} answer(s) span the update"
