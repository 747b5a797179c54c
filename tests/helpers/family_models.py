"""vLLM's model classes of the model families RL labs train, on the small random checkpoints
`workers.families` writes, as an engine builds and loads them.

    python -m tests.helpers.family_models OUT_DIR BASE_MODEL_DIR [--tp N [--ep]] [--no-replay]
        [--skip-lm-head-rebuild] [--platform-checks] FAMILY [FAMILY ...]

``observe`` (run in a process of its own: it imports vLLM and initialises its distributed
state) builds vLLM's model class for each checkpoint at tensor-parallel size 1 in this process,
as an engine does (``replica.engine.cpu_gemm`` and ``cpu_moe`` installed: what the loader wrote
is kept), loads the checkpoint, builds the engine's ``replica.engine.weight_map`` of it, writes a
second checkpoint of the family (another seed) through that map and compares every parameter
with a model loaded from that second checkpoint; it prints per family what it found, as JSON.
With ``--tp N`` it starts N rank processes over gloo (vLLM's CPU backend), each building its
shard of the model, and prints ``{family: {rank: report}}``; ``--ep`` with it: expert parallel
(vLLM's ``enable_expert_parallel``: each rank owns a share of the experts, whole). ``--no-replay``:
the map writes without replaying vLLM's loading and post-load processing (`post_load`), the premise
of the check that a write reaches what the engine computes with; ``--skip-lm-head-rebuild``: the
swap leaves a tied ``lm_head``'s packed kernel copy as it was (the premise of the kernels'
comparison and proof).

For an MoE family it also binds vLLM's routed-experts capturer to the model and runs each MoE
layer's router (:func:`routes`: the shape and zeros of ``routed_experts``), and where the experts
are used as the loader wrote them, writes one expert in place beside vLLM's load of it
(:func:`one_expert`). A family no CPU engine serves (`workers.families.CUDA_ONLY`: Nemotron-H's
non-gated ReLU² experts) is built with two of vLLM's platform checks lifted
(:func:`allow_non_gated_experts_on_cpu`) and the MoE kernel an H100 picks for it (Triton): its
building, loading, post-load processing and routing are vLLM's; no expert kernel runs.
``--platform-checks`` leaves those checks in place (vLLM then refuses to build it).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from common.processes import free_port
from replica.engine import post_load
from replica.engine.files import read_safetensors
from workers.families import CUDA_ONLY, FAMILIES, MOE, write_family

# Per family, what its engine is started with besides the defaults below: a family no CPU engine
# serves (`workers.families.CUDA_ONLY`) with the MoE kernel vLLM picks for it on an H100 (Triton).
ENGINE_ARGS: dict[str, dict[str, str]] = {"nemotron_h_moe": {"moe_backend": "triton"}}


def allow_non_gated_experts_on_cpu() -> None:
    """Let vLLM build (not run) non-gated fused experts (``is_act_and_mul=False``: Nemotron-H's
    ReLU² experts) on the CPU, as it builds them on a GPU, by lifting exactly two platform checks:
    ``FusedMoEConfig``'s (its last statement: the refusal is swallowed after everything else in
    it ran) and the Triton experts' device check (so vLLM's backend oracle picks Triton, its
    default for these experts on an H100). Every other part of building, loading and post-load
    processing is vLLM's own; nothing here runs an expert kernel. Gated experts are unaffected."""
    from vllm.model_executor.layers.fused_moe import config as moe_config  # noqa: PLC0415
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts  # noqa: PLC0415

    original = moe_config.FusedMoEConfig.__post_init__
    if getattr(original, "_rollouts_cpu", False):
        return

    def post_init(self) -> None:
        try:
            original(self)
        except NotImplementedError as exc:
            if "is_act_and_mul=False" not in str(exc):
                raise

    post_init._rollouts_cpu = True  # type: ignore[attr-defined]
    moe_config.FusedMoEConfig.__post_init__ = post_init  # type: ignore[method-assign]
    TritonExperts._supports_current_device = staticmethod(lambda: True)  # type: ignore[method-assign]


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read as the engine reads files."""
    return dict(read_safetensors(sorted(str(p) for p in model_dir.glob("*.safetensors")), None))


def observe(
    model_dirs: list[Path], world: int = 1, rank: int = 0, port: int = 0, ep: bool = False, lift: bool = True
) -> dict[str, dict]:
    """What ``weight_map`` makes of each checkpoint on vLLM's model class (see the docstring), on
    ``rank`` of ``world`` tensor-parallel ranks; then the checkpoint's ``-s1`` twin written
    through the map, compared with a model loaded from the twin."""
    # vLLM, only in this process of its own.
    from vllm.config import set_current_vllm_config  # noqa: PLC0415
    from vllm.distributed import (  # noqa: PLC0415
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs  # noqa: PLC0415
    from vllm.model_executor.model_loader import get_model  # noqa: PLC0415

    from replica.engine import cpu_gemm, cpu_moe, stage  # noqa: PLC0415
    from replica.engine.files import Checkpoint  # noqa: PLC0415
    from replica.engine.weight_map import WeightMap  # noqa: PLC0415

    cpu_gemm.install()
    cpu_moe.install()
    post_load.install()
    torch.accelerator.empty_cache = lambda: None  # no accelerator here (vLLM's CPU worker does the same)

    if lift and any(d.name in CUDA_ONLY for d in model_dirs):
        allow_non_gated_experts_on_cpu()

    def engine_config(directory: Path):
        return EngineArgs(
            model=str(directory),
            enforce_eager=True,
            dtype="bfloat16",
            max_model_len=256,
            tensor_parallel_size=world,
            enable_expert_parallel=ep,
            **ENGINE_ARGS.get(directory.name.removesuffix("-s1"), {}),
        ).create_engine_config()

    report: dict[str, dict] = {}
    for i, model_dir in enumerate(model_dirs):
        twin = model_dir.parent / f"{model_dir.name}-s1"

        config = engine_config(model_dir)
        with set_current_vllm_config(config):
            if i == 0:
                init_distributed_environment(
                    world_size=world,
                    rank=rank,
                    local_rank=rank,
                    backend="gloo",
                    distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}",
                )
            else:
                destroy_model_parallel()  # the groups follow the model's config (MoE: an expert group)
            initialize_model_parallel(world, 1)
            model = get_model(vllm_config=config)
        checkpoint = Checkpoint(model_dir)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        wmap = WeightMap.build(model, checkpoint.specs, checkpoint.read)
        changed = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
        r = report[model_dir.name] = {
            "tensors": len(checkpoint.specs),
            "landings": {
                n: [[ld.param, list(ld.dst.size), ld.dst.offset, list(ld.src.size), ld.src.offset] for ld in e.landings]
                for n, e in wmap.entries.items()
            },
            "refused": {n: e.refused for n, e in wmap.entries.items() if e.refused},
            "elsewhere": wmap.elsewhere(),
            "params_changed_by_observe": changed,
            "moe_layers_with_loader_copies": sum(1 for m in model.modules() if cpu_moe.loaded(m)),
        }
        if model_dir.name in MOE:
            r["routes"] = routes(model, config)
        if twin.exists():
            new = checkpoint_tensors(twin)
            update = [(n, new[n]) for n in wmap.names()]
            # The engine's swap (replica/engine/stage.py): swapped in, rolled back (every
            # parameter and derived tensor as before), then swapped in again and proven.
            start = {
                **{n: p.detach().clone() for n, p in model.named_parameters()},
                **{n: t.clone() for n, t in layer_tensors(model).items()},
            }
            staged = stage.take(wmap, "twin", update)
            stage.swap(wmap, staged)
            stage.roll_back(wmap, staged)
            now = {**dict(model.named_parameters()), **layer_tensors(model)}
            rolled_back_differ = sorted(
                n
                for n in start.keys() | now.keys()
                if n not in start or n not in now or not torch.equal(start[n], now[n].detach())
            )
            twin_config = engine_config(twin)
            with set_current_vllm_config(twin_config):
                fresh = get_model(vllm_config=twin_config)
            fresh_params = dict(fresh.named_parameters())
            staged = stage.take(wmap, "twin", update)
            swapped = stage.swap(wmap, staged)
            r["update"] = {  # as swapped in, before its proof
                "written": len(update),
                "not_held": [n for n, t in update if not wmap.holds(n, t)],
                "unpacked": wmap.unpacked(n for n, _ in update),
                # Every parameter, kernel layouts included, as vLLM's loader makes them from the twin.
                "params_differ_from_fresh": [
                    n for n, p in model.named_parameters() if not torch.equal(p.detach(), fresh_params[n].detach())
                ],
                # What the layers compute with besides parameters: buffers, and tensors vLLM's
                # post-load step keeps on a layer (a Mamba conv weight's unpacked copy, ...).
                "derived_differ_from_fresh": derived_differ(model, fresh),
                # What each linear layer's packed CPU kernel computes (a tied lm_head's own copy
                # of the embedding's weight included).
                "kernels_differ_from_fresh": kernels_differ(model, fresh),
                "rolled_back_differ": rolled_back_differ,
                # The swap's proof (stage.commit): rolls back what it cannot prove.
                "read_back_failed": stage.commit(wmap, staged).get("read_back_failed", []),
            }
            r["repack_s"] = swapped["repack_s"]  # the rebuild and replay inside the pause
            if r["moe_layers_with_loader_copies"] == 0 and any(".experts.3." in n for n in wmap.names()):
                r["one_expert"] = one_expert(wmap, model, fresh, checkpoint)
            # The replay's own cost (in a swap's repack_s) and its proof's (in a commit's verify_s).
            names = [n for n, _ in update]
            t0 = time.perf_counter()
            wmap.replay(names)
            t1 = time.perf_counter()
            wmap.underived(names)
            r["replay_s"], r["replay_proof_s"] = round(t1 - t0, 6), round(time.perf_counter() - t1, 6)
    return report


def one_expert(wmap, model: torch.nn.Module, fresh: torch.nn.Module, checkpoint) -> dict:
    """One expert's tensors (the first MoE layer's expert 3, the start checkpoint's values) written
    in place through the map into ``model`` (holding the twin), beside vLLM's own load of those
    tensors into ``fresh`` (a model loaded from the twin whose experts vLLM's kernel uses as its
    loader wrote them: no CPU prepack to load around). Which parameters (and which experts of
    them) the write changed, and what differs from vLLM's load after it."""
    from replica.engine import stage  # noqa: PLC0415

    layer = next(n for n in wmap.names() if ".experts.3." in n).partition(".experts.3.")[0]
    update = [(n, checkpoint.read(n)) for n in wmap.names() if n.startswith(f"{layer}.experts.3.")]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    staged = stage.take(wmap, "one-expert", update)
    stage.swap(wmap, staged)
    failed = stage.commit(wmap, staged).get("read_back_failed", [])
    fresh.load_weights(update)  # type: ignore[operator]  # vLLM's model class
    changed = {}
    for n, p in model.named_parameters():
        if not torch.equal(p.detach(), before[n]):
            rows = (p.detach() != before[n]).flatten(1).any(1) if p.dim() > 1 else None
            changed[n] = None if rows is None else rows.nonzero().flatten().tolist()
    fresh_params = dict(fresh.named_parameters())
    return {
        "names": [n for n, _ in update],
        "changed": changed,  # parameter -> the indices along its first (expert) dimension that changed
        "read_back_failed": failed,
        "params_differ_from_vllm_load": [
            n for n, p in model.named_parameters() if not torch.equal(p.detach(), fresh_params[n].detach())
        ],
        "derived_differ_from_vllm_load": derived_differ(model, fresh),
    }


