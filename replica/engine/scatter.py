"""Sparse swaps: inside the pause, only the elements a stage changes are written.

:func:`plan` runs at stage time, the engine serving. For each tensor with a roll-back copy (the
values the engine serves now, in the checkpoint's layout) it compares the new bytes with the old
ones in every region this rank holds, and chooses by the bytes the pause would move into the
engine:

- **sparse**: per landing, the changed elements' offsets in the parameter's storage (int32 where
  the parameter has fewer than 2^31 elements, else int64) and their new values in the
  parameter's dtype, plus the parameter's current values there (the roll-back: small, kept on
  the parameter's device). The pause scatters them in (:func:`write`); a roll-back scatters the
  old values back (:func:`roll_back`).
- **dense**: the whole tensor through its landings, as `weight_map.WeightMap.write` does, when
  that moves no more bytes (a tensor changed densely), or when the stage's scatter buffers
  would pass ``budget`` bytes (``ROLLOUTS_SCATTER_BUDGET_BYTES``, default 1 GiB).

The offsets and values are staged on the parameter's device (through pinned host memory on an
accelerator), so on a GPU the pause moves only them. :class:`Plan` counts what it decided:
``changed_bytes`` (changed elements at the checkpoint's width), ``staged_bytes`` (scatter
buffers held ready, and dense tensors' bytes), ``pause_bytes`` (what the swap writes into the
engine: scatters' offsets and values, dense landings at the parameter's width) and
``scatter_device_bytes`` (the scatter buffers on the parameter's device).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from replica.engine.landings import Landing
from replica.engine.weight_map import WeightMap, bits

BUDGET_ENV = "ROLLOUTS_SCATTER_BUDGET_BYTES"
DEFAULT_BUDGET = 1 << 30


def budget_from_env() -> int:
    value = os.environ.get(BUDGET_ENV, "")
    try:
        return int(value) if value else DEFAULT_BUDGET
    except ValueError:
        raise ValueError(f"{BUDGET_ENV}={value!r}: not a number of bytes") from None


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
    sparse: dict[str, list[Scatter]] = field(default_factory=dict)
    changed_bytes: int = 0
    staged_bytes: int = 0
    pause_bytes: int = 0
    scatter_device_bytes: int = 0

    def report(self) -> dict[str, int]:
        return {"changed_bytes": self.changed_bytes, "staged_bytes": self.staged_bytes,
                "pause_bytes": self.pause_bytes, "scatter_device_bytes": self.scatter_device_bytes,
                "sparse_tensors": len(self.sparse)}


def flat(target: torch.Tensor) -> torch.Tensor:
    """Every element of ``target``'s span in its storage, as one flat view (the index space of a
    landing's offsets)."""
    span = 1 + sum((s - 1) * st for s, st in zip(target.shape, target.stride())) if target.numel() else 0
    return target.as_strided((span,), (1,), target.storage_offset())


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _scatter(wmap: WeightMap, ld: Landing, new: torch.Tensor, mask: torch.Tensor) -> Scatter:
    target = wmap.target(ld.param)
    space = flat(target)
    positions = mask.nonzero()  # [changed, dims] in the region's shape
    stride = torch.tensor(ld.dst.stride, dtype=torch.int64)
    offsets = ld.dst.offset + (positions * stride).sum(dim=1) if positions.numel() else torch.zeros(0, dtype=torch.int64)
    if space.numel() < 2**31:
        offsets = offsets.to(torch.int32)
    values = ld.src.view(new)[mask].to(target.dtype)
    offsets, values = _to_device(offsets, target.device), _to_device(values, target.device)
    return Scatter(ld.param, offsets, values, space[offsets].clone())


def plan(wmap: WeightMap, tensors: Sequence[tuple[str, torch.Tensor]], backup: dict[str, torch.Tensor],
         budget: int | None = None) -> Plan:
    """Decide, tensor by tensor, how the swap writes ``tensors`` (module docstring). ``backup``:
    what the engine serves now for each, in the checkpoint's layout (at least the regions this
    rank holds)."""
    budget = budget_from_env() if budget is None else budget
    out = Plan()
    for name, t in tensors:
        new, old = t.contiguous(), backup[name].contiguous()
        landings = wmap.entry(name).landings
        masks: dict[Landing, torch.Tensor] = {}
        seen = set()
        changed = 0
        for ld in landings:
            mask = bits(ld.src.view(new)) != bits(ld.src.view(old))
            masks[ld] = mask
            if ld.src not in seen:
                seen.add(ld.src)
                changed += int(mask.sum())
        out.changed_bytes += changed * t.element_size()
        wide = {ld: wmap.target(ld.param) for ld in landings}
        dense = dense_bytes(wmap, name)
        index = {ld: 4 if flat(wide[ld]).numel() < 2**31 else 8 for ld in landings}
        sparse = sum(int(masks[ld].sum()) * (wide[ld].element_size() + index[ld]) for ld in landings)
        if sparse < dense and out.scatter_device_bytes + sparse <= budget:
            scatters = [_scatter(wmap, ld, new, masks[ld]) for ld in landings]
            out.sparse[name] = scatters
            size = sum(s.nbytes() for s in scatters)
            out.scatter_device_bytes += size
            out.staged_bytes += size
            out.pause_bytes += size
        else:
            out.staged_bytes += t.nbytes
            out.pause_bytes += dense
    return out


def dense_bytes(wmap: WeightMap, name: str) -> int:
    """What writing ``name`` whole moves into the engine: each landing at the parameter's width."""
    return sum(ld.dst.numel() * wmap.target(ld.param).element_size() for ld in wmap.entry(name).landings)


def dense_report(wmap: WeightMap, tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """The bytes of a stage swapped in whole: all of it staged, all of it moved in the pause."""
    return {"staged_bytes": sum(t.nbytes for _, t in tensors),
            "pause_bytes": sum(dense_bytes(wmap, n) for n, _ in tensors),
            "scatter_device_bytes": 0, "sparse_tensors": 0}


def write(wmap: WeightMap, scatters: dict[str, list[Scatter]]) -> None:
    """Scatter each tensor's new values into its landings (the pause)."""
    with torch.no_grad():
        for items in scatters.values():
            for s in items:
                if s.offsets.numel():
                    flat(wmap.target(s.param))[s.offsets] = s.new


def roll_back(wmap: WeightMap, scatters: dict[str, list[Scatter]]) -> None:
    """Put back what each scattered landing held before."""
    with torch.no_grad():
        for items in scatters.values():
            for s in items:
                if s.offsets.numel():
                    flat(wmap.target(s.param))[s.offsets] = s.old

