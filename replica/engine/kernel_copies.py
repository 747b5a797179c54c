"""The CPU kernels' copies of the layers an update writes, derived at staging (the engine serving).

vLLM's CPU kernels compute on copies of their layers' weights that vLLM derives after loading:
a fused-MoE layer's padded prepack of its experts (`cpu_moe`), a linear layer's kernel with its
own packed copy (`cpu_gemm`). Deriving them anew from what a swap wrote takes most of a pause at
tens of thousands of tensors, so a stage derives them before it (:func:`derive`): for each such
layer the update writes, the *image* the write will produce (a scratch copy of the layer's
loader-layout tensors, or its weight, with the update's tensors copied in through the same
landings `weight_map.WeightMap.write` uses), and vLLM's own derivation of that image (its
prepack, on a scratch module; its GEMM dispatch, on a scratch layer). The pause then puts the
packs in as the layers' parameters' storage (`cpu_moe.put`, no copy) and swaps the layers'
kernels (:meth:`KernelCopies.put`).

Its proof (:meth:`KernelCopies.differ`) gives the guarantee the pause's own re-derivation and
compare gave, with no second prepack: the pack and the kernel were computed by vLLM's own code
from exactly the image, the staged tensors (checked against their Adler-32 at staging) written
through the write's own landings; the engine's loader copies are proven equal to those tensors
(the stage's proof: each tensor's landings against its Adler-32; a layer the update covers only
in part also has its image compared with what the engine holds, for the elements not written);
the engine's packed weights are proven to be that pack (their Adler-32 against the one taken of
the pack the moment vLLM made it, so a pack that went stale or wrong in the stage is refused,
not only a copy that failed); each layer computes with the kernel built (by identity: vLLM's
dispatch built it from the image, proven to be the weight the engine holds; a kernel rebuilt in
the pause is read back on a probe instead, `cpu_gemm.stale`, at the cost of a kernel creation).
A refusal rolls the stage back (a roll-back re-derives every layer in place from what it
restored: `WeightMap.rebuild`). Layers whose tensors vLLM computes after its loader's copies
(`post_load`'s replay), kernels that may keep a reference to their weight and layers past the
budget are left to the pause, as before (:attr:`KernelCopies.pending`).

Cost: until the swap, the stage holds one more copy of the touched layers' packed experts and
kernels (and, for a layer written in part, its image), up to ``ROLLOUTS_STAGE_KERNEL_BYTES``;
layers past it are re-derived inside the pause.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from common import envs
from replica.engine import cpu_gemm, cpu_moe, host_pauses
from replica.engine.landings import Landing
from replica.engine.tensors import adler32_hex, bits, flat_cat
from replica.engine.weight_map import WeightMap


@dataclass
class Layer:
    """One layer's kernel copies, derived from the image its write will produce."""

    module: torch.nn.Module
    packed: dict[str, torch.Tensor] = field(default_factory=dict)  # a MoE layer's prepack (`cpu_moe.pack`)
    sums: dict[str, str] = field(default_factory=dict)  # each pack's Adler-32, taken as vLLM made it
    linear: Any = None  # a linear layer's kernel (`cpu_gemm.prebuilt`)
    # (engine tensor, its image): kept only where the update covers the tensor in part.
    partial: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def put(self) -> None:
        if self.packed:
            cpu_moe.put(self.module, self.packed)
        if self.linear is not None:
            cpu_gemm.put(self.module, self.linear)

    def holds(self) -> bool:
        """Whether the layer computes with what was derived, from what the engine holds."""
        if any(adler32_hex(getattr(self.module, n).detach()) != s for n, s in self.sums.items()):
            return False
        if self.linear is not None and getattr(self.module, "cpu_linear", None) is not self.linear:
            return False
        return all(torch.equal(bits(held), bits(image)) for held, image in self.partial)


