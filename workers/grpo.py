"""The trainer side of `make demo`: a tiny GRPO on the CPU, in torch.

:func:`digits_reward` ("answer with digits": the fraction of completion tokens that are a digit,
verifiable from ids alone, near 10/2048 for the random base); :func:`group_advantages`
(``(r - mean) / (std + eps)`` per prompt's group, zeros for equal rewards); :func:`grpo_loss`
(the clipped surrogate, token-level mean, no KL). :class:`Policy` holds FP32 masters and Adam
over :func:`trainable_names` (``all``, ``head``, ``last``); ``step`` takes one GRPO update and
``export`` writes a BF16 checkpoint with the base's names, order, shards and side files, so
``snapshots.writer.write_delta`` can diff it. With the sampler's routed experts on every
rollout, forward passes replay them (`workers.routing_replay`).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from workers.base_model import INDEX_NAME, copy_side_files, load_checkpoint, write_tensors
from workers.routing_replay import Replay

DIGITS = "0123456789"


# ------------------------------------------------------------------------------------ the task


def make_prompts(n: int, *, seed: int) -> list[str]:
    """``n`` arithmetic questions such as ``"37 + 45 ="`` (deterministic in ``seed``)."""
    rng = random.Random(seed)
    ops = "+-*"
    return [f"{rng.randint(0, 999)} {rng.choice(ops)} {rng.randint(0, 999)} =" for _ in range(n)]


def digit_token_ids(model_dir: Path) -> frozenset[int]:
    """The ids of the tokens that are exactly one digit, read from the checkpoint's tokenizer."""
    vocab = json.loads((Path(model_dir) / "tokenizer.json").read_text())["model"]["vocab"]
    ids = frozenset(vocab[d] for d in DIGITS if d in vocab)
    if len(ids) != len(DIGITS):
        raise ValueError(f"{model_dir}: the tokenizer lacks single-digit tokens")
    return ids


def digits_reward(completion_ids: Sequence[int], digit_ids: frozenset[int]) -> float:
    """Fraction of the completion's tokens that are a digit (0.0 for an empty completion)."""
    if not completion_ids:
        return 0.0
    return sum(1 for t in completion_ids if t in digit_ids) / len(completion_ids)


# ------------------------------------------------------------------------------- GRPO math


@dataclass
class Rollout:
    """One sampled completion: the ids the sampler saw and produced, its reward, its group."""

    group: int
    prompt_ids: list[int]
    completion_ids: list[int]
    reward: float = 0.0
    sampler_logprobs: list[float] | None = None  # what the serving engine reported, per token
    advantage: float = 0.0
    # The sampler's routed experts, [prompt + completion - 1, layers, top_k] (an MoE deployment
    # with routing capture): the trainer replays them (workers.routing_replay).
    routed_experts: np.ndarray | None = None


def group_advantages(rewards: Sequence[float], groups: Sequence[int], *, eps: float = 1e-6) -> list[float]:
    """GRPO advantages: each reward minus its group's mean, over the group's (population) std.

    A group whose rewards are all equal carries no signal and gets zeros.
    """
    if len(rewards) != len(groups):
        raise ValueError("one group id per reward")
    by_group: dict[int, list[float]] = {}
    for r, g in zip(rewards, groups):
        by_group.setdefault(g, []).append(float(r))
    stats = {}
    for g, rs in by_group.items():
        mean = sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / len(rs))
        stats[g] = (mean, std)
    out = []
    for r, g in zip(rewards, groups):
        mean, std = stats[g]
        out.append(0.0 if std < eps else (float(r) - mean) / (std + eps))
    return out


