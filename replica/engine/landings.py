"""Where each checkpoint tensor lands in the engine's parameters, as vLLM's own loader puts it.

``observe(model, specs)`` runs the model's ``load_weights`` on uninitialised *probes* under a
``TorchDispatchMode`` that records every ``copy_`` into a parameter as a :class:`Landing`
(region of the parameter written, region of the tensor read) and executes none of them:
nothing is written, the engine keeps serving. vLLM decides every mapping (fused q/k/v and
gate/up, experts, tensor-parallel slices, padded vocabularies, tied names). An expert another
rank owns is marked ``elsewhere``. Any write the map cannot describe (a non-view copy, another
op into a parameter, a loader that raises) is a *problem* named with its tensor; a batch with
one is observed again in halves down to one tensor, so each problem names its own tensor, and
``unproven`` skips such tensors.
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
    """Sees the ops of one ``load_weights`` call over a batch of probes, executing none that
    writes a parameter. A copy into a parameter is the landing of the probe its source is a view
    of (keyed by storage); anything else writing a parameter is a problem of the tensor being
    loaded (the last one the loader took from the batch, :meth:`begin`)."""

    def __init__(
        self, params: dict[int, tuple[str, int]], probes: dict[int, TensorMap], dtypes: dict[int, torch.dtype]
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.params = params  # storage key -> (parameter name, its storage offset)
        self.probes = probes  # a probe's storage key -> its tensor's map
        self.dtypes = dtypes  # a probe's storage key -> its dtype
        self.current: TensorMap | None = None
        # storage key of a value-preserving copy of a probe region -> (probe key, region, shape)
        self.copies: dict[int, tuple[int, Region, torch.Size]] = {}
        # a landing from a probe other than the current one: the loader did not take the batch
        # one tensor at a time (the batch's maps cannot be told apart)
        self.crossed = False

    def begin(self, tmap: TensorMap) -> None:
        """The loader took ``tmap``'s tensor: what it writes from now on is that tensor's."""
        self.current, self.copies = tmap, {}

    def _source(self, src: torch.Tensor) -> tuple[int, Region] | None:
        key = _storage_key(src)
        if key in self.probes:
            return key, Region.of(src)
        if key in self.copies:  # a dtype-converted or contiguous copy, used whole
            probe, region, shape = self.copies[key]
            if src.shape == shape and src.is_contiguous() and src.storage_offset() == 0:
                return probe, region
        return None

    def _problem(self, text: str) -> None:
        if self.current is None:
            self.crossed = True
        else:
            self.current.problems.append(text)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        owned = [self.params[_storage_key(t)] for t in written if _storage_key(t) in self.params]
        owners = [name for name, _ in owned]
        if owners:
            if self.current is not None:
                self.current.written.extend(o for o in owners if o not in self.current.written)
            if func is aten.copy_.default:
                self._copy(owners[0], owned[0][1], args[0], args[1])
            elif func not in CONSTANT_FILLS:  # (a padding filled with zeros holds no checkpoint value)
                self._problem(f"{owners[0]}: written by {func}")
            return written[0]  # the parameter is left as it is
        out = func(*args, **kwargs)
        # A value-preserving copy of a probe region (a dtype change, a contiguous copy): a later
        # copy_ from it whole still reads that region.
        if func in (aten._to_copy.default, aten.clone.default) and isinstance(out, torch.Tensor) and args:
            source = self._source(args[0])
            if source is not None:
                self.copies[_storage_key(out)] = (*source, out.shape)
        return out

    def _copy(self, owner: str, offset: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        source = self._source(src)
        if source is None:
            self._problem(f"{owner}: written from a value that is not a view of the tensor")
            return
        key, region = source
        tmap = self.probes[key]
        if tmap is not self.current:
            self.crossed = True
        if region.numel() != dst.numel():
            tmap.problems.append(f"{owner}: {dst.numel()} elements written from {region.numel()}")
        else:
            tmap.landings.append(Landing(owner, Region.of(dst, offset), region, self.dtypes[key]))


# Tensors observed per ``load_weights`` call, and their probes' bytes at most (never touched: address space only).
BATCH, BATCH_BYTES = 4096, 1 << 36
Spec = tuple[str, tuple[int, ...], torch.dtype]


def _batches(specs: list[Spec]) -> Iterator[list[Spec]]:
    """``specs`` in order, in runs of at most BATCH tensors and BATCH_BYTES probe bytes; an empty
    tensor alone (its probe has no storage of its own to be told apart by)."""
    run: list[Spec] = []
    nbytes = 0
    for spec in specs:
        size = math.prod(spec[1]) * spec[2].itemsize
        alone = size == 0 or (run and nbytes == 0)  # this one is empty, or the run is one empty tensor
        if run and (alone or len(run) >= BATCH or nbytes + size > BATCH_BYTES):
            yield run
            run, nbytes = [], 0
        run.append(spec)
        nbytes += size
    if run:
        yield run


def observe(model: torch.nn.Module, specs: Iterable[Spec]) -> dict[str, TensorMap]:
    """For each checkpoint tensor ``(name, shape, dtype)``, where vLLM's loader of ``model``
    would put it on this rank. Writes nothing into the model.

    Many tensors go through one ``load_weights`` call (:func:`_observe_batch`); a batch with any
    problem, a loader error, or a landing that cannot be told apart is split in halves and
    observed again, down to one tensor a call, so every problem is its own tensor's."""
    params: dict[int, tuple[str, int]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        if p.numel():  # (a tied parameter keeps its first name: the embedding's)
            params.setdefault(_storage_key(p), (n, int(p.storage_offset())))
    out: dict[str, TensorMap] = {}
    with expert_misses(model) as missed:
        todo = list(_batches(list(specs)))
        while todo:
            batch = todo.pop(0)
            maps = _observe_batch(model, params, batch, missed)
            if maps is None:  # (only ever for more than one tensor)
                half = len(batch) // 2
                todo[:0] = [batch[:half], batch[half:]]
            else:
                out.update(maps)
    return out


def _observe_batch(
    model: torch.nn.Module, params: dict[int, tuple[str, int]], batch: list[Spec], missed: list[int]
) -> dict[str, TensorMap] | None:
    """The maps of ``batch``'s tensors from one ``load_weights`` call; None when the batch has
    more than one tensor and any map has a problem or the loader raised, did not take the batch
    one tensor at a time, or left some untaken (observe them in smaller batches)."""
    maps = {name: TensorMap(name) for name, _, _ in batch}
    # never written: their pages are never touched; kept alive, so no two share a storage
    probes = [(name, torch.empty(shape, dtype=dtype)) for name, shape, dtype in batch]
    observer = _Observer(
        params, {_storage_key(p): maps[n] for n, p in probes}, {_storage_key(p): p.dtype for _, p in probes}
    )
    taken: list[str] = []
    missed.clear()

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        for name, probe in probes:
            _close(observer, missed)
            observer.begin(maps[name])
            taken.append(name)
            yield name, probe
        if len(probes) > 1:  # (what a call for one tensor does after taking it is still that tensor's)
            _close(observer, missed)
            observer.current = None

    try:
        with observer:
            model.load_weights(feed())  # type: ignore[operator]  # vLLM's models have it
        _close(observer, missed)
    except Exception as exc:  # the loader refused a name: say why (alone), keep going
        if len(batch) > 1:
            return None
        maps[batch[0][0]].problems.append(f"the engine's loader refused it: {type(exc).__name__}: {exc}"[:300])
    if len(batch) > 1 and (observer.crossed or len(taken) < len(batch) or any(m.problems for m in maps.values())):
        return None
    for tmap in maps.values():
        tmap.elsewhere = tmap.elsewhere and not tmap.landings and not tmap.problems
    return maps


def _close(observer: _Observer, missed: list[int]) -> None:
    """The loader is done with the current tensor: it is *elsewhere*-eligible when its loading
    asked for an expert another rank holds."""
    if observer.current is not None and missed:
        observer.current.elsewhere = True
    missed.clear()


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
