"""The CPU kernels' copies derived at staging (replica/engine/kernel_copies.py) on vLLM's model
class of one MoE family, built and loaded in this process as an engine does.

    python -m tests.helpers.kernel_copies_model OUT_DIR BASE_MODEL_DIR FAMILY

Prints one JSON report (tests/replica/test_kernel_copies.py reads it): what a stage derives,
whether the swapped-in layers compute with kernels of what was written, what the proof makes of
a stale pack (and whether its roll-back is exact), an update covering one layer in part, a
budget that fits one layer, and whether oneDNN's kernel outlives the weight it was built from.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch

from common.processes import free_port
from tests.helpers.family_models import checkpoint_tensors, layer_tensors
from workers.families import write_family


def _probe(module: torch.nn.Module) -> torch.Tensor:
    weight = module.weight
    gen = torch.Generator().manual_seed(7)
    return torch.randn(3, weight.shape[1], generator=gen).to(weight.dtype)


def linear_outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each CPU linear layer's kernel output on a fixed probe (what it computes with)."""
    return {
        n: m.cpu_linear(_probe(m), m.weight, None).clone()
        for n, m in model.named_modules()
        if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None and m.weight.ndim == 2
    }


def kernels_of_what_is_held(model: torch.nn.Module) -> list[str]:
    """The linear layers whose kernel does not compute what one built now from the weight the
    engine holds computes (`cpu_gemm.prebuilt`, the same dispatch: bit for bit)."""
    from replica.engine import cpu_gemm  # noqa: PLC0415

    out = []
    for n, m in model.named_modules():
        if hasattr(m, "cpu_linear") and getattr(m, "weight", None) is not None and m.weight.ndim == 2:
            fresh = cpu_gemm.prebuilt(m, m.weight.data.clone())
            if not torch.equal(m.cpu_linear(_probe(m), m.weight, None), fresh(_probe(m), m.weight, None)):
                out.append(n)
    return out


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (packed experts included), loader-layout copy and layer tensor, and each
    linear kernel's output on a probe: what a roll-back must restore exactly."""
    from replica.engine import cpu_moe  # noqa: PLC0415

    out = {f"param:{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, m in model.named_modules():
        out.update({f"loaded:{n}.{a}": t.clone() for a, t in cpu_moe.loaded(m).items()})
    out.update({f"tensor:{n}": t.clone() for n, t in layer_tensors(model).items()})
    out.update({f"kernel:{n}": t for n, t in linear_outputs(model).items()})
    return out


def differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n]))


def onednn_outlives_its_weight() -> bool:
    """vLLM's CPU GEMM dispatch on a scratch weight that is then overwritten and freed: its
    kernel still computes with the values it was built from (it packed its own copy)."""
    from replica.engine import cpu_gemm  # noqa: PLC0415

    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(256, 128, generator=gen).to(torch.bfloat16)
    kept = weight.clone()
    holder = torch.nn.Module()
    holder.cpu_linear = None
    linear = cpu_gemm.prebuilt(holder, weight)
    weight.fill_(3.0)
    del weight
    gc.collect()
    xs = [torch.randn(m, 128, generator=gen).to(torch.bfloat16) for m in (1, 5, 64)]
    fresh = cpu_gemm.prebuilt(holder, kept)
    return all(torch.equal(linear(x, kept, None), fresh(x, kept, None)) for x in xs)


