"""PROMPT_CACHE_POLICY_PRESERVE vs RESET_ALL, request by request, on the first replica of the
shared deployment (a real vLLM CPU engine).

Two models built so that the KV cache decides the next token by a wide margin:

- OLD counts (after token i it says i+1): every layer's ``o_proj`` and ``down_proj`` are zero, so
  attention and MLP add nothing, whatever the cache holds; its layer-0 ``v_proj`` maps every
  token to (nearly) the same value vector, because every embedding shares one direction ``d``.
- NEW is OLD with layer-0 ``v_proj`` zero and a layer-0 ``o_proj`` that turns that shared value
  vector into a strong push towards token ``P``. With values it computed itself (all zero) it
  counts exactly like OLD; over values OLD computed, it says ``P``.

Sixteen greedy requests whose prompts end in ``P`` count ``P+1, P+2, ...`` on OLD (``P`` itself
comes back only after 2048 tokens), sent together straight to the first replica's engine. Its
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

from common.settings import ENGINE_SECRET_HEADER
from tests.helpers.kv_models import REQUESTS, N, P, kv_models
from tests.helpers.replicas import (
    ROLLING_PREFIX,
    fault,
    faults,
    hot_load,
    paused,
    running_requests,
    start_hot_load,
    walk_order,
    write_faults,
)
from workers.base_model import VOCAB
from workers.stack import upload_dir

pytestmark = pytest.mark.stack


def streamed(url: str, headers: dict[str, str], model: str, prompt: list[int], go: threading.Barrier,
             started: threading.Event, out: dict) -> None:
    """A greedy streamed completion straight to the engine: its token ids and its choice's
    weight-version spans (``[{"version", "start", "end"}]``, on the chunk with the finish reason)."""
    body = {"model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    tokens: list[int] = []
    try:
        go.wait(60)  # the sixteen are sent together
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=900) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    tokens.extend(choice.get("token_ids") or [])
                    if choice.get("finish_reason"):
                        out["spans"] = choice.get("weight_versions")
                if tokens:
                    started.set()
    finally:
        out["tokens"] = tokens
        started.set()


@pytest.mark.parametrize("policy", ["PROMPT_CACHE_POLICY_RESET_ALL", "PROMPT_CACHE_POLICY_PRESERVE"])
def test_each_request_spanning_an_update_follows_the_policy(stack, rolling, tmp_path, policy):
    api, dep = rolling
    dep_id = dep["spec"]["id"]
    tag = policy.rsplit("_", 1)[-1].lower().replace("all", "reset")
    old_id, new_id = f"kvcache-{tag}-0", f"kvcache-{tag}-1"
    old_dir, new_dir = kv_models(stack.home_path / "models" / "base", tmp_path)
    upload_dir(stack.s3_client(), old_dir, stack.bucket, f"{ROLLING_PREFIX}/{old_id}")
    upload_dir(stack.s3_client(), new_dir, stack.bucket, f"{ROLLING_PREFIX}/{new_id}")
    assert hot_load(api, dep_id, old_id, None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    first = walk_order(stack, dep_id)[0]
    url, headers = first["engineUrl"], {ENGINE_SECRET_HEADER: first["engineSecret"]}
    model = httpx.get(f"{url}/v1/models", headers=headers, timeout=60).json()["data"][0]["id"]

    prompts = [[5, 17 + i, P] for i in range(REQUESTS)]
    outs: list[dict] = [{} for _ in prompts]
    started = [threading.Event() for _ in prompts]
    go = threading.Barrier(REQUESTS)
    threads = [threading.Thread(target=streamed, args=(url, headers, model, p, go, e, o))
               for p, e, o in zip(prompts, started, outs)]
    # The first replica's step is held at its start until the requests generate, then released
    # to its swap, held in the pause: they start seconds before the pause, not a staging before.
    at_start = fault("apply_snapshot", first["name"], "hold")
    hold = fault("swap", first["name"], "hold")
    hl_id, frozen, was_paused = None, -1, False
    try:
        with faults(stack, at_start, hold):
            hl_id = start_hot_load(api, dep_id, new_id, None, promptCachePolicy=policy)
            at_start.wait_fired(stack, dep_id)
            for t in threads:
                t.start()
            assert all(e.wait(600) for e in started)
            write_faults(stack, [hold])  # releases the step's start; its swap stays held
            hold.wait_fired(stack, dep_id)
            was_paused, frozen = paused(first), running_requests(first)
    finally:
        hl = api.wait_hot_load(hl_id) if hl_id else None  # the next test finds no hot-load open
        for t in threads:
            t.join(900)
    assert was_paused, "the held swap was not inside a pause"
    assert frozen >= 1, "no request was running when the pause began"
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]

    counting = [(P + 1 + i) % VOCAB for i in range(N)]
    spanning = 0
    for prompt, out in zip(prompts, outs):
        tokens, spans = out["tokens"], out.get("spans")
        assert len(tokens) == N and tokens[0] == counting[0], f"{prompt}: {len(tokens)} tokens"
        assert spans is not None and spans[0]["start"] == 0 and spans[-1]["end"] == N, (prompt, spans)
        if len(spans) == 1:  # not frozen in the pause: it ran on OLD alone
            assert spans == [{"version": old_id, "start": 0, "end": N}] and tokens == counting, (prompt, spans)
            continue
        spanning += 1
        k = spans[1]["start"]
        assert spans == [{"version": old_id, "start": 0, "end": k}, {"version": new_id, "start": k, "end": N}]
        assert 0 < k < N and tokens[:k] == counting[:k], (prompt, k)
        if policy.endswith("RESET_ALL"):
            assert tokens == counting, f"{prompt}: NEW did not count from token {k} (it kept OLD's cache)"
        else:
            assert tokens[k] == P, f"{prompt}: token {k} is {tokens[k]}, not {P} (NEW did not read OLD's cache)"
    assert spanning == frozen, f"{frozen} request(s) frozen in the pause, {spanning} answer(s) span the update"
