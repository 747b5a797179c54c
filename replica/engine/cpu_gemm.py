"""CPU engines keep their linear weights as parameters, so an update can change them in place.

vLLM's CPU backend repacks every linear weight into a kernel-private copy and empties the
parameter (``remove_weight=True``), which breaks ``load_weights`` and in-place updates.
:func:`install` (on importing ``replica.engine.extension`` in a vLLM process, before the model
loads) keeps the parameter; :func:`redispatch` rebuilds a changed layer's packed copy from it
(`weight_map` calls it for every module holding the weight: a tied ``lm_head`` packs the
embedding's weight for itself). :func:`stale` is the proof: the layer's kernel computes what
vLLM's dispatch makes of the weight it holds now. :func:`prebuilt` runs the dispatch ahead of
the pause on a scratch layer holding the values the weight will hold, so the pause only swaps
the layer's ``cpu_linear`` (:func:`put`; `kernel_copies`): oneDNN's handler and the AMX kernel
pack their own copy (tests/replica/test_kernel_copies.py overwrites and frees the weight a
handler was built from), the fallback reads the weight given at each call; zentorch's kernel
may keep the weight and a non-2-D weight is repacked in place, so those are redispatched in
the pause. Cost: linear weights held twice in CPU memory; the proof packs each layer rebuilt in
the pause once more. GPU platforms and processes without vLLM are left alone.
"""

from __future__ import annotations

from typing import Any

import torch

from replica.engine.tensors import bits

# The proof's probe input: one-hot rows reading back this many of the weight's columns exactly
# (a product by 1.0 and sums of zeros round nothing), and as many rows of random values mixing
# every column.
PROBE_COLUMNS, PROBE_MIXED = 8, 2


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


def packs(module: torch.nn.Module) -> bool:
    """Whether vLLM's CPU GEMM dispatch gave the layer a kernel of its own. A layer vLLM marks
    ``_cpu_skip_gemm_dispatch`` (MLA's ``kv_b_proj``) keeps ``torch.nn.functional.linear`` on
    its weight, which needs no rebuild (a packed one would compute other than vLLM's)."""
    return hasattr(module, "cpu_linear") and not getattr(module, "_cpu_skip_gemm_dispatch", False)


def redispatch(module: torch.nn.Module) -> None:
    """Rebuild a CPU layer's packed kernel copy from its (just updated) weight parameter."""
    if not packs(module):
        return
    # (A layer with a packed CPU copy exists only in a vLLM process: vLLM is loaded.)
    _dispatch()(module, remove_weight=False)


def _dispatch() -> Any:
    from vllm.model_executor.layers import utils as layer_utils  # noqa: PLC0415 - vLLM processes only

    dispatch = layer_utils.dispatch_cpu_unquantized_gemm
    return getattr(dispatch, "_rollouts_original", dispatch)


def _probe(k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of one-hot vectors at :data:`PROBE_COLUMNS` columns spread over ``k``, then
    :data:`PROBE_MIXED` rows of fixed random values (the same every call)."""
    columns = sorted({round(i * (k - 1) / max(PROBE_COLUMNS - 1, 1)) for i in range(min(PROBE_COLUMNS, k))})
    onehot = torch.zeros(len(columns), k, dtype=dtype)
    onehot[range(len(columns)), columns] = 1
    mixed = torch.randn(PROBE_MIXED, k, generator=torch.Generator().manual_seed(0)).to(dtype)
    return torch.cat([onehot, mixed])


def stale(module: torch.nn.Module) -> bool:
    """Whether a CPU linear layer's kernel (its packed copy) computes other than vLLM's dispatch
    makes of the weight the layer holds now: both run on a probe input (:func:`_probe`) and are
    compared bit for bit; the fresh dispatch runs on a scratch module holding the same weight
    (no copy). False for a module without a packed CPU kernel."""
    weight = getattr(module, "weight", None)
    kernel = getattr(module, "cpu_linear", None)
    if kernel is None or not packs(module):
        return False
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or not weight.numel():
        return False
    scratch = _dispatched(weight.data)
    x = _probe(weight.shape[1], weight.dtype)
    with torch.no_grad():
        held, fresh = kernel(x, weight, None), scratch.cpu_linear(x, scratch.weight, None)
    return held.shape != fresh.shape or held.dtype != fresh.dtype or not torch.equal(bits(held), bits(fresh))


def _dispatched(weight: torch.Tensor) -> Any:
    """A scratch layer holding ``weight`` (no copy), given its ``cpu_linear`` by vLLM's dispatch."""
    scratch: Any = torch.nn.Module()
    scratch.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
    _dispatch()(scratch, remove_weight=False)
    return scratch


def prebuilt(module: torch.nn.Module, weight: torch.Tensor) -> Any:
    """The ``cpu_linear`` vLLM's CPU GEMM dispatch builds for ``module`` from ``weight`` (the
    values its weight parameter will hold), on a scratch layer: nothing of ``module`` changes.
    None where the kernel would keep a reference to ``weight`` or the dispatch repacks the
    parameter itself (module docstring): that layer is redispatched inside the pause."""
    if not packs(module) or weight.ndim != 2 or weight.is_meta:
        return None
    from vllm.platforms import current_platform  # noqa: PLC0415 - vLLM processes only

    if current_platform.is_zen_cpu():
        return None
    return _dispatched(weight).cpu_linear


def put(module: torch.nn.Module, linear: Any) -> None:
    """Make ``linear`` (from :func:`prebuilt`) the layer's CPU kernel."""
    module.cpu_linear = linear
