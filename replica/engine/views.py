"""Checkpoint names mapped to views of the engine's parameters, and what may load in place.

Every tensor is named as in the HF checkpoint (``model.layers.0.self_attn.q_proj.weight``), not
as vLLM stores it (``...qkv_proj.weight``, fused). A checkpoint name maps to a *view* of the
engine's parameter: the rows of a fused ``qkv_proj`` / ``gate_up_proj`` belonging to
``q``/``k``/``v`` or ``gate``/``up`` (from the model's ``packed_modules_mapping`` and the layer's
``output_sizes``), and the unpadded rows of a vocab embedding. That holds for unquantized models
at tensor-parallel size 1 whose vLLM module names equal the checkpoint's (the Llama family);
parameters that cannot be mapped are reported under their engine names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from replica.engine.tensors import dtype_to_str


@dataclass
class View:
    name: str  # checkpoint name
    engine_name: str  # the vLLM parameter it lives in
    module: torch.nn.Module  # the layer owning that parameter
    tensor: torch.Tensor  # a view into the parameter's storage


def checkpoint_views(model: torch.nn.Module) -> tuple[dict[str, View], dict[str, torch.Tensor]]:
    """(views by checkpoint name, engine parameters that could not be mapped)."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    modules = dict(model.named_modules())
    views: dict[str, View] = {}
    unmapped: dict[str, torch.Tensor] = {}
    for engine_name, param in model.named_parameters():
        mod_name, _, attr = engine_name.rpartition(".")
        module = modules[mod_name]
        parent, _, leaf = mod_name.rpartition(".")
        tp = int(getattr(module, "tp_size", 1) or 1)
        data = param.data
        if data.numel() == 0 and data.dim() == 1:
            # A CPU layer whose weight vLLM dropped (`cpu_gemm` not installed): nothing to read.
            unmapped[engine_name] = data
            continue
        subs = packed.get(leaf)
        sizes = getattr(module, "output_sizes", None)
        if subs and sizes is not None and len(subs) == len(sizes) and tp == 1:
            dim = int(getattr(param, "output_dim", 0) or 0)
            if sum(sizes) == data.shape[dim]:
                off = 0
                for sub, size in zip(subs, sizes):
                    ck = f"{parent}.{sub}.{attr}" if parent else f"{sub}.{attr}"
                    views[ck] = View(ck, engine_name, module, data.narrow(dim, off, size))
                    off += size
                continue
        if subs:
            unmapped[engine_name] = data
            continue
        org = getattr(module, "org_vocab_size", None)
        if org is not None and tp == 1 and data.dim() >= 1 and data.shape[0] > org:
            data = data[:org]  # vocab padding rows are not in the checkpoint
        views[engine_name] = View(engine_name, engine_name, module, data)
    return views, unmapped


def select_views(model: torch.nn.Module, names: Sequence[str] | None) -> list[tuple[str, torch.Tensor]]:
    """``(name, view)`` for ``names`` in that order (every mapped tensor when None)."""
    views, _ = checkpoint_views(model)
    order = list(views) if names is None else list(names)
    missing = [n for n in order if n not in views]
    if missing:
        raise ValueError(f"no such tensor(s) in the engine: {missing[:8]}")
    return [(n, views[n].tensor) for n in order]


def check_loadable(model: torch.nn.Module, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, View]:
    """Refuse (ValueError, naming each tensor) what cannot load in place byte for byte: unknown
    names, duplicates, a shape or a dtype other than the engine parameter's (a conversion would
    serve bytes other than the snapshot's). Returns the engine's views by checkpoint name."""
    views, _ = checkpoint_views(model)
    problems = []
    seen: set[str] = set()
    for name, t in tensors:
        v = views.get(name)
        if name in seen:
            problems.append(f"{name}: given twice")
        elif v is None:
            problems.append(f"{name}: no such tensor in the engine")
        elif tuple(t.shape) != tuple(v.tensor.shape):
            problems.append(f"{name}: shape {tuple(t.shape)} != engine {tuple(v.tensor.shape)}")
        elif t.dtype != v.tensor.dtype:
            problems.append(f"{name}: dtype {dtype_to_str(t.dtype)} != engine {dtype_to_str(v.tensor.dtype)}")
        seen.add(name)
    if problems:
        raise ValueError(f"refusing to load ({len(problems)} problem(s)): " + "; ".join(problems[:8]))
    return views
