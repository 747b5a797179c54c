"""Benchmark: engine start and hot-loads at real MoE tensor counts.

Qwen3-MoE checkpoints at tiny widths with Qwen3-30B-A3B's tensor count (48 layers x 128 experts:
18,867 tensors) and Kimi-K2's order (61 x 384: about 70,800), written as one safetensors file
(what ``save_pretrained`` writes under its shard size) or as a trainer's sharded export, beside
the 3-layer, 6-expert model.

``--phases``: in this process, vLLM's model class built and loaded from the checkpoint (vLLM's own
load), then the engine's weight map of it phase by phase (headers, observe, prove), and an
every-tensor delta (1 % of each tensor's elements, as an optimizer step) staged, swapped,
proven and rolled back through the engine's own stage code: seconds and per-tensor cost of
each phase.

``--stack``: the real embedded stack (Temporal, SeaweedFS, API, control worker, the node agent)
with a 2-replica deployment of each checkpoint, one after the other: vLLM's own start of the
checkpoint (`EngineProcess`, our server with no weight map yet) against create -> READY, then a
FULL hot-load of the same checkpoint and the every-tensor delta, create -> COMPLETED through the
REST API, with the replicas' largest pause.

    .venv/bin/python bench/tensor_count.py --layouts 3x6,48x128,48x128-sharded
    .venv/bin/python bench/tensor_count.py --stack --layouts 3x6,48x128,48x128-sharded
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from workers.base_model import VOCAB, write_base_model  # noqa: E402

HIDDEN, MOE_INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 64, 32, 2, 1, 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def moe_config(layers: int, experts: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * MOE_INTERMEDIATE,
        "moe_intermediate_size": MOE_INTERMEDIATE,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_experts": experts,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "mlp_only_layers": [],
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def moe_tensors(layers: int, experts: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, named as ``save_pretrained`` names Qwen3-MoE's: 9 + 3 x
    experts per layer, plus the embedding, the final norm and the head."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {"model.embed_tokens.weight": normal(VOCAB, HIDDEN)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = ones(HIDDEN)
        t[p + "self_attn.q_proj.weight"] = normal(q, HIDDEN)
        t[p + "self_attn.k_proj.weight"] = normal(kv, HIDDEN)
        t[p + "self_attn.v_proj.weight"] = normal(kv, HIDDEN)
        t[p + "self_attn.o_proj.weight"] = normal(HIDDEN, q)
        t[p + "self_attn.q_norm.weight"] = ones(HEAD_DIM)
        t[p + "self_attn.k_norm.weight"] = ones(HEAD_DIM)
        t[p + "post_attention_layernorm.weight"] = ones(HIDDEN)
        t[p + "mlp.gate.weight"] = normal(experts, HIDDEN)
        for j in range(experts):
            e = f"{p}mlp.experts.{j}."
            t[e + "gate_proj.weight"] = normal(MOE_INTERMEDIATE, HIDDEN)
            t[e + "up_proj.weight"] = normal(MOE_INTERMEDIATE, HIDDEN)
            t[e + "down_proj.weight"] = normal(HIDDEN, MOE_INTERMEDIATE)
    t["model.norm.weight"] = ones(HIDDEN)
    t["lm_head.weight"] = normal(VOCAB, HIDDEN)
    return t


def write_moe(out: Path, base_model: Path, layers: int, experts: int, shards: int = 1) -> Path:
    """The checkpoint in ``out`` (kept if already there): config, the base model's tokenizer, its
    tensors in ``shards`` files (HF's names and index when more than one)."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tensors = moe_tensors(layers, experts)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        per = math.ceil(len(names) / shards)
        weight_map = {}
        for i in range(shards):
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            group = names[i * per : (i + 1) * per]
            save_file({n: tensors[n] for n in group}, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in group})
        total = sum(t.nbytes for t in tensors.values())
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
    for name in TOKENIZER_FILES:
        (out / name).write_bytes((base_model / name).read_bytes())
    (out / "config.json").write_text(json.dumps(moe_config(layers, experts), indent=2))
    return out


def _timed(module, attr: str, seconds: dict[str, float], key: str) -> None:
    """Wrap ``module.attr`` so that each call adds its seconds to ``seconds[key]``."""
    real = getattr(module, attr)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0

    setattr(module, attr, wrapper)


def one_percent(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """``t`` with 1 % of its elements (at least one) changed, as an optimizer step changes them."""
    out = t.clone()
    flat = out.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=gen)
    flat[idx] = (flat[idx].float() + 0.01).to(flat.dtype)
    return out


