"""vLLM's own loading and post-load processing, replayed in place for the layers an update wrote.

For layers whose kernels compute on other tensors than vLLM's loader writes (a repacked
parameter, ``A = -exp(A_log)``), an in-place write of checkpoint bytes reaches neither; this
module replays them the way vLLM's layer-wise reload does. :func:`install` (before the model
loads) keeps each rebound parameter's loader-layout shadow by reference; :func:`derive` runs the
layers' loaders and post-load step on scratch copies (touching nothing served); :func:`apply`
copies the result in place (swap, roll-back); :func:`differs` compares it with what is held
(the proof, and at build the check that the replay reproduces vLLM's load exactly, else the map
refuses those tensors). Cost: the shadows stay alive, and the replay runs twice in the pause.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

_LOADED = "_rollouts_loader_tensors"  # layer.__dict__: {parameter attribute: the tensor its loader wrote}
_CONTEXT = "_rollouts_post_load"  # model.__dict__: (model dtype, target device) vLLM processed with
_OURS = ("_rollouts_",)  # attributes of ours (here, cpu_moe): never derived state


def install() -> None:
    """Wrap vLLM's post-load processing to keep the loader tensors it releases (idempotent)."""
    try:
        # vLLM only inside its own processes: importing it elsewhere would start its platform.
        from vllm.model_executor.model_loader import base_loader  # noqa: PLC0415 - vLLM processes only
        from vllm.model_executor.model_loader import utils as loader_utils  # noqa: PLC0415 - vLLM processes only
    except Exception:  # pragma: no cover - vLLM absent (or another version): nothing to patch
        return
    original = loader_utils.process_weights_after_loading
    if getattr(original, "_rollouts_keeps_loader_tensors", False):
        return

    def keeping_loader_tensors(model: torch.nn.Module, model_config: Any, target_device: torch.device) -> None:
        before = {id(m): {n: p.data for n, p in m._parameters.items() if p is not None} for m in model.modules()}
        original(model, model_config, target_device)
        model.__dict__[_CONTEXT] = (model_config.dtype, target_device)
        for module in model.modules():
            if any(k.startswith(_OURS) for k in module.__dict__):
                continue  # a layer `cpu_moe` keeps and re-packs itself
            kept = {
                n: t
                for n, t in before.get(id(module), {}).items()
                if (p := module._parameters.get(n)) is None or not _same(p.data, t)
            }
            if kept:
                module.__dict__[_LOADED] = kept

    keeping_loader_tensors._rollouts_keeps_loader_tensors = True  # type: ignore[attr-defined]
    loader_utils.process_weights_after_loading = keeping_loader_tensors
    base_loader.process_weights_after_loading = keeping_loader_tensors  # (imported there by name)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def loaded(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors vLLM's loader wrote for the parameters its post-load step rebound (empty when
    none): where the map lands checkpoint tensors for that layer."""
    kept: dict[str, torch.Tensor] = module.__dict__.get(_LOADED, {})
    return kept


def processed(model: torch.nn.Module) -> bool:
    """Whether vLLM processed ``model`` with :func:`install`'s wrapper (else nothing can be replayed)."""
    return _CONTEXT in model.__dict__


def _deferred_attention(module: torch.nn.Module) -> bool:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer  # noqa: PLC0415 - vLLM processes only

    return is_deferred_attention_layer(module)


