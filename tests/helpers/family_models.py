"""vLLM's model classes of the model families RL labs train, on the small random checkpoints
`workers.families` writes, as an engine builds and loads them.

    python -m tests.helpers.family_models OUT_DIR BASE_MODEL_DIR [--tp N [--ep]] [--no-replay]
        [--skip-lm-head-rebuild] FAMILY [FAMILY ...]

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
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch

from common.processes import free_port
from replica.engine.files import read_safetensors
from workers.families import FAMILIES, write_family


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, read as the engine reads files."""
    return dict(read_safetensors(sorted(str(p) for p in model_dir.glob("*.safetensors")), None))


def observe(model_dirs: list[Path], world: int = 1, rank: int = 0, port: int = 0, ep: bool = False) -> dict[str, dict]:
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

    from replica.engine import cpu_gemm, cpu_moe, post_load, stage  # noqa: PLC0415
    from replica.engine.files import Checkpoint  # noqa: PLC0415
    from replica.engine.weight_map import WeightMap  # noqa: PLC0415

    cpu_gemm.install()
    cpu_moe.install()
    post_load.install()
    torch.accelerator.empty_cache = lambda: None  # no accelerator here (vLLM's CPU worker does the same)

    def engine_config(directory: Path):
        return EngineArgs(
            model=str(directory),
            enforce_eager=True,
            dtype="bfloat16",
            max_model_len=256,
            tensor_parallel_size=world,
            enable_expert_parallel=ep,
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
            # The replay's own cost (in a swap's repack_s) and its proof's (in a commit's verify_s).
            names = [n for n, _ in update]
            t0 = time.perf_counter()
            wmap.replay(names)
            t1 = time.perf_counter()
            wmap.underived(names)
            r["replay_s"], r["replay_proof_s"] = round(t1 - t0, 6), round(time.perf_counter() - t1, 6)
    return report


def layer_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer and plain tensor attribute of every layer (not ours), by qualified name."""
    out = {}
    for prefix, module in model.named_modules():
        for n, b in module._buffers.items():
            if b is not None:
                out[f"{prefix}.{n}"] = b
        for n, v in module.__dict__.items():
            if isinstance(v, torch.Tensor) and not n.startswith("_rollouts_"):
                out[f"{prefix}.{n}"] = v
    return out


def derived_differ(model: torch.nn.Module, fresh: torch.nn.Module) -> list[str]:
    ours, theirs = layer_tensors(model), layer_tensors(fresh)
    return sorted(
        n
        for n in ours.keys() | theirs.keys()
        if n not in ours or n not in theirs or ours[n].shape != theirs[n].shape or not torch.equal(ours[n], theirs[n])
    )


def kernels_differ(model: torch.nn.Module, fresh: torch.nn.Module) -> list[str]:
    """The layers whose packed CPU GEMM kernel (``cpu_linear``) answers a fixed random input
    other than the fresh model's layer of the same name, bit for bit."""
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
    world, ep = 1, False
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

        redispatch = cpu_gemm.redispatch
        cpu_gemm.redispatch = lambda m: None if type(m).__name__ == "ParallelLMHead" else redispatch(m)
        rest = rest[1:]
    unknown = [f for f in rest if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}: one of {sorted(FAMILIES)}")
    dirs = [write_family(out, base, family) for family in rest]
    for family in rest:
        write_family(out, base, family, seed=1)
    print(json.dumps(observe(dirs) if world == 1 else observe_ranks(dirs, world, out, ep)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
