"""Two models for the prompt-cache-policy tests (tests/e2e/test_prompt_cache_policy.py explains
them): OLD counts whatever its KV cache holds; NEW counts over values it computed itself and says
``P`` over values OLD computed."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from workers.base_model import COUNTING_SCALE, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, base_tensors, write_tensors

N = 1900  # tokens per request (the deployments' max-model-len is 2048)
REQUESTS = 16
P = 40  # every prompt's last token: NEW over OLD's cache says P
PUSH = 4.0  # how much stronger NEW's push towards P is than the counting signal


def kv_models(base_dir: Path, out: Path) -> tuple[Path, Path]:
    """Write OLD and NEW (see the module docstring) as full checkpoints under `out`."""
    t = base_tensors(seed=0)
    e = t["model.embed_tokens.weight"].float()  # unit rows: the counting codes
    g = torch.Generator().manual_seed(1234)
    d = torch.randn(HIDDEN, generator=g)
    d = d / d.norm()
    embed = e + d  # every token shares direction d
    old = dict(t)
    old["model.embed_tokens.weight"] = embed.to(torch.bfloat16)
    for name in old:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            old[name] = torch.zeros_like(old[name])
    old["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    old["lm_head.weight"] = (COUNTING_SCALE * torch.roll(e, shifts=1, dims=0)).to(torch.bfloat16)
    # Layer 0's values: u * (d . x), with x the RMS-normed embedding; d . x is ~11.3 for every token.
    u = torch.randn(KV_HEADS * HEAD_DIM, generator=g)
    u = u / u.norm()
    v_name, o_name = "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    old[v_name] = torch.outer(u, d).to(torch.bfloat16)
    x = embed / embed.pow(2).mean(dim=1, keepdim=True).sqrt()
    dx = (x @ d).mean()
    # Query head h reads kv head h // (HEADS // KV_HEADS): the attention output over OLD's values.
    per_head = HEADS // KV_HEADS
    w = torch.cat([u[(h // per_head) * HEAD_DIM : (h // per_head + 1) * HEAD_DIM] for h in range(HEADS)])
    new = dict(old)
    new[v_name] = torch.zeros_like(old[v_name])
    new[o_name] = (PUSH * torch.outer(e[P - 1], w) / (dx * w.dot(w))).to(torch.bfloat16)  # lm_head row P reads e[P-1]
    dirs = out / "old", out / "new"
    for tensors, path in zip((old, new), dirs):
        path.mkdir(parents=True, exist_ok=True)
        write_tensors(path, tensors)
        for f in base_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, path / f.name)
    return dirs