def phases(model_dir: Path) -> dict:
    """vLLM's own build and load of ``model_dir`` in this process, then the weight map's phases
    and an every-tensor delta through the engine's stage code (module docstring)."""
    from vllm.config import set_current_vllm_config  # noqa: PLC0415 - vLLM only here
    from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415
    from vllm.model_executor.model_loader import get_model  # noqa: PLC0415

    from common.processes import free_port  # noqa: PLC0415
    from replica.engine import cpu_gemm, cpu_moe, weight_map  # noqa: PLC0415
    from replica.engine import stage as stages  # noqa: PLC0415
    from replica.engine.files import Checkpoint  # noqa: PLC0415
    from replica.engine.tensors import adler32_hex  # noqa: PLC0415

    cpu_gemm.install()
    cpu_moe.install()
    torch.accelerator.empty_cache = lambda: None
    out: dict = {}
    t0 = time.perf_counter()
    config = EngineArgs(
        model=str(model_dir), enforce_eager=True, dtype="bfloat16", max_model_len=256
    ).create_engine_config()
    out["vllm_config_s"] = time.perf_counter() - t0
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{free_port()}"
        )
        initialize_model_parallel(1, 1)
        t0 = time.perf_counter()
        model = get_model(vllm_config=config)
    out["vllm_build_and_load_s"] = time.perf_counter() - t0

    seconds: dict[str, float] = {}
    _timed(weight_map, "observe", seconds, "observe_s")
    _timed(weight_map, "unproven", seconds, "prove_s")
    t0 = time.perf_counter()
    with Checkpoint(model_dir) as checkpoint:
        out["headers_s"] = time.perf_counter() - t0
        out["tensors"] = len(checkpoint.specs)
        wmap = weight_map.WeightMap.build(model, checkpoint.specs, checkpoint.read)
    out["map_s"] = time.perf_counter() - t0
    gc.collect()  # as the engine does once its map is built (replica/engine/extension.py `_freeze_heap`)
    gc.freeze()
    out.update(seconds)
    out["held"] = len(wmap.names())
    # What the proof's reads cost with an open per tensor (the code before): a sample of 200.
    from safetensors import safe_open  # noqa: PLC0415

    sample = checkpoint.specs[:: max(1, len(checkpoint.specs) // 200)][:200]
    t0 = time.perf_counter()
    for name, _, _ in sample:
        with safe_open(checkpoint.files[name], framework="pt", device="cpu") as f:
            f.get_tensor(name)
    out["open_per_tensor_ms"] = (time.perf_counter() - t0) / len(sample) * 1e3

    gen = torch.Generator().manual_seed(1)
    names = wmap.names()
    t0 = time.perf_counter()
    update = [(n, one_percent(wmap.held(n), gen)) for n in names]
    expected = {n: adler32_hex(t) for n, t in update}
    out["delta_make_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    staged = stages.take(wmap, "delta", update, None, expected, checked=True, sparse=True)
    out["stage_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    swap = stages.swap(wmap, staged)
    out["swap_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    commit = stages.commit(wmap, staged)
    out["proof_s"] = time.perf_counter() - t0
    out["pause_s"] = out["swap_s"] + out["proof_s"]
    out["verified"] = commit.get("verified", 0)
    out["swap_report"] = {k: v for k, v in swap.items() if not isinstance(v, dict)}
    t0 = time.perf_counter()
    stages.roll_back(wmap, staged)
    out["roll_back_s"] = time.perf_counter() - t0
    return out


LAYOUTS = {  # name -> (layers, experts, shards)
    "3x6": (3, 6, 1),
    "48x128": (48, 128, 1),
    "48x128-sharded": (48, 128, 8),
    "61x384": (61, 384, 1),
    "61x384-sharded": (61, 384, 16),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("/tmp/rollouts-tensor-count"))
    parser.add_argument("--layouts", default="3x6,48x128,48x128-sharded")
    parser.add_argument("--phases-of", help="(internal) run the phases of one checkpoint, print JSON")
    parser.add_argument("--stack", action="store_true", help="the 2-replica stack run (module docstring)")
    parser.add_argument("--keep", action="store_true", help="(--stack) keep the stack's home and logs; print where")
    parser.add_argument("--no-own-start", action="store_true", help="(--stack) skip vLLM's own start of each")
    args = parser.parse_args()
    if args.phases_of:
        print("PHASES " + json.dumps(phases(Path(args.phases_of))), flush=True)
        return 0
    base = args.root / "base"
    if not (base / "tokenizer.json").exists():
        write_base_model(base)
    if args.stack:
        from tensor_count_stack import run_stack  # noqa: PLC0415 - (bench/, beside this file) the stack's imports

        dirs = {name: write_moe(args.root / name, base, *LAYOUTS[name]) for name in args.layouts.split(",")}
        run_stack(dirs, args.root, one_percent, keep=args.keep, own_start=not args.no_own_start)
        return 0
    rows = {}
    for name in args.layouts.split(","):
        layers, experts, shards = LAYOUTS[name]
        model_dir = write_moe(args.root / name, base, layers, experts, shards)
        proc = subprocess.run(
            [sys.executable, __file__, "--phases-of", str(model_dir)], capture_output=True, text=True, cwd=REPO
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PHASES ")), None)
        if line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit(f"{name}: no result")
        rows[name] = json.loads(line[len("PHASES ") :])
        print(name, json.dumps(rows[name]), flush=True)
    print_table(rows)
    return 0


def print_table(rows: dict[str, dict]) -> None:
    keys = [
        ("tensors", "tensors", "{:.0f}"),
        ("vllm_build_and_load_s", "vLLM build+load s", "{:.2f}"),
        ("headers_s", "headers s", "{:.3f}"),
        ("observe_s", "observe s", "{:.2f}"),
        ("prove_s", "prove s", "{:.2f}"),
        ("map_s", "map total s", "{:.2f}"),
        ("open_per_tensor_ms", "an open per tensor ms", "{:.2f}"),
        ("stage_s", "delta stage s", "{:.2f}"),
        ("swap_s", "swap s", "{:.3f}"),
        ("proof_s", "proof s", "{:.3f}"),
        ("pause_s", "pause s", "{:.3f}"),
        ("roll_back_s", "roll-back s", "{:.3f}"),
    ]
    print("| " + " | ".join(["phase"] + list(rows)) + " |")
    print("|" + "---|" * (len(rows) + 1))
    for key, label, fmt in keys:
        print("| " + " | ".join([label] + [fmt.format(r.get(key, float("nan"))) for r in rows.values()]) + " |")
    print(
        "| per tensor (us): observe / prove / swap / proof | "
        + " | ".join(
            " / ".join(f"{r.get(k, 0) / r['tensors'] * 1e6:.0f}" for k in ("observe_s", "prove_s", "swap_s", "proof_s"))
            for r in rows.values()
        )
        + " |"
    )


if __name__ == "__main__":
    sys.exit(main())
