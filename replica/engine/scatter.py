"""How a stage's tensors cross into the engine inside the pause: only the changed elements where
that costs the pause less, and on an accelerator from buffers already on the device.

:func:`plan` (stage time, engine serving) chooses per tensor: **sparse** (changed elements'
offsets and new values, plus the old values for :func:`roll_back`) or **dense** (the whole
tensor) when that costs no more (:func:`element_cost`: on an accelerator the bytes that cross;
on the host time, a scattered element, a random access, costing what a copy of
``HOST_SCATTER_ELEMENT_BYTES`` bytes does, so a tensor changed in more than ~3 % of its BF16
elements goes whole: from the stage's own tensor, no memory beyond it, its roll-back copy kept
as for a scattered one), when the device budget
(``ROLLOUTS_SCATTER_BUDGET_BYTES``) is spent, or when no roll-back copy is given (a FULL). Dense
tensors beyond the device budget go through pinned host memory while
``ROLLOUTS_PINNED_BUDGET_BYTES`` lasts (:func:`write_pinned`), else from pageable memory.
:class:`Plan` counts the bytes it decided (``changed``, ``staged``, ``pause``,
``device_staged``, ``pinned_staged``). docs/design.md, "Only changed bytes in the pause".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from common import envs
from replica.engine import host_pauses
from replica.engine.landings import Landing
from replica.engine.tensors import bits, flat_cat
from replica.engine.weight_map import WeightMap

BUDGET_ENV = envs.ROLLOUTS_SCATTER_BUDGET_BYTES.name
DEFAULT_BUDGET = envs.ROLLOUTS_SCATTER_BUDGET_BYTES.default
PINNED_BUDGET_ENV = envs.ROLLOUTS_PINNED_BUDGET_BYTES.name
DEFAULT_PINNED_BUDGET = envs.ROLLOUTS_PINNED_BUDGET_BYTES.default
# Streams the pause's pinned copies alternate over: the host thread issues every copy at once
# and the copy engine never waits for it.
COPY_STREAMS = 2
# What one scattered element costs on host memory, in bytes of a copy (torch's indexed write
# with int64 offsets: a random access per element against a streaming copy at memory bandwidth).
# `bench/gpu_hotload.py --device cpu` measures it (2-core AMD EPYC, 2026-12-07: 15–40 ns an
# element against 0.13–0.3 ns a byte, i.e. ~50–130 bytes, varying with the machine's load). A
# tensor goes whole when count * this >= its bytes: above ~3 % of a BF16 tensor's elements.
HOST_SCATTER_ELEMENT_BYTES = 64


def budget_from_env() -> int:
    return envs.ROLLOUTS_SCATTER_BUDGET_BYTES.get()


def pinned_budget_from_env() -> int:
    return envs.ROLLOUTS_PINNED_BUDGET_BYTES.get()


@dataclass
class Scatter:
    """One landing's changed elements."""

    param: str
    offsets: torch.Tensor  # in the parameter's storage, from its first element
    new: torch.Tensor  # in the parameter's dtype
    old: torch.Tensor  # what the parameter holds there now

    def nbytes(self) -> int:
        return self.offsets.nbytes + self.new.nbytes


@dataclass
class Plan:
    sparse: dict[str, list[Scatter]] = field(default_factory=dict)  # a tensor's own scatters
    # Scatters of many tensors' changed elements at once, one per parameter and chunk
    # (:func:`_plan_batches`), and the tensors they carry.
    batched: list[Scatter] = field(default_factory=list)
    batched_names: set[str] = field(default_factory=set)
    on_device: dict[str, torch.Tensor] = field(default_factory=dict)  # dense tensors staged on the device
    pinned: dict[str, torch.Tensor] = field(default_factory=dict)  # dense tensors in pinned host memory
    changed_bytes: int = 0
    staged_bytes: int = 0
    pause_bytes: int = 0
    device_staged_bytes: int = 0
    pinned_staged_bytes: int = 0

    def scatter_bytes(self, size: int) -> None:
        """Count ``size`` bytes of scattered elements (offsets and values): staged on the
        device holding the parameter and moved inside the pause."""
        self.device_staged_bytes += size
        self.staged_bytes += size
        self.pause_bytes += size

    def scattered(self) -> set[str]:
        """The tensors whose changed elements are scattered (none of them is written whole)."""
        return set(self.sparse) | self.batched_names

    def scatters(self) -> list[Scatter]:
        return [s for items in self.sparse.values() for s in items] + self.batched

    def report(self) -> dict[str, int]:
        return {
            "changed_bytes": self.changed_bytes,
            "staged_bytes": self.staged_bytes,
            "pause_bytes": self.pause_bytes,
            "device_staged_bytes": self.device_staged_bytes,
            "pinned_staged_bytes": self.pinned_staged_bytes,
            "sparse_tensors": len(self.sparse) + len(self.batched_names),
        }


