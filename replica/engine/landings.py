"""Where each checkpoint tensor lands in the engine's parameters, as vLLM's own loader puts it.

``observe(model, specs)`` calls the model's ``load_weights`` once per checkpoint tensor with an
uninitialised *probe* of the tensor's shape and dtype, under a ``TorchDispatchMode`` that sees
every op the loader runs and executes none that would write a parameter. Every ``copy_`` into a
parameter's storage is recorded as a :class:`Landing`: the region of the parameter written (its
size, stride and offset in the parameter's storage) and the region of the checkpoint tensor
read (the same, in the probe's storage). vLLM decides everything: the stacked and packed
mappings (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, or a checkpoint that ships
them fused), per-expert tensors into the fused expert parameters, this rank's tensor-parallel
slice, the unpadded rows of a vocabulary, a tied embedding's second name (no landing). Nothing
is written: the engine keeps serving what it serves.

Under expert parallelism vLLM's expert layer skips an expert another rank owns; a tensor whose
loading asked for such an expert (``expert_misses``: the layer's local id answer was -1) and
landed nowhere is marked ``elsewhere``.

A write the map cannot describe is a *problem*, named with its tensor: a copy from anything but
a strided view of the probe (an arithmetic op on it, a gather), any other op writing into a
parameter (``fill_``, ``index_put_``, ...), or a loader that raises. A tensor with a problem
cannot be written in place through its landings (``unproven`` skips it). `weight_map` builds
the engine's map from both.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# Writes of a constant into a parameter (a vocabulary's padding rows zeroed): nothing of the
# checkpoint lands there, and the parameter already holds it.
CONSTANT_FILLS = (aten.fill_.Scalar, aten.zero_.default)


@dataclass(frozen=True)
class Region:
    """Elements of a storage, as ``as_strided`` takes them (in elements of the tensor's dtype)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # from the first element of the parameter or tensor

    @staticmethod
    def of(t: torch.Tensor, base_offset: int = 0) -> Region:
        """``t`` as a region of a tensor whose first element is at ``base_offset`` in its storage."""
        return Region(tuple(t.shape), tuple(t.stride()), int(t.storage_offset()) - base_offset)

    def numel(self) -> int:
        return math.prod(self.size)

    def view(self, base: torch.Tensor) -> torch.Tensor:
        """This region of ``base`` (a parameter, or a checkpoint tensor laid out as the probe was:
        contiguous), its offset counted from ``base``'s first element."""
        return base.as_strided(self.size, self.stride, base.storage_offset() + self.offset)


@dataclass(frozen=True)
class Landing:
    param: str  # the engine parameter's name
    dst: Region  # written, in the parameter's storage
    src: Region  # read, in the checkpoint tensor (contiguous, row-major)
    src_dtype: torch.dtype  # the checkpoint's dtype (the loader may widen into the parameter's)


@dataclass
class TensorMap:
    """What observe() learned of one checkpoint tensor."""

    name: str
    landings: list[Landing] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # The loader asked which local expert the tensor's expert is and heard "none on this rank"
    # (expert parallelism): another rank holds it.
    elsewhere: bool = False
    # Every parameter the loader wrote into, a copy or not (where a loader that computes on the
    # tensor puts its result: `post_load` replays it there).
    written: list[str] = field(default_factory=list)


# vLLM's expert layers answer which of this rank's experts a checkpoint's (global) expert id is,
# -1 when another rank holds it (expert parallelism).
LOCAL_EXPERT = "_map_global_expert_id_to_local_expert_id"


@contextlib.contextmanager
def expert_misses(model: torch.nn.Module) -> Iterator[list[int]]:
    """Within: every expert id this rank's expert layers answered -1 for is appended to the list
    yielded (each layer's answer wrapped on the instance, put back after)."""
    missed: list[int] = []
    wrapped = []
    for module in model.modules():
        answer = getattr(module, LOCAL_EXPERT, None)
        if not callable(answer):
            continue

        def wrapper(expert_id: int, _answer: Callable[[int], int] = answer) -> int:
            local = _answer(expert_id)
            if local == -1:
                missed.append(expert_id)
            return local

        object.__setattr__(module, LOCAL_EXPERT, wrapper)
        wrapped.append(module)
    try:
        yield missed
    finally:
        for module in wrapped:
            object.__delattr__(module, LOCAL_EXPERT)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors ``func`` writes: the arguments its schema marks mutable (``self`` of an
    in-place op, ``out``)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


class _Observer(TorchDispatchMode):
    def __init__(self, params: dict[int, tuple[str, int]], probe: torch.Tensor, result: TensorMap) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.params = params  # storage key -> (parameter name, its storage offset)
        self.probe_key = _storage_key(probe)
        self.probe_dtype = probe.dtype
        # storage key of a value-preserving copy of a probe region -> that region
        self.copies: dict[int, tuple[Region, torch.Size]] = {}
        self.result = result

    def _src_region(self, src: torch.Tensor) -> Region | None:
        key = _storage_key(src)
        if key == self.probe_key:
            return Region.of(src)
        if key in self.copies:  # a dtype-converted or contiguous copy, used whole
            region, shape = self.copies[key]
            if src.shape == shape and src.is_contiguous() and src.storage_offset() == 0:
                return region
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        owned = [self.params[_storage_key(t)] for t in written if _storage_key(t) in self.params]
        owners = [name for name, _ in owned]
        if owners:
            self.result.written.extend(o for o in owners if o not in self.result.written)
            if func is aten.copy_.default:
                dst, src = args[0], args[1]
                region = self._src_region(src)
                if region is None:
                    self.result.problems.append(f"{owners[0]}: written from a value that is not a view of the tensor")
                elif region.numel() != dst.numel():
                    self.result.problems.append(f"{owners[0]}: {dst.numel()} elements written from {region.numel()}")
                else:
                    self.result.landings.append(Landing(owners[0], Region.of(dst, owned[0][1]), region,
                                                        self.probe_dtype))
            elif func not in CONSTANT_FILLS:  # (a padding filled with zeros holds no checkpoint value)
                self.result.problems.append(f"{owners[0]}: written by {func}")
            return written[0]  # the parameter is left as it is
        out = func(*args, **kwargs)
        # A value-preserving copy of a probe region (a dtype change, a contiguous copy): a later
        # copy_ from it whole still reads that region.
        if func in (aten._to_copy.default, aten.clone.default) and isinstance(out, torch.Tensor) and args:
            region = self._src_region(args[0])
            if region is not None:
                self.copies[_storage_key(out)] = (region, out.shape)
        return out


def observe(model: torch.nn.Module, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, TensorMap]:
    """For each checkpoint tensor ``(name, shape, dtype)``, where vLLM's loader of ``model``
    would put it on this rank. Writes nothing into the model."""
    params: dict[int, tuple[str, int]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.numel():  # (a tied parameter keeps its first name: the embedding's)
            params.setdefault(_storage_key(p), (n, int(p.storage_offset())))
    out: dict[str, TensorMap] = {}
    with expert_misses(model) as missed:
        for name, shape, dtype in specs:
            result = out[name] = TensorMap(name)
            probe = torch.empty(shape, dtype=dtype)  # never written: its pages are never touched
            missed.clear()
            try:
                with _Observer(params, probe, result):
                    model.load_weights([(name, probe)])  # type: ignore[operator]  # vLLM's models have it
            except Exception as exc:  # the loader refused this name: say why, keep going
                result.problems.append(f"the engine's loader refused it: {type(exc).__name__}: {exc}"[:300])
            result.elsewhere = bool(missed) and not result.landings and not result.problems
    return out


def unproven(model: torch.nn.Module, maps: dict[str, TensorMap], read: Callable[[str], torch.Tensor]) -> dict[str, str]:
    """The mapped tensors whose landings do not hold the checkpoint's values now, by name, with
    why: call it on an engine just loaded from that checkpoint (``read(name)`` gives its tensor).
    A landing holds them when its region of the parameter equals its region of the tensor, the
    tensor's dtype converted to the parameter's (vLLM's loader widens with the same ``copy_``).
    What fails here is transformed after loading (repacked, padded, quantised): vLLM computes on
    other bytes than its loader wrote, and an in-place write by this map would not reach them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, str] = {}
    for name, tmap in maps.items():
        if tmap.problems or not tmap.landings:
            continue
        tensor = read(name).contiguous()
        for landing in tmap.landings:
            param = params[landing.param]
            try:
                held = landing.dst.view(param.data)
            except RuntimeError as exc:  # the parameter was replaced by a smaller one
                out[name] = f"{landing.param} no longer has the region its loader wrote ({exc})"[:300]
                break
            want = landing.src.view(tensor).to(device=held.device, dtype=held.dtype)
            if held.shape != want.shape or not torch.equal(held, want):
                out[name] = f"{landing.param} does not hold what its loader wrote (transformed after loading)"
                break
    return out