def run(out: Path, base: Path, family: str) -> dict:
    from vllm.config import set_current_vllm_config  # noqa: PLC0415
    from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: PLC0415
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415
    from vllm.model_executor.model_loader import get_model  # noqa: PLC0415

    from replica.engine import cpu_gemm, cpu_moe, post_load, stage  # noqa: PLC0415
    from replica.engine.files import Checkpoint  # noqa: PLC0415
    from replica.engine.tensors import adler32_hex  # noqa: PLC0415
    from replica.engine.weight_map import WeightMap  # noqa: PLC0415

    cpu_gemm.install()
    cpu_moe.install()
    post_load.install()
    torch.accelerator.empty_cache = lambda: None
    model_dir, twin = write_family(out, base, family), write_family(out, base, family, seed=1)
    config = EngineArgs(model=str(model_dir), enforce_eager=True, dtype="bfloat16", max_model_len=256)
    config = config.create_engine_config()
    with set_current_vllm_config(config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(1, 1)
        model = get_model(vllm_config=config)
    with Checkpoint(model_dir) as checkpoint:
        wmap = WeightMap.build(model, checkpoint.specs, checkpoint.read)
    names = wmap.names()
    old, new = checkpoint_tensors(model_dir), checkpoint_tensors(twin)
    moe = {n: m for n, m in model.named_modules() if cpu_moe.loaded(m)}
    report: dict = {"moe_layers": len(moe), "onednn_outlives_its_weight": onednn_outlives_its_weight()}

    def swap_and_commit(update: list[tuple[str, torch.Tensor]]) -> tuple[dict, dict]:
        """(what the stage derived: layers, partial images; the commit's answer)."""
        staged = stage.take(wmap, "u", update, None, {n: adler32_hex(t) for n, t in update}, checked=True)
        layers = staged.kernels.layers if staged.kernels else []
        derived = {"layers": len(layers), "partial": sum(len(layer.partial) for layer in layers)}
        stage.swap(wmap, staged)
        return derived, stage.commit(wmap, staged)

    # Every tensor: every MoE and linear layer derived at staging, and computing with it.
    update = [(n, new[n]) for n in names]
    staged = stage.take(wmap, "twin", update, None, {n: adler32_hex(t) for n, t in update}, checked=True)
    kernels = staged.kernels
    report["derived"] = {
        "moe": sum(1 for layer in kernels.layers if layer.packed) if kernels else 0,
        "linear": sum(1 for layer in kernels.layers if layer.linear is not None) if kernels else 0,
        "partial": sum(len(layer.partial) for layer in kernels.layers) if kernels else 0,
    }
    stage.swap(wmap, staged)
    report["every_tensor"] = {
        "unpacked": wmap.unpacked(names),  # vLLM's prepack of what the loader copies hold, done again
        "kernels_not_of_what_is_held": kernels_of_what_is_held(model),
        "result": sorted(stage.commit(wmap, staged)),
        "kernels_kept_after_proof": staged.kernels is not None,
    }

    # A stale pack in the stage (the pack of the values served now): refused, rolled back exactly.
    start = state(model)
    back = [(n, old[n]) for n in names]
    staged = stage.take(wmap, "stale", back, None, {n: adler32_hex(t) for n, t in back}, checked=True)
    first = next(layer for layer in staged.kernels.layers if layer.packed)
    first.packed["w2_weight"] = first.module.w2_weight.detach().clone()
    in_layer = sorted(n for n in names if any(m is first.module for m in wmap.layers([n])))
    stage.swap(wmap, staged)
    result = stage.commit(wmap, staged)
    report["stale_pack"] = {
        "read_back_failed_is_the_layer": sorted(result.get("read_back_failed", [])) == in_layer and bool(in_layer),
        "rolled_back": result.get("rolled_back", False),
        "differs_from_before": differ(start, state(model)),
    }

    # One layer's experts in part: that layer's image compared in the proof, its pack correct.
    layer = next(iter(moe.values()))
    few = [(n, old[n]) for n in names if any(m is layer for m in wmap.layers([n]))][:2]
    derived, result = swap_and_commit(few)
    report["part_of_a_layer"] = {
        "written": len(few),
        "partial_images": derived["partial"],
        "verified": result.get("verified"),
        "unpacked": wmap.unpacked(names),
    }

    # A budget that fits one MoE layer: the rest re-derived in the pause, all proven.
    one = sum(t.numel() * t.element_size() for t in cpu_moe.loaded(layer).values())
    os.environ["ROLLOUTS_STAGE_KERNEL_BYTES"] = str(one)

    def under_budget(tensors: list) -> dict:
        derived, result = swap_and_commit(tensors)
        return {
            "derived": derived["layers"],
            "verified": result.get("verified") == len(names),
            "unpacked": wmap.unpacked(names),
            "kernels_not_of_what_is_held": kernels_of_what_is_held(model),
        }

    report["budget_of_one_layer"] = under_budget(back)
    os.environ["ROLLOUTS_STAGE_KERNEL_BYTES"] = "0"
    report["budget_of_zero"] = under_budget(update)
    return report


def main(argv: list[str]) -> int:
    print(json.dumps(run(Path(argv[0]), Path(argv[1]), argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
