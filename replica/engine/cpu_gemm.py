"""CPU engines keep their linear weights as parameters, so an update can change them in place.

vLLM's CPU backend repacks every linear weight into a kernel-private copy and empties the
parameter (``remove_weight=True``), which breaks ``load_weights`` and in-place updates.
:func:`install` (on importing ``replica.engine.extension`` in a vLLM process, before the model
loads) keeps the parameter; :func:`redispatch` rebuilds a changed layer's packed copy from it.
Cost: linear weights held twice in CPU memory. GPU platforms and processes without vLLM are
left alone.
"""

from __future__ import annotations

import torch


def install() -> None:
    """Patch vLLM's CPU GEMM dispatch to keep each linear layer's weight (idempotent)."""
    try:
        # vLLM only inside its own processes: importing it elsewhere would start its platform.
        from vllm.model_executor.layers import utils as layer_utils  # noqa: PLC0415 - vLLM processes only
        from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM processes only
    except Exception:  # pragma: no cover - vLLM absent: nothing to patch
        return
    if not current_platform.is_cpu():
        return
    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_rollouts_keeps_weight", False):
        return

    def dispatch_keeping_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        # vLLM's linear.py / vocab_parallel_embedding.py import this name at call time, so
        # replacing the module attribute reaches every layer loaded after this import.
        original(layer, remove_weight=False)

    dispatch_keeping_weight._rollouts_keeps_weight = True  # type: ignore[attr-defined]
    dispatch_keeping_weight._rollouts_original = original  # type: ignore[attr-defined]
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight


def redispatch(module: torch.nn.Module) -> None:
    """Rebuild a CPU layer's packed kernel copy from its (just updated) weight parameter."""
    if not hasattr(module, "cpu_linear"):
        return
    # A layer with a packed CPU copy exists only in a vLLM process: vLLM is loaded.
    from vllm.model_executor.layers import utils as layer_utils  # noqa: PLC0415 - vLLM processes only

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    dispatch = getattr(dispatch, "_rollouts_original", dispatch)
    dispatch(module, remove_weight=False)
