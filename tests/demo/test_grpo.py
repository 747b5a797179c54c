"""The demo's trainer side (workers/grpo.py) and its report helpers (workers/demo.py), without
vLLM or the stack: the reward, GRPO's advantages and clipped loss, one update on a fixed batch,
and the BF16 export that the delta writer diffs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from snapshots.inspect import read_full_layout
from snapshots.writer import write_delta
from workers.base_model import load_checkpoint, train_tokenizer, write_tensors
from workers.demo import StepRecord, format_step, reward_summary, write_plot
from workers.families import write_family
from workers.grpo import (
    Policy,
    Rollout,
    digit_token_ids,
    digits_reward,
    group_advantages,
    grpo_loss,
    make_prompts,
    same_layout,
    trainable_names,
)

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 64,
    "max_position_embeddings": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "torch_dtype": "bfloat16",
}
DIGITS = frozenset(range(10, 20))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint in the base model's layout (BF16, two shards, index)."""
    out = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("architectures", "torch_dtype")})
    model = LlamaForCausalLM(cfg)
    tensors = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    write_tensors(out, tensors)
    (out / "config.json").write_text(json.dumps(TINY))
    vocab = {f"t{i}": i for i in range(64)} | {str(d): 10 + d for d in range(10)}
    (out / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    return out


def batch(prompt=(1, 5, 6)) -> list[Rollout]:
    """Two groups of four: in each, completions with more digit tokens earn more."""
    comps = [
        [10, 11, 12, 13],
        [10, 30, 31, 32],
        [40, 41, 42, 43],
        [44, 45, 46, 47],
        [14, 15, 50, 51],
        [52, 53, 54, 55],
        [16, 17, 18, 19],
        [56, 57, 58, 59],
    ]
    out = []
    for i, c in enumerate(comps):
        out.append(Rollout(group=i // 4, prompt_ids=list(prompt), completion_ids=c, reward=digits_reward(c, DIGITS)))
    for r, a in zip(out, group_advantages([r.reward for r in out], [r.group for r in out])):
        r.advantage = a
    return out


# ------------------------------------------------------------------------------ reward, task


def test_digits_reward_is_the_fraction_of_digit_tokens():
    assert digits_reward([10, 11, 12, 13], DIGITS) == 1.0
    assert digits_reward([10, 30, 31, 32], DIGITS) == 0.25
    assert digits_reward([30, 31], DIGITS) == 0.0
    assert digits_reward([], DIGITS) == 0.0


def test_digit_token_ids_reads_the_tokenizer(tiny_ckpt):
    assert digit_token_ids(tiny_ckpt) == DIGITS


def test_digit_token_ids_of_the_embedded_model_are_the_ten_digits(tmp_path):

    train_tokenizer().save(str(tmp_path / "tokenizer.json"))
    ids = digit_token_ids(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert sorted(tok.decode([i]) for i in ids) == list("0123456789")
    # A number tokenizes digit by digit, so a digit answer scores 1.
    enc = tok.encode("4821", add_special_tokens=False).ids
    assert digits_reward(enc, ids) == 1.0


def test_prompts_are_deterministic_arithmetic_questions():
    a, b = make_prompts(8, seed=3), make_prompts(8, seed=3)
    assert a == b and a != make_prompts(8, seed=4)
    for p in a:
        x, op, y, eq = p.split()
        assert x.isdigit() and y.isdigit() and op in "+-*" and eq == "="


# --------------------------------------------------------------------------------- GRPO math


def test_group_advantages_are_normalized_within_each_group():
    rewards = [0.0, 0.5, 1.0, 0.5, 0.2, 0.2, 0.2, 0.2]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    adv = group_advantages(rewards, groups)
    g0 = adv[:4]
    assert math.isclose(sum(g0), 0.0, abs_tol=1e-9)
    assert math.isclose(math.sqrt(sum(a * a for a in g0) / 4), 1.0, rel_tol=1e-4)
    assert g0[0] < g0[1] == g0[3] < g0[2]
    assert adv[4:] == [0.0] * 4  # equal rewards: no signal
    with pytest.raises(ValueError):
        group_advantages([1.0], [0, 1])


def test_grpo_loss_on_policy_is_minus_the_mean_advantage_and_its_gradient_follows_it():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-1.5, -0.5, -2.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    loss, info = grpo_loss(logp, logp.detach(), adv, mask)
    # ratio 1 everywhere: loss = -(2 + 2 - 1 - 1 - 1) / 5
    assert math.isclose(float(loss.detach()), -0.2, rel_tol=1e-6)
    assert info["clip_frac"] == 0.0
    loss.backward()
    expected = -(adv[:, None] * mask) / 5
    assert torch.allclose(logp.grad, expected)


def test_grpo_loss_clips_the_ratio():
    old = torch.zeros(1, 2)
    adv = torch.tensor([1.0])
    mask = torch.ones(1, 2)
    # Token 0 already moved past 1 + eps in the advantage's direction: no more push (zero gradient).
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)
    loss, info = grpo_loss(logp, old, adv, mask, clip_eps=0.2)
    loss.backward()
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] < 0.0
    assert info["clip_frac"] == 0.5
    assert math.isclose(float(loss.detach()), -(1.2 + 1.1) / 2, rel_tol=1e-6)
    # With a negative advantage the pessimistic side is the unclipped one: still a gradient.
    logp2 = torch.tensor([[math.log(1.5)]], requires_grad=True)
    loss2, _ = grpo_loss(logp2, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), clip_eps=0.2)
    loss2.backward()
    assert math.isclose(float(loss2.detach()), 1.5, rel_tol=1e-6) and logp2.grad[0, 0] > 0.0


# ----------------------------------------------------------------------------- the policy


def test_one_grpo_step_raises_the_log_probs_of_the_rewarded_completions(tiny_ckpt):
    policy = Policy(tiny_ckpt, lr=1e-2)
    rollouts = batch()
    before = policy.completion_logprobs(rollouts)
    stats = policy.step(rollouts)
    after = policy.completion_logprobs(rollouts)
    assert stats.tokens == 32 and math.isfinite(stats.loss) and stats.grad_norm > 0
    for r, b, a in zip(rollouts, before, after):
        change = sum(a) - sum(b)
        if r.advantage > 0.5:
            assert change > 0, (r.completion_ids, r.advantage, change)
        elif r.advantage < -0.5:
            assert change < 0, (r.completion_ids, r.advantage, change)
    # The digit tokens as a whole became likelier after the prompt.
    ids = torch.tensor([[1, 5, 6]])
    with torch.no_grad():
        probs0 = torch.softmax(Policy(tiny_ckpt).model(input_ids=ids).logits[0, -1].float(), -1)
        probs1 = torch.softmax(policy.model(input_ids=ids).logits[0, -1].float(), -1)
    assert probs1[sorted(DIGITS)].sum() > probs0[sorted(DIGITS)].sum()


def test_step_reports_the_sampler_mismatch(tiny_ckpt):
    policy = Policy(tiny_ckpt, lr=1e-2)
    rollouts = batch()
    for r, lps in zip(rollouts, policy.completion_logprobs(rollouts)):
        r.sampler_logprobs = [x + 0.25 for x in lps]
    assert math.isclose(policy.step(rollouts).sampler_mismatch, 0.25, rel_tol=1e-4)
    assert Policy(tiny_ckpt).step(batch()).sampler_mismatch is None


def test_export_is_a_bf16_checkpoint_in_the_base_layout_that_deltas_diff(tiny_ckpt, tmp_path):
    policy = Policy(tiny_ckpt, lr=1e-2)
    first = policy.export(tmp_path / "e0")
    assert same_layout(tiny_ckpt, first)
    assert all((tiny_ckpt / f).read_bytes() == (first / f).read_bytes() for f in ("config.json", "tokenizer.json"))
    # Before any step the export equals the input, bit for bit.
    base, exported = load_checkpoint(tiny_ckpt), load_checkpoint(first)
    assert all(exported[n].dtype == torch.bfloat16 and torch.equal(exported[n], base[n]) for n in base)
    empty = write_delta(tiny_ckpt, first, tmp_path / "d0", version="e0", base_version="base")
    assert empty.is_empty
    policy.step(batch())
    second = policy.export(tmp_path / "e1")
    read_full_layout(second)
    stats = write_delta(first, second, tmp_path / "d1", version="e1", base_version="e0")
    assert stats.changed > 0 and 0 < stats.ratio < 1.5
    index = json.loads((tmp_path / "d1" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["base_version"] == "e0" and set(index["weight_map"]) <= set(base)


# ------------------------------------------------------------------------- demo reporting


def test_reward_summary_compares_first_and_last_five():
    assert reward_summary([0.0] * 5 + [0.5] * 10 + [1.0] * 5) == (0.0, 1.0)
    assert reward_summary([0.1, 0.3, 0.5, 0.7]) == (0.2, 0.6)  # fewer than 10 steps: halves
    assert reward_summary([]) == (0.0, 0.0)


def test_progress_line_and_plot(tmp_path):
    recs = [
        StepRecord(0, "step-000000", "FULL", None, None, 3.2, 2, 2, "HOT_LOAD_STATE_COMPLETED"),
        StepRecord(
            1,
            "step-000001",
            "DELTA",
            0.004,
            12.5,
            1.1,
            2,
            2,
            "HOT_LOAD_STATE_COMPLETED",
            tokens=1024,
            rollout_s=2.0,
            train_s=0.5,
            mismatch=0.01,
            sample="abc",
            pause_ms=31.6,
        ),
    ]
    line = format_step(recs[1])
    for part in ("step-000001", "0.004", "12.50%", "1.10s", "32ms", "2/2", "512", "0.0100"):
        assert part in line, (part, line)
    assert "full" in format_step(recs[0])
    skipped = StepRecord(
        2, "step-000001", "NONE", 0.0, None, 0.0, 2, 2, "HOT_LOAD_STATE_COMPLETED", tokens=64, rollout_s=1.0
    )
    assert "none" in format_step(skipped) and "step-000001" in format_step(skipped)
    pytest.importorskip("matplotlib")
    png = write_plot(recs, tmp_path / "p.png")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_trainable_names_and_a_head_only_step_leaves_the_rest_untouched(tiny_ckpt, tmp_path):
    names = list(load_checkpoint(tiny_ckpt))
    assert trainable_names(names, "all") == frozenset(names)
    assert trainable_names(names, "head") == {"lm_head.weight", "model.norm.weight"}
    last = trainable_names(names, "last")
    assert {"lm_head.weight", "model.layers.1.mlp.down_proj.weight"} <= last
    assert not any(n.startswith("model.layers.0.") for n in last)
    with pytest.raises(ValueError):
        trainable_names(names, "some")
    policy = Policy(tiny_ckpt, lr=1e-2, train="head")
    policy.step(batch())
    stats = write_delta(tiny_ckpt, policy.export(tmp_path / "h1"), tmp_path / "dh", version="h1", base_version="base")
    index = json.loads((tmp_path / "dh" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"lm_head.weight", "model.norm.weight"} and stats.changed == 2


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory) -> Path:
    """A small random Qwen3-MoE (8 experts, top 2) as `rollouts demo --model qwen3-moe` deploys it."""
    out = tmp_path_factory.mktemp("moe")
    tokenizer_from = out / "tok"
    tokenizer_from.mkdir()
    train_tokenizer().save(str(tokenizer_from / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (tokenizer_from / name).write_text("{}")
    return write_family(out, tokenizer_from, "qwen3_moe")


def own_routes(policy: Policy, rollouts: list[Rollout]) -> list[np.ndarray]:
    """Per rollout, the experts the trainer's own router picks, in nvext.routed_experts' rows."""
    ids, attn, _ = policy._batch(rollouts)
    with torch.no_grad():
        logits = policy.model(input_ids=ids, attention_mask=attn, output_router_logits=True).router_logits
    k = policy.model.config.num_experts_per_tok
    per_layer = [torch.topk(x.reshape(ids.shape[0], ids.shape[1], -1), k, dim=-1).indices for x in logits]
    routes = torch.stack(per_layer, dim=2).numpy().astype(np.uint8)  # [B, T, layers, top_k]
    return [routes[i, : len(r.prompt_ids) + len(r.completion_ids) - 1] for i, r in enumerate(rollouts)]


def test_replayed_routes_are_what_the_trainer_computes_with(moe_ckpt):
    """The trainer replays the sampler's routes (workers/routing_replay.py): its own routes give
    exactly its own log-probs (agreement 1); other routes give other log-probs, counted as
    disagreeing rows; routes that do not fit the model are refused, naming the shape."""
    policy = Policy(moe_ckpt, train="head")
    rollouts = batch(prompt=(1, 5, 6, 7))[:3]
    plain = policy.completion_logprobs(rollouts)
    mine = own_routes(policy, rollouts)
    replayed = [Rollout(r.group, r.prompt_ids, r.completion_ids, routed_experts=m) for r, m in zip(rollouts, mine)]
    assert policy.completion_logprobs(replayed) == plain
    # Every token of the first rollout sent to two other experts in every layer.
    other = (mine[0].astype(np.int64) + 3) % 8
    assert (np.sort(other, -1) != np.sort(mine[0], -1)).any(-1).all()
    moved = [dataclasses.replace(replayed[0], routed_experts=other.astype(np.uint8)), *replayed[1:]]
    changed = policy.completion_logprobs(moved)
    # The other rollouts' tokens meet other tokens in each expert's matmul: the same up to rounding.
    assert np.abs(np.subtract(changed[0], plain[0])).max() > 1e-2
    assert np.allclose(np.concatenate(changed[1:]), np.concatenate(plain[1:]), rtol=0, atol=1e-5)
    stats = policy.step([dataclasses.replace(r, advantage=a) for r, a in zip(replayed, (1.0, -1.0, 0.0))])
    assert stats.extra["routes_agree"] == 1.0
    stats = policy.step([dataclasses.replace(r, advantage=a) for r, a in zip(moved, (1.0, -1.0, 0.0))])
    rows = [len(r.prompt_ids) + len(r.completion_ids) - 1 for r in rollouts]
    assert stats.extra["routes_agree"] == pytest.approx(1 - rows[0] / sum(rows))
    with pytest.raises(ValueError, match=r"rollout 0: routed experts of shape \[3, 2, 2\]"):
        policy.completion_logprobs([dataclasses.replace(replayed[0], routed_experts=mine[0][:3]), *replayed[1:]])


def test_a_qwen3_moe_trainer_reads_per_expert_tensors_and_exports_them_untouched(tmp_path):
    """`rollouts demo --model qwen3-moe`'s trainer: transformers' Qwen3-MoE reads the checkpoint's
    per-expert tensors into its fused experts; a head-only step exports a checkpoint whose delta
    holds the head alone, every expert tensor as published; training the experts is refused
    (transformers does not hold them under their checkpoint names)."""
    tokenizer_from = tmp_path / "tok"
    tokenizer_from.mkdir()
    train_tokenizer().save(str(tokenizer_from / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (tokenizer_from / name).write_text("{}")
    moe = write_family(tmp_path, tokenizer_from, "qwen3_moe")
    policy = Policy(moe, lr=1e-2, train="head")
    assert type(policy.model).__name__ == "Qwen3MoeForCausalLM"
    assert any(".experts.7.down_proj." in n for n in policy.names)
    policy.step(batch())
    stats = write_delta(moe, policy.export(tmp_path / "m1"), tmp_path / "dm", version="m1", base_version="base")
    index = json.loads((tmp_path / "dm" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {"lm_head.weight", "model.norm.weight"} and stats.changed == 2
    with pytest.raises(ValueError, match=r"--train all trains .*experts"):
        Policy(moe, train="all")
