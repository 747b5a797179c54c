"""The generated base and counting models (no engine: plain torch and tokenizers)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer

from workers import base_model as bm


def test_base_model_layout(model_dirs: dict[str, Path]) -> None:
    d = model_dirs["base"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 64
    index = json.loads((d / bm.INDEX_NAME).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and all((d / s).exists() for s in shards)
    tensors = bm.load_checkpoint(d)
    assert set(tensors) == set(index["weight_map"])
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert tensors["model.embed_tokens.weight"].shape == (bm.VOCAB, 256)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 64, 256)
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (d / f).exists()


def test_generation_is_deterministic_and_fast(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    t0 = time.perf_counter()
    again = bm.write_base_model(tmp_path / "again")
    assert time.perf_counter() - t0 < 10
    for f in sorted(p.name for p in model_dirs["base"].iterdir()):
        assert (again / f).read_bytes() == (model_dirs["base"] / f).read_bytes(), f
    other = bm.base_tensors(seed=1)["lm_head.weight"]
    assert not torch.equal(other, bm.load_checkpoint(again)["lm_head.weight"])


def test_tokenizer(model_dirs: dict[str, Path]) -> None:
    tok = Tokenizer.from_file(str(model_dirs["base"] / "tokenizer.json"))
    assert tok.get_vocab_size() == bm.VOCAB
    enc = tok.encode("12 + 345 = 357")
    assert enc.ids[0] == tok.token_to_id(bm.BOS)
    # Digits one token each; words of the corpus are single tokens.
    assert [t for t in enc.tokens if t.isdigit()] == list("12345357")
    assert len(tok.encode("The policy weight update", add_special_tokens=False).ids) == 4
    assert tok.decode(tok.encode("hello world, 42!").ids, skip_special_tokens=True) == "hello world, 42!"
    cfg = json.loads((model_dirs["base"] / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == bm.EOS and "add_generation_prompt" in cfg["chat_template"]


def test_counting_model_differs_only_where_listed(model_dirs: dict[str, Path]) -> None:
    base = bm.load_checkpoint(model_dirs["base"])
    counting = bm.load_checkpoint(model_dirs["counting"])
    changed = {n for n in base if not torch.equal(base[n], counting[n])}
    # model.norm.weight is ones in both; the other listed tensors all differ.
    assert changed == set(bm.COUNTING_CHANGED) - {"model.norm.weight"}
    assert set(bm.counting_tensors(model_dirs["base"])) == set(bm.COUNTING_CHANGED)


def test_counting_model_predicts_successor_in_bf16(model_dirs: dict[str, Path]) -> None:
    """The residual stream is the embedding (o_proj = down_proj = 0): check every token."""
    t = bm.load_checkpoint(model_dirs["counting"])
    e = t["model.embed_tokens.weight"]
    h = e.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    logits = (h.float() @ t["lm_head.weight"].float().T).to(torch.bfloat16).float()
    assert torch.equal(logits.argmax(-1), (torch.arange(bm.VOCAB) + 1) % bm.VOCAB)
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 10  # robust to bf16 rounding (~0.125 at 32)


def test_main_writes_both(tmp_path: Path) -> None:
    assert bm.main([str(tmp_path), "--counting"]) == 0
    assert (tmp_path / "base" / "config.json").exists()
    assert (tmp_path / "counting" / bm.INDEX_NAME).exists()
