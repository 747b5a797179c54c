"""PROMPT_CACHE_POLICY_PRESERVE vs RESET_ALL, by behaviour, on a real vLLM CPU replica.

A greedy request is running when its replica's weights change. Under RESET_ALL the KV cache is
discarded at the update, so everything generated after the switch equals a recompute of the
same prefix on the new weights. Under PRESERVE the request keeps its old KV cache, so what it
generates after the switch is not what a recompute on the new weights gives. The new weights
here make attention matter (large linear weights), so stale keys and values show.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch

from tests.e2e.conftest import PREFIX
from tests.e2e.test_delta_rolling_update import engines, hot_load
from workers.base_model import base_tensors, write_tensors
from workers.stack import upload_dir

pytestmark = pytest.mark.stack
PROMPT = [5, 17, 33, 101]
N = 1900
COMPARE = 16


def strong_model(base_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tensors = base_tensors(seed=1)
    for name, t in tensors.items():
        if name.endswith("_proj.weight"):
            tensors[name] = (t.float() * 10).to(torch.bfloat16)
    write_tensors(out, tensors)
    for f in base_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, out / f.name)
    return out


def greedy(url: str, model: str, prompt: list[int], n: int) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}, timeout=300)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def streamed_greedy(url: str, model: str, started: threading.Event, out: list[int]) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for tok in json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]:
                out.append(int(tok.split(":", 1)[1]))
            started.set()


@pytest.mark.parametrize("policy", ["PROMPT_CACHE_POLICY_RESET_ALL", "PROMPT_CACHE_POLICY_PRESERVE"])
def test_request_spanning_an_update(stack, rolling, tmp_path, policy):
    api, dep = rolling
    dep_id, model = dep["spec"]["id"], dep["spec"]["model"]["name"]
    s3 = stack.s3_client()
    base = stack.home_path / "models" / "base"
    tag = policy.rsplit("_", 1)[-1].lower().replace("all", "reset")
    upload_dir(s3, base, stack.bucket, f"{PREFIX}/cache-{tag}-0")
    assert hot_load(api, dep_id, f"cache-{tag}-0", None)["status"]["state"] == "HOT_LOAD_STATE_COMPLETED"
    upload_dir(s3, strong_model(base, tmp_path / "strong"), stack.bucket, f"{PREFIX}/cache-{tag}-1")

    first = sorted(engines(stack, dep_id), key=lambda r: (r["zone"], r["name"]))[0]  # updated first
    url = first["engineUrl"]
    old = greedy(url, model, PROMPT, N)
    tokens: list[int] = []
    started = threading.Event()
    t = threading.Thread(target=streamed_greedy, args=(url, model, started, tokens))
    t.start()
    assert started.wait(120)
    hl = hot_load(api, dep_id, f"cache-{tag}-1", None, promptCachePolicy=policy)
    t.join(600)
    assert hl["status"]["state"] == "HOT_LOAD_STATE_COMPLETED", hl["status"]
    assert len(tokens) == N, "the request spanning the update did not complete"
    k = next((i for i, (a, b) in enumerate(zip(tokens, old)) if a != b), None)
    assert k is not None and 0 < k < N - COMPARE, f"the update did not land mid-request (k={k})"
    recompute = greedy(url, model, PROMPT + tokens[:k], COMPARE)
    if policy.endswith("RESET_ALL"):
        assert tokens[k : k + COMPARE] == recompute
    else:
        assert tokens[k : k + COMPARE] != recompute
