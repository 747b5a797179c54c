"""Realistic checkpoint pairs for tests and benchmarks: one RL step of a BF16 model.

A trainer keeps an fp32 master copy and publishes it rounded to BF16. One Adam step at a
typical RL learning rate (1e-6) moves every master weight by about ``lr``, but BF16 keeps only 8
significant bits, so only the weights whose value crosses a rounding boundary change in the
published checkpoint: a few percent of elements, concentrated in small-magnitude weights, while
norm weights near 1.0 do not change at all. Deltas of such pairs compress the way real ones do
(cwtrain's field measurement: about 4-5 % of the full size).

:func:`make_checkpoint_pair` writes the base and the stepped checkpoint as Llama-shaped full
snapshots (``config.json``, index, shards) of about ``size_mb`` MiB each; generation is chunked
per tensor, so memory stays near the largest tensor.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from snapshots.inspect import INDEX_FILE
from snapshots.safetensors_io import TensorSpec, write_safetensors


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    layers: int
    vocab: int

    def tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """``(name, shape, kind)`` with kind ``matrix``, ``embedding`` or ``norm``."""
        h, i = self.hidden, self.intermediate
        out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (self.vocab, h), "embedding")]
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            out += [
                (p + "input_layernorm.weight", (h,), "norm"),
                (p + "self_attn.q_proj.weight", (h, h), "matrix"),
                (p + "self_attn.k_proj.weight", (h, h), "matrix"),
                (p + "self_attn.v_proj.weight", (h, h), "matrix"),
                (p + "self_attn.o_proj.weight", (h, h), "matrix"),
                (p + "post_attention_layernorm.weight", (h,), "norm"),
                (p + "mlp.gate_proj.weight", (i, h), "matrix"),
                (p + "mlp.up_proj.weight", (i, h), "matrix"),
                (p + "mlp.down_proj.weight", (h, i), "matrix"),
            ]
        out += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (self.vocab, h), "embedding")]
        return out

    @property
    def nbytes(self) -> int:
        return sum(2 * math.prod(shape) for _, shape, _ in self.tensors())

    def config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": max(1, self.hidden // 64),
            "num_key_value_heads": max(1, self.hidden // 64),
            "vocab_size": self.vocab,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
        }


def shape_for_size(size_mb: float) -> ModelShape:
    """A Llama-like shape whose BF16 weights take about ``size_mb`` MiB."""
    target = max(1, int(size_mb * 2**20))
    hidden = 128 if target < 8 * 2**20 else 512 if target < 128 * 2**20 else 1024 if target < 2**30 else 2048
    intermediate = 64 * max(1, round(hidden * 8 / 3 / 64))
    vocab = 8 * hidden
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)
    layers = max(1, round((target - 2 * 2 * vocab * hidden) / per_layer))
    return ModelShape(hidden, intermediate, layers, vocab)


def _bf16_bytes(values: Any) -> np.ndarray:
    import torch  # noqa: PLC0415 - torch loads only for the synthetic optimizer step

    return values.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().reshape(-1)


def make_checkpoint_pair(
    base_dir: str | os.PathLike[str],
    new_dir: str | os.PathLike[str],
    *,
    size_mb: float = 512,
    seed: int = 0,
    lr: float = 1e-6,
    shards: int = 2,
) -> dict[str, Any]:
    """Write a BF16 base checkpoint and the checkpoint one Adam step later.

    Returns a summary: the shape, tensor bytes, and the fraction of elements that changed.
    """
    import torch  # noqa: PLC0415 - torch loads only for the synthetic optimizer step

    shape = shape_for_size(size_mb)
    gen = torch.Generator().manual_seed(seed)
    specs = shape.tensors()
    per_shard = math.ceil(len(specs) / max(1, shards))
    groups = [specs[i : i + per_shard] for i in range(0, len(specs), per_shard)]
    changed_elems = total_elems = 0
    base_path, new_path = Path(base_dir), Path(new_dir)
    for d in (base_path, new_path):
        d.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        shard = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        base_specs, new_specs = [], []
        for name, dims, kind in group:
            if kind == "norm":
                master = 1.0 + 0.01 * torch.randn(dims, generator=gen)
            else:
                master = (0.02 if kind == "matrix" else 0.01) * torch.randn(dims, generator=gen)
            grad = torch.randn(dims, generator=gen)
            # Adam's first step: m_hat / sqrt(v_hat) = g / |g|, so every weight moves by ~lr.
            # A second-moment history from earlier steps spreads the step sizes out a little.
            v_hist = 0.5 + torch.rand(dims, generator=gen)
            stepped = master - lr * grad / (grad.abs() * v_hist.sqrt() + 1e-8)
            old_bytes, new_bytes = _bf16_bytes(master), _bf16_bytes(stepped)
            changed_elems += int((old_bytes.view(np.uint16) != new_bytes.view(np.uint16)).sum())
            total_elems += math.prod(dims)
            base_specs.append(TensorSpec(name, "BF16", dims, old_bytes))
            new_specs.append(TensorSpec(name, "BF16", dims, new_bytes))
            weight_map[name] = shard
        write_safetensors(base_path / shard, base_specs, {"format": "pt"})
        write_safetensors(new_path / shard, new_specs, {"format": "pt"})
    index = {"metadata": {"total_size": shape.nbytes}, "weight_map": weight_map}
    for d in (base_path, new_path):
        (d / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        (d / "config.json").write_text(json.dumps(shape.config(), indent=2) + "\n")
    return {
        "shape": asdict(shape),
        "tensor_bytes": shape.nbytes,
        "tensors": len(specs),
        "changed_element_fraction": changed_elems / max(1, total_elems),
    }


__all__ = ["ModelShape", "make_checkpoint_pair", "shape_for_size"]