@dataclass
class KernelCopies:
    """The kernel copies a stage derived (:func:`derive`), by layer, and the tensors landing in
    a layer still to be re-derived or replayed inside the pause (``pending``: past the budget, a
    kernel that keeps its weight, `post_load`'s replay; the others need nothing there)."""

    layers: list[Layer]
    pending: list[str]

    def ids(self) -> set[int]:
        """The layers derived: the swap's rebuild leaves them alone (`WeightMap.rebuild`)."""
        return {id(layer.module) for layer in self.layers}

    def put(self) -> None:
        """Inside the pause: the packs put in as the MoE parameters' storage, the kernels swapped in."""
        with torch.no_grad():
            for layer in self.layers:
                layer.put()

    def differ(self, wmap: WeightMap, names: Iterable[str]) -> list[str]:
        """Of ``names``, those landing in a derived layer that does not compute with what was
        derived from what the engine holds (the proof; module docstring)."""
        bad = {id(layer.module) for layer in self.layers if not layer.holds()}
        if not bad:
            return []
        return [n for n in names if any(id(m) in bad for m in wmap.layers([n]))]


def derive(wmap: WeightMap, tensors: Sequence[tuple[str, torch.Tensor]]) -> KernelCopies | None:
    """The kernel copies of the layers ``tensors`` land in (module docstring), within
    ``ROLLOUTS_STAGE_KERNEL_BYTES``; None when there are none (a GPU engine, a model without
    CPU kernel copies, a budget of 0)."""
    budget = envs.ROLLOUTS_STAGE_KERNEL_BYTES.get()
    if budget <= 0:
        return None
    mine = [(n, t) for n, t in tensors if not wmap.entry(n).elsewhere]
    replayed = {id(m) for m in wmap.replayed(n for n, _ in mine)}
    by_module = _by_module(wmap, mine)
    layers: list[Layer] = []
    pending: dict[str, None] = {}  # the tensors landing in a layer the pause must still derive
    held = 0
    with torch.no_grad():
        for prefix, (module, landed) in by_module.items():
            host_pauses.give_way()  # another engine's pause on this host goes first
            size = None if id(module) in replayed else _size(module)
            layer = None
            if size is not None and held + size <= budget:
                layer = _derive_layer(wmap, prefix, module, landed)
            if layer is not None:
                layers.append(layer)
                held += size or 0
            elif id(module) in replayed or size is not None:
                pending.update(dict.fromkeys(n for n, _ in landed))
    return KernelCopies(layers, list(pending)) if layers else None


Landed = list[tuple[str, torch.Tensor]]


def _by_module(wmap: WeightMap, tensors: Landed) -> dict[str, tuple[torch.nn.Module, Landed]]:
    """The tensors grouped by each layer (by its name) holding a parameter one of their landings,
    or a parameter their loader computes (`post_load`), is in: the layers `WeightMap.layers`
    finds (a tied ``lm_head`` with the embedding: each keeps a kernel of its own)."""
    out: dict[str, tuple[torch.nn.Module, Landed]] = {}
    first: dict[int, str] = {}  # a module under several names (a tied ``lm_head``): grouped once
    for name, t in tensors:
        e = wmap.entry(name)
        params = [ld.param for ld in e.landings] + e.computed_into
        holders = (h for p in params for h in wmap.holders.get(p, [p.rpartition(".")[0]]))
        for prefix in dict.fromkeys(holders):
            module = wmap.modules[prefix]
            prefix = first.setdefault(id(module), prefix)
            out.setdefault(prefix, (module, []))[1].append((name, t))
    return out


def _size(module: torch.nn.Module) -> int | None:
    """The bytes a layer's derived copies hold (about its weights'); None for a layer with no
    kernel copies of its own."""
    copies = cpu_moe.loaded(module)
    if copies:
        return sum(t.numel() * t.element_size() for t in copies.values())
    weight = getattr(module, "weight", None)
    if cpu_gemm.packs(module) and isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return None


