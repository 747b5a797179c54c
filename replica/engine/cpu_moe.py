"""CPU engines keep each fused-MoE layer's experts as the loader wrote them, so an update can change them.

vLLM's CPU MoE kernel pads and prepacks ``w13_weight`` / ``w2_weight`` after loading, replacing
both parameters. :func:`install` (before the model loads) keeps a loader-layout copy of both
first (:func:`loaded`); an update writes there, :func:`rebuild` reruns vLLM's own padding and
prepack on a scratch module and puts the result in (:func:`put`), and :func:`packed_from_loaded`
proves the kernel's weights are the prepack of the copies. A stage derives the prepack before
the pause instead (:func:`pack` of the image the write will produce, `kernel_copies`), and the
pause only puts it in (:func:`put`). Cost: expert weights held twice in CPU memory. GPU
platforms, zentorch kernels and processes without vLLM are left alone.
"""

from __future__ import annotations

from typing import Any

import torch

_LOADED = "_rollouts_loaded"  # layer.__dict__ key: {"w13_weight": tensor, "w2_weight": tensor}
_EXPERTS = "_rollouts_experts"  # layer.__dict__ key: the kernel object that packed them
_WEIGHTS = ("w13_weight", "w2_weight")
_ORIGINAL: Any = None


def install() -> None:
    """Patch vLLM's CPU MoE post-load step to keep the loader's layout (idempotent)."""
    global _ORIGINAL
    try:
        # vLLM only inside its own processes: importing it elsewhere would start its platform.
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (  # noqa: PLC0415 - vLLM processes only
            CPUUnquantizedExperts,
        )
        from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM processes only
    except Exception:  # pragma: no cover - vLLM absent (or another version): nothing to patch
        return
    if not current_platform.is_cpu():
        return
    original = CPUUnquantizedExperts.process_weights_after_loading
    if getattr(original, "_rollouts_keeps_loaded", False):
        return

    def keep_loaded(self: Any, layer: torch.nn.Module) -> None:
        loaded = {n: getattr(layer, n).detach().clone() for n in _WEIGHTS}
        original(self, layer)
        if not getattr(self, "_use_zentorch", False) and not hasattr(layer, "w13_bias"):
            # Plain attributes, not registered: vLLM must not see a second set of parameters.
            layer.__dict__[_LOADED] = loaded
            layer.__dict__[_EXPERTS] = self

    keep_loaded._rollouts_keeps_loaded = True  # type: ignore[attr-defined]
    _ORIGINAL = original
    CPUUnquantizedExperts.process_weights_after_loading = keep_loaded  # type: ignore[method-assign]


def loaded(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The loader-layout copies of a CPU MoE layer's expert weights (empty for any other module)."""
    copies: dict[str, torch.Tensor] = module.__dict__.get(_LOADED, {})
    return copies


def pack(module: torch.nn.Module, copies: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM's padding and prepack, for the CPU MoE layer ``module``, of loader-layout tensors
    ``copies`` (its own, or an image of them), on a scratch module: ``copies`` are only read."""
    scratch = torch.nn.Module()
    for name, t in copies.items():
        # No copy: vLLM's step reads the loader's tensors and replaces the scratch's parameters with new ones.
        scratch.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    _ORIGINAL(module.__dict__[_EXPERTS], scratch)
    return {name: getattr(scratch, name).detach() for name in _WEIGHTS}


def _packed(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """vLLM's padding and prepack of the module's loader-layout copies, on a scratch module."""
    return pack(module, loaded(module))


def put(module: torch.nn.Module, packed: dict[str, torch.Tensor]) -> None:
    """Make a prepack (:func:`pack`: new tensors, never a view of the loader's copies) the
    layer's kernel weights: each parameter takes the pack's storage, no copy (the kernel reads
    the parameters at every forward; the old pack is freed). A pack of another layout is copied."""
    for name, t in packed.items():
        param = getattr(module, name)
        if (t.shape, t.stride(), t.dtype, t.device) == (param.shape, param.stride(), param.dtype, param.device):
            param.data = t
        else:
            param.data.copy_(t)


def rebuild(module: torch.nn.Module) -> None:
    """Re-pack a CPU MoE layer's kernel weights from its loader-layout copies, in place."""
    if not loaded(module):
        return
    put(module, _packed(module))


def packed_from_loaded(module: torch.nn.Module) -> bool:
    """Whether the layer's kernel weights are exactly the prepack of its loader-layout copies."""
    if not loaded(module):
        return True
    return all(torch.equal(getattr(module, n).detach(), t) for n, t in _packed(module).items())