def grpo_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped GRPO surrogate, averaged over every real completion token of the batch.

    ``logp``/``logp_old``/``mask``: ``[B, T]`` (mask 1 on completion tokens); ``advantages``:
    ``[B]``, broadcast over the sequence. Returns the loss and the fraction of clipped tokens.
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - logp_old.detach())
    adv = advantages.to(logp.dtype)[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    n = mask.sum().clamp_min(1.0)
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        clip_frac = (((ratio - 1.0).abs() > clip_eps).to(logp.dtype) * mask).sum() / n
    return loss, {"clip_frac": float(clip_frac)}


# -------------------------------------------------------------------------------- the policy

TRAIN_CHOICES = ("all", "head", "last")


def trainable_names(names: Sequence[str], train: str) -> frozenset[str]:
    """Which tensors the trainer updates: ``all``; ``head`` (``lm_head`` and the final norm);
    ``last`` (the head plus the last decoder layer). The others keep their bytes, so the delta
    writer leaves them out of every delta."""
    if train == "all":
        return frozenset(names)
    head = {n for n in names if n.startswith("lm_head.") or n == "model.norm.weight"}
    if train == "head":
        return frozenset(head)
    if train == "last":
        layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
        last = f"model.layers.{layers[-1]}." if layers else None
        return frozenset(head | {n for n in names if last and n.startswith(last)})
    raise ValueError(f"train must be one of {', '.join(TRAIN_CHOICES)}, not {train!r}")


@dataclass
class StepStats:
    loss: float
    clip_frac: float
    grad_norm: float
    tokens: int
    # Mean |trainer logp - sampler logp| over completion tokens (BF16 serving vs FP32 masters):
    # small when the replicas serve what the trainer last published.
    sampler_mismatch: float | None = None
    extra: dict[str, float] = field(default_factory=dict)


class Policy:
    """The trainer's model: FP32 master weights of a checkpoint (the class its config.json names:
    the embedded Llama, or a family of `workers.families`), Adam, BF16 export."""

    def __init__(
        self,
        model_dir: Path,
        *,
        lr: float = 2e-3,
        clip_eps: float = 0.2,
        inner_steps: int = 1,
        max_grad_norm: float = 1.0,
        train: str = "all",
        seed: int = 0,
    ) -> None:
        self.model_dir = Path(model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        torch.manual_seed(seed)
        # transformers reads the checkpoint's own layout (per-expert tensors into its fused experts).
        self.model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        self.base = load_checkpoint(self.model_dir)  # BF16 as published: what the trainer leaves alone
        self.names = list(self.base)  # the checkpoint's index order, kept for export
        params = dict(self.model.named_parameters())
        self.trainable = trainable_names(self.names, train)
        # A tensor trained must be a parameter under its checkpoint name (an MoE's experts are
        # fused in transformers' model: trained, they would need its per-expert export).
        indirect = sorted(self.trainable - params.keys())
        if indirect:
            raise ValueError(
                f"{model_dir}: --train {train} trains {indirect[:3]}, which {type(self.model).__name__} "
                "does not hold under their checkpoint names; train the head"
            )
        for n, p in params.items():
            p.requires_grad_(n in self.trainable)
        self.model.train()
        self.pad_id = int(config.get("pad_token_id") or 0)
        self.clip_eps = clip_eps
        self.inner_steps = inner_steps
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.Adam(
            [params[n] for n in self.names if n in self.trainable], lr=lr, betas=(0.9, 0.99), eps=1e-8
        )

    # -- forward
    def _batch(self, rollouts: Sequence[Rollout]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids``, ``attention_mask``, and the completion-token mask (aligned
        with the targets, i.e. shifted by one)."""
        seqs = [r.prompt_ids + r.completion_ids for r in rollouts]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        comp = torch.zeros((len(seqs), width - 1), dtype=torch.float32)
        for i, (r, s) in enumerate(zip(rollouts, seqs)):
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
            attn[i, : len(s)] = 1
            p, c = len(r.prompt_ids), len(r.completion_ids)
            comp[i, p - 1 : p - 1 + c] = 1.0  # target position t predicts token t+1
        return ids, attn, comp

    def replay(self, rollouts: Sequence[Rollout], width: int) -> Replay | None:
        """The sampler's routes replayed, as ``[B, width, layers, top_k]`` (``-1`` past each one's
        rows), when every rollout carries them; else None (the model routes by itself)."""
        if not rollouts or any(r.routed_experts is None for r in rollouts):
            return None
        first = rollouts[0].routed_experts
        out = torch.full((len(rollouts), width, *first.shape[1:]), -1, dtype=torch.long)
        for i, r in enumerate(rollouts):
            rows = len(r.prompt_ids) + len(r.completion_ids) - 1
            if r.routed_experts.shape != (rows, *first.shape[1:]):
                raise ValueError(
                    f"rollout {i}: routed experts of shape {list(r.routed_experts.shape)} for {rows} "
                    f"tokens run through the model"
                )
            out[i, :rows] = torch.from_numpy(r.routed_experts.astype(np.int64))
        return Replay(self.model, out)

    def token_logprobs(self, ids: torch.Tensor, attn: torch.Tensor, replay: Replay | None = None) -> torch.Tensor:
        """``[B, T-1]``: log p(token t+1 | tokens <= t); with ``replay``, each token goes to the
        experts the sampler routed it to (``replay`` counts where the trainer's router agreed)."""
        with replay if replay is not None else contextlib.nullcontext():
            logits = self.model(input_ids=ids, attention_mask=attn, use_cache=False).logits
        logits = logits[:, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)

    def completion_logprobs(self, rollouts: Sequence[Rollout]) -> list[list[float]]:
        """Per rollout, the trainer's log-prob of each completion token (no gradient)."""
        ids, attn, comp = self._batch(rollouts)
        with torch.no_grad():
            lp = self.token_logprobs(ids, attn, self.replay(rollouts, ids.shape[1]))
        out = []
        for i, r in enumerate(rollouts):
            p, c = len(r.prompt_ids), len(r.completion_ids)
            out.append(lp[i, p - 1 : p - 1 + c].tolist())
        return out

    # -- the update
    def step(self, rollouts: Sequence[Rollout]) -> StepStats:
        """One GRPO update on ``rollouts`` (their ``advantage`` set, e.g. by :func:`group_advantages`)."""
        ids, attn, comp = self._batch(rollouts)
        adv = torch.tensor([r.advantage for r in rollouts], dtype=torch.float32)
        replay = self.replay(rollouts, ids.shape[1])
        with torch.no_grad():
            logp_old = self.token_logprobs(ids, attn, replay)
        # Counted once, on the batch as sampled (the inner steps replay the same routes).
        extra = {"routes_agree": replay.agreed / replay.compared} if replay is not None and replay.compared else {}
        mismatch = None
        pairs = [(r, i) for i, r in enumerate(rollouts) if r.sampler_logprobs]
        if pairs:
            diffs = []
            for r, i in pairs:
                p, c = len(r.prompt_ids), len(r.completion_ids)
                ours = logp_old[i, p - 1 : p - 1 + c]
                theirs = torch.tensor(r.sampler_logprobs[:c], dtype=torch.float32)
                diffs.append((ours[: len(theirs)] - theirs).abs())
            mismatch = float(torch.cat(diffs).mean())
        loss_v, clip_frac, grad_norm = 0.0, 0.0, 0.0
        for _ in range(max(1, self.inner_steps)):
            self.optimizer.zero_grad(set_to_none=True)
            logp = self.token_logprobs(ids, attn, replay)
            loss, info = grpo_loss(logp, logp_old, adv, comp, clip_eps=self.clip_eps)
            loss.backward()
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(self.optimizer.param_groups[0]["params"], self.max_grad_norm)
            )
            self.optimizer.step()
            loss_v, clip_frac = float(loss.detach()), info["clip_frac"]
        return StepStats(loss_v, clip_frac, grad_norm, int(comp.sum()), mismatch, extra)

    # -- export
    def bf16_state(self) -> dict[str, torch.Tensor]:
        """Every checkpoint tensor in BF16: the trained ones from the FP32 masters, the others as
        published."""
        params = dict(self.model.named_parameters())
        return {
            n: params[n].detach().to(torch.bfloat16).contiguous() if n in self.trainable else self.base[n]
            for n in self.names
        }

    def export(self, out_dir: Path) -> Path:
        """Write the current weights as a BF16 full checkpoint in the base layout; returns ``out_dir``."""
        out_dir = Path(out_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        write_tensors(out_dir, self.bf16_state())
        copy_side_files(self.model_dir, out_dir)
        return out_dir


def same_layout(a: Path, b: Path) -> bool:
    """Whether two checkpoints have the same tensor names and shard files (for tests)."""
    ia = json.loads((Path(a) / INDEX_NAME).read_text())["weight_map"]
    ib = json.loads((Path(b) / INDEX_NAME).read_text())["weight_map"]
    return list(ia.items()) == list(ib.items())