def dependents(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """For each layer (by id), the deferred attention layers whose post-load step reads it (an
    attribute of theirs, as MLA holds ``kv_b_proj``): replayed after it."""
    out: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        if not _deferred_attention(module):
            continue
        refs = {
            id(v): v for v in [*module.__dict__.values(), *module._modules.values()] if isinstance(v, torch.nn.Module)
        }
        for ref in refs.values():
            out.setdefault(id(ref), []).append(module)
    return out


@dataclass(frozen=True)
class Key:
    """One tensor a layer holds: a parameter, a buffer or a plain tensor attribute."""

    layer: int  # index into the layers given
    kind: str  # "param" | "buffer" | "attr" | "impl" (a tensor of the layer's ``impl``)
    name: str


def _storages(model: torch.nn.Module) -> set[int]:
    """The storages of every parameter and loader tensor: a buffer on one of them follows it
    (Mamba's ``conv_weights`` is a view of the loaded ``conv1d`` weight) and is not derived."""
    out = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
    for module in model.modules():
        out |= {t.untyped_storage().data_ptr() for t in loaded(module).values() if t.numel()}
    return out


def impl_of(module: torch.nn.Module) -> Any:
    """An attention layer's backend implementation (``impl``: not a module), whose post-load
    step may keep tensors of its own (AMX MLA packs ``kv_b_proj`` into ``_w_uk_packed``...);
    None for any other layer."""
    impl = module.__dict__.get("impl")
    return None if impl is None or isinstance(impl, torch.nn.Module) or not hasattr(impl, "__dict__") else impl


def _state(layers: Sequence[torch.nn.Module], aliased: set[int]) -> dict[Key, torch.Tensor]:
    out: dict[Key, torch.Tensor] = {}
    for i, m in enumerate(layers):
        for n, p in m._parameters.items():
            if p is not None:
                out[Key(i, "param", n)] = p.data
        for n, b in m._buffers.items():
            if b is not None and not (b.numel() and b.untyped_storage().data_ptr() in aliased):
                out[Key(i, "buffer", n)] = b
        for n, v in m.__dict__.items():
            if isinstance(v, torch.Tensor) and not n.startswith(_OURS):
                out[Key(i, "attr", n)] = v
        if (impl := impl_of(m)) is not None:
            out.update((Key(i, "impl", n), v) for n, v in vars(impl).items() if isinstance(v, torch.Tensor))
    return out


@contextlib.contextmanager
def _scratch(layers: Sequence[torch.nn.Module], aliased: set[int]) -> Iterator[None]:
    """Within: each layer's parameters hold copies (of the loader tensor where vLLM rebound the
    parameter after loading, else of what it holds), its buffers and tensor attributes copies
    (buffers on a weight's storage excepted), so vLLM's loader and post-load step run on them
    and nothing the engine serves changes; after: every binding as it was."""
    saved = []
    impls = [(impl, dict(vars(impl))) for m in layers if (impl := impl_of(m)) is not None]
    for impl, attrs in impls:
        vars(impl).update((n, v.clone()) for n, v in attrs.items() if isinstance(v, torch.Tensor))
    for m in layers:
        saved.append(
            (
                m,
                dict(m.__dict__),
                dict(m._parameters),
                dict(m._buffers),
                {n: p.data for n, p in m._parameters.items() if p is not None},
            )
        )
        shadows = loaded(m)
        for n, p in m._parameters.items():
            if p is not None:
                p.data = shadows.get(n, p.data).clone()
        for n, b in list(m._buffers.items()):
            if b is not None and not (b.numel() and b.untyped_storage().data_ptr() in aliased):
                m._buffers[n] = b.clone()
        for n, v in list(m.__dict__.items()):
            if isinstance(v, torch.Tensor) and not n.startswith(_OURS):
                m.__dict__[n] = v.clone()
    try:
        yield
    finally:
        for impl, attrs in impls:
            vars(impl).clear()
            vars(impl).update(attrs)
        for m, attrs, params, buffers, data in saved:
            m.__dict__.clear()
            m.__dict__.update(attrs)
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(buffers)
            for n, t in data.items():
                param = params[n]
                assert param is not None
                param.data = t


def _process(model: torch.nn.Module, module: torch.nn.Module) -> None:
    """vLLM's post-load step for one layer, as ``model_loader.utils.process_weights_after_loading``
    runs it per module: its quant method's, or a deferred attention layer's own."""
    from vllm.model_executor.layers.quantization.base_config import (  # noqa: PLC0415 - vLLM processes only
        QuantizeMethodBase,
    )

    dtype, _ = model.__dict__[_CONTEXT]
    layer: Any = module  # vLLM's methods, which nn.Module's attribute types do not know
    if _deferred_attention(module):
        layer.process_weights_after_loading(dtype)
        return
    quant_method = getattr(module, "quant_method", None)
    if isinstance(quant_method, QuantizeMethodBase):
        quant_method.process_weights_after_loading(module)
        if hasattr(module, "update_param_tp_status"):
            layer.update_param_tp_status()


def derive(
    model: torch.nn.Module, layers: Sequence[torch.nn.Module], computed: Iterable[tuple[str, torch.Tensor]]
) -> dict[Key, torch.Tensor]:
    """What ``layers`` hold once vLLM's loader has loaded ``computed`` (checkpoint tensors whose
    loader computes on them, by checkpoint name) and vLLM's post-load step has run on every layer
    with loader tensors and on the deferred attention layers given (last): on scratch copies."""
    from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: PLC0415 - vLLM processes only

    aliased = _storages(model)
    dtype, _ = model.__dict__[_CONTEXT]
    # As vLLM's loader runs it: a tensor the step makes without a dtype (an emptied weight) has the model's.
    with _scratch(layers, aliased), torch.no_grad(), set_default_torch_dtype(dtype):
        computed = list(computed)
        if computed:
            loader: Any = model  # vLLM's model class
            loader.load_weights(computed)
        for m in layers:
            if loaded(m) and not _deferred_attention(m):
                _process(model, m)
        for m in layers:
            if _deferred_attention(m):
                _process(model, m)
        return {k: v.clone() for k, v in _state(layers, aliased).items()}


def apply(model: torch.nn.Module, layers: Sequence[torch.nn.Module], derived: dict[Key, torch.Tensor]) -> None:
    """Copy ``derived`` (from :func:`derive` on the same ``layers``) into the tensors the layers
    hold, in place (a parameter or buffer of another shape or dtype: ValueError); a tensor
    attribute of another shape is rebound, as vLLM's step rebinds it."""
    live = _state(layers, _storages(model))
    with torch.no_grad():
        for key, value in derived.items():
            held = live.get(key)
            if held is not None and held.shape == value.shape and held.dtype == value.dtype:
                held.copy_(value)
            elif key.kind == "attr":
                layers[key.layer].__dict__[key.name] = value
            elif key.kind == "impl":
                vars(impl_of(layers[key.layer]))[key.name] = value
            else:
                raise ValueError(
                    f"{type(layers[key.layer]).__name__}.{key.name}: vLLM's post-load step makes "
                    f"{tuple(value.shape)} {value.dtype}, the engine holds "
                    f"{None if held is None else (tuple(held.shape), held.dtype)}"
                )


def differs(model: torch.nn.Module, layers: Sequence[torch.nn.Module], derived: dict[Key, torch.Tensor]) -> list[str]:
    """The tensors of ``layers`` that are not bit for bit ``derived`` (or that ``derived`` lacks):
    ``layer class.name`` each."""
    live = _state(layers, _storages(model))
    out = []
    for key in sorted(set(live) | set(derived), key=lambda k: (k.layer, k.kind, k.name)):
        a, b = live.get(key), derived.get(key)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or not _equal(a, b):
            out.append(f"{type(layers[key.layer]).__name__}.{key.name}")
    return out


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or a.dtype.is_complex:
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(a.element_size())
        if ints is not None and a.numel():
            return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)