def flat(target: torch.Tensor) -> torch.Tensor:
    """Every element of ``target``'s span in its storage, as one flat view (the index space of a
    landing's offsets)."""
    span = 1 + sum((s - 1) * st for s, st in zip(target.shape, target.stride())) if target.numel() else 0
    return target.as_strided((span,), (1,), target.storage_offset())


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _offset_dtype(target: torch.Tensor) -> torch.dtype:
    """What a scatter's offsets into ``target`` are kept as: on an accelerator int32 below 2^31
    elements (fewer bytes cross); on the host int64, which torch's indexed write takes as it is
    (int32 offsets it widens in a fresh buffer inside the pause: twice the time, measured)."""
    if target.device.type == "cpu":
        return torch.int64
    return torch.int32 if flat(target).numel() < 2**31 else torch.int64


def element_cost(target: torch.Tensor) -> int:
    """What scattering one element into ``target`` costs the pause, in bytes of a whole-tensor
    write (module docstring): on an accelerator the bytes it moves (value and offset), on the
    host ``HOST_SCATTER_ELEMENT_BYTES``."""
    if target.device.type == "cpu":
        return HOST_SCATTER_ELEMENT_BYTES
    return target.element_size() + _offset_dtype(target).itemsize


def _scatter(wmap: WeightMap, ld: Landing, new: torch.Tensor, mask: torch.Tensor) -> Scatter:
    target = wmap.target(ld.param)
    space = flat(target)
    positions = mask.nonzero()  # [changed, dims] in the region's shape
    stride = torch.tensor(ld.dst.stride, dtype=torch.int64)
    offsets = (ld.dst.offset + (positions * stride).sum(dim=1)).to(_offset_dtype(target))
    values = ld.src.view(new)[mask].to(target.dtype)
    offsets, values = _to_device(offsets, target.device), _to_device(values, target.device)
    return Scatter(ld.param, offsets, values, space[offsets].clone())


def plan(
    wmap: WeightMap,
    tensors: Sequence[tuple[str, torch.Tensor]],
    backup: dict[str, torch.Tensor] | None,
    budget: int | None = None,
    pinned_budget: int | None = None,
) -> Plan:
    """Decide, tensor by tensor, how the swap writes ``tensors`` (module docstring). ``backup``:
    what the engine serves now for each, in the checkpoint's layout (at least the regions this
    rank holds); None: every tensor goes whole. Tensors landing whole in one dense region of a
    parameter are compared and planned a parameter at a time (:func:`_plan_batches`), in
    parameter order; the rest one by one after them, in the order given (the budget is taken in
    that order)."""
    budget = budget_from_env() if budget is None else budget
    pinned_budget = pinned_budget_from_env() if pinned_budget is None else pinned_budget
    out = Plan()
    mine = [(n, t) for n, t in tensors if not wmap.entry(n).elsewhere]  # nothing of another rank's crosses
    if backup is None:
        for name, t in mine:
            _dense(wmap, name, t, out, budget, pinned_budget)
        return out
    alone = _plan_batches(wmap, mine, backup, out, budget, pinned_budget)
    for name, t in alone:
        _plan_one(wmap, name, t, backup[name], out, budget, pinned_budget)
    return out


def _plan_one(
    wmap: WeightMap, name: str, t: torch.Tensor, previous: torch.Tensor, out: Plan, budget: int, pinned_budget: int
) -> None:
    """Plan one tensor by its own landings (a tensor in several regions or parameters)."""
    new, old = t.contiguous(), previous.contiguous()
    landings = wmap.entry(name).landings
    masks = {ld: bits(ld.src.view(new)) != bits(ld.src.view(old)) for ld in landings}
    counts = {ld: int(mask.sum()) for ld, mask in masks.items()}
    # A region several landings read (a tensor loaded into two places) changed once.
    out.changed_bytes += sum({ld.src: counts[ld] for ld in landings}.values()) * t.element_size()
    sparse = cost = 0
    for ld in landings:
        target = wmap.target(ld.param)
        sparse += counts[ld] * (target.element_size() + _offset_dtype(target).itemsize)
        cost += counts[ld] * element_cost(target)
    if cost < dense_bytes(wmap, name) and out.device_staged_bytes + sparse <= budget:
        scatters = [_scatter(wmap, ld, new, masks[ld]) for ld in landings]
        out.sparse[name] = scatters
        out.scatter_bytes(sum(s.nbytes() for s in scatters))
    else:
        _dense(wmap, name, t, out, budget, pinned_budget)