def routes(model: torch.nn.Module, config, tokens: int = 5) -> dict:
    """vLLM's routed-experts capture on ``model``: its capturer (sized from the engine's config, as
    its workers size it) bound to the model's MoE routers, then each MoE layer's router run as its
    MoE runner runs it (``select_experts`` on the layer's gate logits of random hidden states).
    What the capturer then holds for ``tokens`` tokens (``[tokens, layers, top_k]``, the engine's
    ``routed_experts`` of them), beside each MoE layer's own top-k ids, by decoder layer."""
    from vllm.forward_context import set_forward_context  # noqa: PLC0415
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (  # noqa: PLC0415
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # noqa: PLC0415

    capturer = RoutedExpertsCapturer(max_num_batched_tokens=tokens, vllm_config=config)
    bind_routed_experts_capturer(model, capturer)
    gen = torch.Generator().manual_seed(0)
    routed: dict[int, list] = {}
    with set_forward_context(None, config), torch.no_grad():
        for block in model.modules():  # an MoE block: its gate (the router's logits) beside its runner
            runner = getattr(block, "experts", None)
            if not isinstance(runner, MoERunner):
                continue
            hidden = torch.randn(tokens, block.gate.weight.shape[1], generator=gen).to(block.gate.weight.dtype)
            logits, _ = block.gate(hidden)
            _, ids = runner.router.select_experts(
                hidden_states=hidden,
                router_logits=logits,
                topk_indices_dtype=runner._quant_method.topk_indices_dtype,
                input_ids=None,
            )
            routed[runner.layer_id] = ids.tolist()
    captured = capturer.snapshot_routing_data(tokens)
    return {
        "shape": list(captured.shape),
        "dtype": str(captured.dtype).removeprefix("torch."),
        "captured": captured.tolist(),
        "routed": routed,
    }


def layer_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer and plain tensor attribute of every layer (not ours), and of an attention
    layer's backend ``impl`` (AMX MLA's packed ``kv_b_proj``), by qualified name."""
    out = {}
    for prefix, module in model.named_modules():
        for n, b in module._buffers.items():
            if b is not None:
                out[f"{prefix}.{n}"] = b
        for n, v in module.__dict__.items():
            if isinstance(v, torch.Tensor) and not n.startswith("_rollouts_"):
                out[f"{prefix}.{n}"] = v
        if (impl := post_load.impl_of(module)) is not None:
            out.update((f"{prefix}.impl.{n}", v) for n, v in vars(impl).items() if isinstance(v, torch.Tensor))
    return out


def derived_differ(model: torch.nn.Module, fresh: torch.nn.Module) -> list[str]:
    ours, theirs = layer_tensors(model), layer_tensors(fresh)
    return sorted(
        n
        for n in ours.keys() | theirs.keys()
        if n not in ours or n not in theirs or ours[n].shape != theirs[n].shape or not torch.equal(ours[n], theirs[n])
    )


def kernel_kind(kernel: Any) -> Any:
    """Which kernel a layer's ``cpu_linear`` is: the dispatch's closure by its code (one per
    path: sgl, oneDNN, torch's fallback), or the function itself (torch's ``linear``)."""
    return getattr(kernel, "__code__", kernel)


def kernels_differ(model: torch.nn.Module, fresh: torch.nn.Module) -> list[str]:
    """The layers whose CPU GEMM kernel (``cpu_linear``) answers a fixed random input other than
    the fresh model's layer of the same name, bit for bit, or is another kind of kernel."""
    theirs = dict(fresh.named_modules())
    out = []
    for name, m in model.named_modules():
        weight = getattr(m, "weight", None)
        if not hasattr(m, "cpu_linear") or not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            continue
        x = torch.randn(4, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        other = theirs[name]
        with torch.no_grad():
            if not torch.equal(m.cpu_linear(x, m.weight, None), other.cpu_linear(x, other.weight, None)):
                out.append(name)
            elif kernel_kind(m.cpu_linear) is not kernel_kind(other.cpu_linear):
                out.append(name)  # the same bits here, from another kernel than vLLM's (torch's own linear)
    return out


def _rank(model_dirs: list[Path], world: int, rank: int, port: int, out: Path, ep: bool) -> None:
    out.write_text(json.dumps(observe(model_dirs, world, rank, port, ep)))


def observe_ranks(model_dirs: list[Path], world: int, scratch: Path, ep: bool = False) -> dict[str, dict[int, dict]]:
    """``observe`` on ``world`` rank processes; every rank's report per family."""
    port = free_port()
    os.environ["VLLM_DIST_IDENT"] = f"landings-{port}"  # vLLM's CPU communicator: one name for the group
    spawn = multiprocessing.get_context("spawn")
    ranks = [
        spawn.Process(target=_rank, args=(model_dirs, world, r, port, scratch / f"rank{r}.json", ep))
        for r in range(world)
    ]
    for proc in ranks:
        proc.start()
    for proc in ranks:
        proc.join()
    reports = [json.loads((scratch / f"rank{r}.json").read_text()) for r in range(world)]
    return {d.name: {r: reports[r][d.name] for r in range(world)} for d in model_dirs}


def main(argv: list[str]) -> int:
    out, base, rest = Path(argv[0]), Path(argv[1]), argv[2:]
    world, ep, lift = 1, False, True
    if rest[:1] == ["--tp"]:
        world, rest = int(rest[1]), rest[2:]
    if rest[:1] == ["--ep"]:
        ep, rest = True, rest[1:]
    if rest[:1] == ["--no-replay"]:  # the premise: without vLLM's processing replayed, a write is stale
        from replica.engine.weight_map import WeightMap  # noqa: PLC0415

        WeightMap.replay = lambda self, names: None  # type: ignore[method-assign]
        rest = rest[1:]
    if rest[:1] == ["--skip-lm-head-rebuild"]:  # the premise: a tied lm_head's packed copy left as it was
        from replica.engine import cpu_gemm  # noqa: PLC0415

        redispatch, put = cpu_gemm.redispatch, cpu_gemm.put
        cpu_gemm.redispatch = lambda m: None if type(m).__name__ == "ParallelLMHead" else redispatch(m)
        # (and its kernel derived at staging not put in: `kernel_copies`)
        cpu_gemm.put = lambda m, linear: None if type(m).__name__ == "ParallelLMHead" else put(m, linear)
        rest = rest[1:]
    if rest[:1] == ["--platform-checks"]:  # the premise: vLLM's CPU build refuses a CUDA_ONLY family
        lift, rest = False, rest[1:]
    unknown = [f for f in rest if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}: one of {sorted(FAMILIES)}")
    dirs = [write_family(out, base, family) for family in rest]
    for family in rest:
        write_family(out, base, family, seed=1)
    print(json.dumps(observe(dirs, lift=lift) if world == 1 else observe_ranks(dirs, world, out, ep)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