def _derive_layer(wmap: WeightMap, prefix: str, module: torch.nn.Module, landed: Landed) -> Layer | None:
    """The layer ``prefix`` derived from the image of ``landed`` written into it (None: a
    kernel left to the pause, `cpu_gemm.prebuilt`)."""
    copies = cpu_moe.loaded(module)
    if copies:
        imaged = _images(wmap, prefix, copies, landed)
        if imaged is None:
            return None
        images, partial = imaged
        packed = cpu_moe.pack(module, images)
        sums = {n: adler32_hex(t) for n, t in packed.items()}
        return Layer(module, packed=packed, sums=sums, partial=partial)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)  # a linear layer (`_size` checked it has one)
    imaged = _images(wmap, prefix, {"weight": weight.data}, landed)
    if imaged is None:
        return None
    images, partial = imaged
    linear = cpu_gemm.prebuilt(module, images["weight"])
    return None if linear is None else Layer(module, linear=linear, partial=partial)


def _images(
    wmap: WeightMap, prefix: str, targets: dict[str, torch.Tensor], landed: Landed
) -> tuple[dict[str, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]] | None:
    """Scratch copies of the layer's ``targets`` (attribute -> the tensor its landings write) with
    ``landed`` copied in as `WeightMap.write` copies them, and (engine tensor, image) for each
    target the update does not cover whole (the proof compares those). None when a landing in
    one of ``targets``' names is in another tensor than that target (left to the pause)."""
    images = {attr: t.clone() for attr, t in targets.items()}
    covered = {attr: torch.zeros(t.shape, dtype=torch.bool) for attr, t in targets.items()}
    into: dict[str, str | None] = {}  # a landing's parameter -> the image it writes (None: none)
    by_image: dict[str, list[tuple[str, torch.Tensor, Landing]]] = {}
    for name, t in landed:
        for ld in wmap.entry(name).landings:
            if ld.param not in into:
                into[ld.param] = _image_of(wmap, prefix, targets, ld.param)
            attr = into[ld.param]
            if attr is None:
                continue
            if attr == _ELSEWHERE:
                return None
            by_image.setdefault(attr, []).append((name, t, ld))
    for attr, items in by_image.items():
        if not _copy_blocks(wmap, images[attr], covered[attr], items):
            for _, t, ld in items:
                ld.dst.view(images[attr]).copy_(ld.src.view(t.contiguous()))
                ld.dst.view(covered[attr]).fill_(True)
    partial = [(targets[attr], images[attr]) for attr in images if not bool(covered[attr].all())]
    return images, partial


def _copy_blocks(
    wmap: WeightMap, image: torch.Tensor, covered: torch.Tensor, items: list[tuple[str, torch.Tensor, Landing]]
) -> bool:
    """Write ``items`` into ``image`` in two torch calls when each is a whole tensor landing in
    one dense region (`WeightMap.dense_landing`) of the same size at a distinct multiple of it
    (a fused expert parameter's rows: an expert's tensors in an MoE layer), marking ``covered``;
    False (nothing written) otherwise, for the landing-by-landing copy."""
    size = items[0][2].dst.numel()
    if not size or not image.is_contiguous() or image.numel() % size:
        return False
    rows: list[int] = []
    for name, _, ld in items:
        if wmap.dense_landing(name) is not ld or ld.dst.numel() != size or ld.dst.offset % size:
            return False
        rows.append(ld.dst.offset // size)
    if len(set(rows)) != len(rows):
        return False  # two tensors in one region: the landing order decides, as the loader's
    index = torch.tensor(rows, dtype=torch.int64)
    blocks = flat_cat([t for _, t, _ in items]).view(len(items), size)
    image.view(-1, size).index_copy_(0, index, blocks.to(image.dtype))
    covered.view(-1, size)[index] = True
    return True


_ELSEWHERE = ""  # `_image_of`: the parameter is named as a target but is another tensor


def _image_of(wmap: WeightMap, prefix: str, targets: dict[str, torch.Tensor], param: str) -> str | None:
    """Which of the layer ``prefix``'s ``targets`` a landing in ``param`` writes: its attribute,
    None when none (another layer's, a linear layer's bias: its kernel reads it at each call),
    ``_ELSEWHERE`` when the name is a target's but the tensor is not."""
    owner, _, attr = param.rpartition(".")
    if (owner != prefix and prefix not in wmap.holders.get(param, ())) or attr not in targets:
        return None
    return attr if _same_storage(targets[attr], wmap.target(param)) else _ELSEWHERE


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.shape == b.shape