def _plan_batches(
    wmap: WeightMap,
    tensors: list[tuple[str, torch.Tensor]],
    backup: dict[str, torch.Tensor],
    out: Plan,
    budget: int,
    pinned_budget: int,
) -> list[tuple[str, torch.Tensor]]:
    """Plan the tensors that land whole in one dense region (`WeightMap.dense_landing`) a
    parameter at a time: their new and old bytes compared in one operation per chunk of
    ``BATCH_BYTES``, each tensor then decided as :func:`_plan_one` decides it (scattered when
    that costs less than writing it whole, :func:`element_cost`, within the budget), and the chosen tensors'
    changed elements gathered into one :class:`Scatter` per chunk. Returns the other tensors."""
    groups: dict[tuple[str, torch.dtype], list[tuple[str, torch.Tensor, Landing]]] = {}
    alone = []
    for name, t in tensors:
        ld = wmap.dense_landing(name)
        if ld is None:
            alone.append((name, t))
        else:
            groups.setdefault((ld.param, t.dtype), []).append((name, t, ld))
    for (param, _), members in groups.items():
        for chunk in _chunks(members):
            host_pauses.give_way()  # another engine's pause on this host goes first
            _plan_chunk(wmap, param, chunk, backup, out, budget, pinned_budget)
    return alone


BATCH_BYTES = 64 << 20  # new bytes compared at once in :func:`_plan_batches` (its scratch is ~3x that)


def _chunks(members: list[tuple[str, torch.Tensor, Landing]]) -> Iterator[list[tuple[str, torch.Tensor, Landing]]]:
    chunk: list[tuple[str, torch.Tensor, Landing]] = []
    size = 0
    for member in members:
        if chunk and size + member[1].nbytes > BATCH_BYTES:
            yield chunk
            chunk, size = [], 0
        chunk.append(member)
        size += member[1].nbytes
    if chunk:
        yield chunk


def _plan_chunk(
    wmap: WeightMap,
    param: str,
    chunk: list[tuple[str, torch.Tensor, Landing]],
    backup: dict[str, torch.Tensor],
    out: Plan,
    budget: int,
    pinned_budget: int,
) -> None:
    """:func:`_plan_batches` for one chunk of tensors landing in ``param``: one comparison of
    their bytes, then only the changed elements are handled (their tensor, the counts)."""
    target = wmap.target(param)
    width, per_element = target.element_size(), target.element_size() + _offset_dtype(target).itemsize
    cost = element_cost(target)
    new = flat_cat([t for _, t, _ in chunk])
    old = flat_cat([backup[name] for name, _, _ in chunk])
    positions = (bits(new) != bits(old)).nonzero().squeeze(1)
    numels = [t.numel() for _, t, _ in chunk]
    member = _members(positions, numels)
    counts = torch.bincount(member, minlength=len(chunk))
    out.changed_bytes += int(counts.sum()) * new.element_size()
    chosen = _choose(wmap, chunk, counts, torch.tensor(numels) * width, cost, per_element, out, budget, pinned_budget)
    if not any(chosen):
        return
    if not all(chosen):  # the tensors going whole: none of their elements is scattered
        keep = torch.tensor(chosen)[member]
        positions, member = positions[keep], member[keep]
    first = 0
    shift = []  # a tensor's element j is at its landing's offset + j (a dense region): minus where it starts here
    for (_, _, ld), numel in zip(chunk, numels):
        shift.append(ld.dst.offset - first)
        first += numel
    offsets = (torch.tensor(shift, dtype=torch.int64)[member] + positions).to(_offset_dtype(target))
    values = new[positions].to(target.dtype)
    offsets, values = _to_device(offsets, target.device), _to_device(values, target.device)
    out.batched.append(Scatter(param, offsets, values, flat(target)[offsets].clone()))


def _choose(
    wmap: WeightMap,
    chunk: list[tuple[str, torch.Tensor, Landing]],
    counts: torch.Tensor,
    whole: torch.Tensor,
    cost: int,
    per_element: int,
    out: Plan,
    budget: int,
    pinned_budget: int,
) -> list[bool]:
    """Which of ``chunk``'s tensors are scattered (True) or go whole (:func:`_dense`), given each
    one's changed ``counts`` and ``whole`` bytes: scattered when that costs less, while the
    budget lasts, taken in order. When every tensor is scattered within the budget (an
    optimizer step's delta: tens of thousands of tensors) it is decided for the chunk at once."""
    sparse = counts * per_element
    total = int(sparse.sum())
    if bool((counts * cost < whole).all()) and out.device_staged_bytes + total <= budget:
        out.batched_names.update(name for name, _, _ in chunk)
        out.scatter_bytes(total)
        return [True] * len(chunk)
    chosen = []
    for (name, t, _), count, size, numel_bytes in zip(chunk, counts.tolist(), sparse.tolist(), whole.tolist()):
        if count * cost < numel_bytes and out.device_staged_bytes + size <= budget:
            chosen.append(True)
            out.batched_names.add(name)
            out.scatter_bytes(size)
        else:
            chosen.append(False)
            _dense(wmap, name, t, out, budget, pinned_budget)
    return chosen


