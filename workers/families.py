"""Small random checkpoints of the model families RL labs train, written locally with
``transformers`` (no model hub), BF16, as ``save_pretrained`` lays them out (per-expert tensors
for MoE, q/k/v and gate/up shipped fused for Phi-3) in the shards and index of
`workers.base_model.write_tensors`, with
the embedded stack's tokenizer (`workers.base_model`). The demo's ``--model qwen3-moe`` and the
family tests use them.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import transformers as T
from safetensors.torch import load_file

from workers.base_model import write_tensors

HIDDEN, INTERMEDIATE, LAYERS = 128, 256, 2
VOCAB = 2048  # the embedded stack's tokenizer's (workers.base_model)
_COMMON = dict(
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
    num_hidden_layers=LAYERS,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    vocab_size=VOCAB,
    max_position_embeddings=4096,
)
# family -> (config class, model class, what differs from _COMMON)
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3_moe": (
        T.Qwen3MoeConfig,
        T.Qwen3MoeForCausalLM,
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1},
    ),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, {"pad_token_id": 0, "head_dim": None}),  # ships qkv/gate_up fused
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, {}),
    # DeepSeek-V3 style: multi-head latent attention, a dense first layer, then routed experts
    # (grouped top-k with a score-correction bias) beside a shared expert. vLLM's CPU MLA decode
    # kernel takes DeepSeek-V3's latent width only (kv_lora_rank 512 + qk_rope_head_dim 64).
    "deepseek_v3": (
        T.DeepseekV3Config,
        T.DeepseekV3ForCausalLM,
        {
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "q_lora_rank": 64,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 64,
            "v_head_dim": 64,
            "num_key_value_heads": 2,
            "head_dim": None,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        },
    ),  # as DeepSeek-V3 ships its config
    # Nemotron-H, as Nemotron Nano 2 lays it out: Mamba-2 mixers ("M"), ReLU² MLPs ("-") and
    # attention ("*") as separate decoder layers. vLLM computes on A = -exp(A_log) (float32) and
    # a reshaped conv1d weight: each layer's post-load processing is replayed after a write
    # (replica/engine/post_load.py).
    "nemotron_h": (
        T.NemotronHConfig,
        T.NemotronHForCausalLM,
        {
            "num_hidden_layers": None,
            "layers_block_type": ["mamba", "mlp", "attention", "mlp"],
            "mamba_num_heads": 4,
            "mamba_head_dim": 64,
            "n_groups": 2,
            "ssm_state_size": 16,
            "chunk_size": 64,
        },
    ),
    # Its MoE variant, as NVIDIA's Nemotron 3 Nano lays it out: Mamba-2 ("M"), MoE ("E") and
    # attention ("*") decoder layers; each MoE layer routes to non-gated ReLU² experts (an up and a
    # down projection each, no gate) by a sigmoid router with a score-correction bias, beside a
    # shared expert. vLLM's CPU build refuses its experts (``is_act_and_mul=False is supported
    # only for CUDA, XPU and ROCm``): no CPU engine serves it (CUDA_ONLY).
    "nemotron_h_moe": (
        T.NemotronHConfig,
        T.NemotronHForCausalLM,
        {
            "num_hidden_layers": None,
            "layers_block_type": ["mamba", "moe", "attention", "moe"],
            "mamba_num_heads": 4,
            "mamba_head_dim": 64,
            "n_groups": 2,
            "ssm_state_size": 16,
            "chunk_size": 64,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 64,
            "moe_shared_expert_intermediate_size": 64,
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
        },
    ),
}
MOE = ("qwen3_moe", "mixtral", "deepseek_v3", "nemotron_h_moe")  # the families with routed experts
# Families no CPU engine serves (vLLM's CPU build refuses their layers): tested on vLLM's model
# classes without an engine (tests/helpers/family_models.py), not end to end.
CUDA_ONLY = ("nemotron_h_moe",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_family(out: Path, base_model: Path, family: str, seed: int = 0) -> Path:
    """Write ``family``'s checkpoint (random weights from ``seed``) to ``out/family`` (seed 0) or
    ``out/family-sN`` (once; every tensor differs from seed 0's); returns the directory."""
    target = out / (family if seed == 0 else f"{family}-s{seed}")
    if (target / "config.json").exists():
        return target
    config_cls, model_cls, extra = FAMILIES[family]
    kwargs = {k: v for k, v in {**_COMMON, **extra}.items() if v is not None}
    torch.manual_seed(seed)
    with tempfile.TemporaryDirectory(prefix="family-") as tmp:
        model = model_cls(config_cls(**kwargs))
        if seed:  # tensors transformers initialises to constants (norms, Mamba's A_log and D) differ too
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p), alpha=0.01)
        model.to(torch.bfloat16).save_pretrained(tmp)
        # Names as save_pretrained writes them; shards and index as a trainer's sharded export
        # (workers.base_model's layout, which the demo's trainer writes back).
        target.mkdir(parents=True, exist_ok=True)
        write_tensors(target, load_file(str(Path(tmp) / "model.safetensors")))
        for side in ("config.json", "generation_config.json"):
            if (Path(tmp) / side).exists():
                shutil.copy2(Path(tmp) / side, target / side)
    for name in TOKENIZER_FILES:
        (target / name).write_bytes((base_model / name).read_bytes())
    return target