def _members(positions: torch.Tensor, numels: list[int]) -> torch.Tensor:
    """Which of consecutive segments of these lengths each position (sorted) falls in."""
    if len(set(numels)) == 1:
        return positions // max(1, numels[0])
    ends = torch.tensor(numels, dtype=torch.int64).cumsum(0)
    return torch.searchsorted(ends, positions, right=True)


def _dense(wmap: WeightMap, name: str, t: torch.Tensor, out: Plan, budget: int, pinned_budget: int) -> None:
    """``name`` goes whole: staged on the accelerator holding it while the budget lasts, else in
    pinned host memory while that budget lasts (an accelerator's tensor only)."""
    out.staged_bytes += t.nbytes
    out.pause_bytes += dense_bytes(wmap, name)
    devices = {wmap.target(ld.param).device for ld in wmap.entry(name).landings}
    if len(devices) != 1 or (device := devices.pop()).type == "cpu":
        return
    if out.device_staged_bytes + t.nbytes <= budget:
        out.on_device[name] = _to_device(t.contiguous(), device)
        out.device_staged_bytes += t.nbytes
    elif device.type == "cuda" and out.pinned_staged_bytes + t.nbytes <= pinned_budget:
        out.pinned[name] = t.contiguous().pin_memory()
        out.pinned_staged_bytes += t.nbytes


def dense_bytes(wmap: WeightMap, name: str) -> int:
    """What writing ``name`` whole moves into the engine: each landing at the parameter's width."""
    return sum(ld.dst.numel() * wmap.target(ld.param).element_size() for ld in wmap.entry(name).landings)


def write_pinned(wmap: WeightMap, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy dense tensors held in pinned host memory into their landings on a CUDA device:
    every copy issued at once, asynchronously, over ``COPY_STREAMS`` side streams ordered after
    the engine's current stream, which then waits for them (what runs next on it, the proof or
    a roll-back, sees them landed; the swap waits for the device before it reads its clock)."""
    if not pairs:
        return
    device = wmap.target(wmap.entry(pairs[0][0]).landings[0].param).device
    current = torch.cuda.current_stream(device)
    streams = _copy_streams(device)
    for stream in streams:
        stream.wait_stream(current)
    try:
        for i, pair in enumerate(pairs):
            with torch.cuda.stream(streams[i % len(streams)]):
                wmap.write([pair], non_blocking=True)
    finally:
        # Whatever was issued lands before anything the engine's stream does next: a roll-back
        # after a failure here writes the same landings.
        for stream in streams:
            current.wait_stream(stream)


_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}


def _copy_streams(device: torch.device) -> list[torch.cuda.Stream]:
    if device not in _STREAMS:
        _STREAMS[device] = [torch.cuda.Stream(device) for _ in range(COPY_STREAMS)]
    return _STREAMS[device]


def write(wmap: WeightMap, scatters: Sequence[Scatter]) -> None:
    """Scatter each tensor's new values into its landings (the pause)."""
    _put(wmap, scatters, new=True)


def roll_back(wmap: WeightMap, scatters: Sequence[Scatter]) -> None:
    """Put back what each scattered landing held before."""
    _put(wmap, scatters, new=False)


def _put(wmap: WeightMap, scatters: Sequence[Scatter], *, new: bool) -> None:
    """One indexed write per engine parameter (:func:`by_param`): vLLM fuses a layer's experts
    into a few parameters, so an update of every expert is a few hundred writes, not one per
    tensor (tens of thousands at Qwen3-30B-A3B's or Kimi-K2's counts)."""
    with torch.no_grad():
        for param, (offsets, values) in by_param(scatters, new).items():
            flat(wmap.target(param))[offsets] = values


def by_param(scatters: Sequence[Scatter], new: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every scatter's offsets and values (new, else old), concatenated per parameter. The
    tensors' landings are disjoint regions, so no offset appears twice."""
    grouped: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for s in scatters:
        if s.offsets.numel():
            offsets, values = grouped.setdefault(s.param, ([], []))
            offsets.append(s.offsets)
            values.append(s.new if new else s.old)
    return {p: (o[0], v[0]) if len(o) == 1 else (torch.cat(o), torch.cat(v)) for p, (o, v) in grouped.items()}
