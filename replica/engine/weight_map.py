"""The engine's map from checkpoint tensors to the bytes it computes on, as vLLM's loader puts them.

:meth:`WeightMap.build` runs once per worker, while the engine still holds the checkpoint it
started on: it observes where vLLM's loader lands each tensor (`landings.observe`) and checks the
engine holds the checkpoint's values there; a tensor that cannot be taken in place is kept with
its reason and refused at staging. Everything is by checkpoint name, layout and dtype:
:meth:`check` refuses (naming each tensor) what cannot load byte for byte in place; :meth:`held`
reads, :meth:`write` writes (then :meth:`rebuild` the kernel copies and replayed layers), and
:meth:`holds` / :meth:`unpacked` / :meth:`underived` prove. A tensor-parallel rank maps and
proves its own slice only; an expert another rank owns is *elsewhere* (accepted, never written
or proven here). docs/design.md, "The engine's weight map".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from replica.engine import cpu_gemm, cpu_moe, post_load
from replica.engine.landings import Landing, Region, TensorMap, observe, unproven
from replica.engine.tensors import ChecksumPlan, bits, dtype_to_str, row_major_strides

Spec = tuple[str, tuple[int, ...], torch.dtype]
HostSlices = tuple[memoryview, list[tuple[str, int, int]]]  # a host parameter's bytes, (name, first, end) slices


@dataclass(frozen=True)
class HostProof:
    """A proof's host checksums laid out before the pause (`WeightMap.host_proof`): valid while
    every parameter it reads is still where it was (:meth:`current`: vLLM may replace one)."""

    plan: ChecksumPlan
    rest: list[str]  # the names it does not cover
    where: list[tuple[str, int, int]]  # (parameter, data_ptr, nbytes) of each group's bytes
    want: list[int] | None = None  # the expected Adler-32 of each of `plan.names`, when laid out with them

    def current(self, wmap: WeightMap) -> bool:
        for param, ptr, size in self.where:
            target = wmap.target(param)
            if target.data_ptr() != ptr or target.nbytes != size:
                return False
        return True


# Conversions vLLM's loader makes that lose nothing (a copy_ into a wider float parameter).
LOSSLESS = {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
}


@dataclass
class Entry:
    """One checkpoint tensor: where it lands, or why the engine cannot take it in place."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    landings: list[Landing] = field(default_factory=list)
    refused: str | None = None
    # Another rank holds it (expert parallelism: an expert this rank does not own). Accepted at
    # staging; this rank writes and proves nothing of it.
    elsewhere: bool = False
    # Its loader computes on it (``A = -exp(A_log)``): it lands whole in a checkpoint-layout
    # shadow, and vLLM's loader is replayed from there into these parameters (`post_load`).
    computed_into: list[str] = field(default_factory=list)


# A computed tensor's shadow, as a landing's parameter: "<its first parameter's layer>.<ckpt:name>".
_CKPT = "<ckpt:{}>"


def _loader_copies(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The loader-layout tensors kept for a layer whose parameters vLLM transformed after loading:
    a CPU MoE layer's (`cpu_moe`), or those vLLM's post-load step rebound (`post_load`)."""
    return cpu_moe.loaded(module) or post_load.loaded(module)


@contextlib.contextmanager
def loader_layout(model: torch.nn.Module) -> Iterator[None]:
    """Within: the parameters vLLM transformed after loading hold their loader-layout tensors
    (`cpu_moe`, `post_load`), so what vLLM's loader is seen to write lands there."""
    swapped: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        for module in model.modules():
            for name, copy in _loader_copies(module).items():
                param = getattr(module, name)
                swapped.append((param, param.data))
                param.data = copy
        yield
    finally:
        for param, data in swapped:
            param.data = data


class WeightMap:
    def __init__(self, model: torch.nn.Module, entries: dict[str, Entry]) -> None:
        self.model = model
        self.entries = entries
        self.modules = dict(model.named_modules(remove_duplicate=False))  # (every name a parameter has)
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.holders = _holders(model)
        self.covered = {ld.param for e in entries.values() for ld in e.landings} | {
            p for e in entries.values() for p in e.computed_into
        }
        # Computed tensors' checkpoint-layout shadows, by the parameter name their landing uses.
        self.shadows: dict[str, torch.Tensor] = {}
        self.dependents = post_load.dependents(model) if post_load.processed(model) else {}
        self._dense_landings: dict[str, Landing | None] = {}  # :meth:`dense_landing`'s answers
        self.refusals = 0  # how many times :meth:`refuse` ran: a stage checked before is checked again

    # -- building -------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        specs: Iterable[Spec],
        read: Callable[[str], torch.Tensor],
        quantization: str | None = None,
    ) -> WeightMap:
        """The map of ``model`` (just loaded from the checkpoint whose tensors ``specs`` lists and
        ``read(name)`` returns). Run it where no forward pass runs at the same time (an engine's
        RPC): while vLLM's loader is observed, MoE layers hold their loader-layout copies."""
        specs = list(specs)
        if quantization:
            why = (
                f"the engine runs a {quantization}-quantized checkpoint: rollouts hot-loads "
                "BF16, FP16 and FP32 checkpoints only"
            )
            return cls(model, {n: Entry(n, tuple(s), d, refused=why) for n, s, d in specs})
        with loader_layout(model):
            maps = observe(model, specs)
        params = dict(model.named_parameters(remove_duplicate=False))
        entries: dict[str, Entry] = {}
        for name, shape, dtype in specs:
            tmap = maps[name]
            entries[name] = Entry(
                name,
                tuple(shape),
                dtype,
                tmap.landings,
                cls._why_refused(params, tmap, dtype),
                elsewhere=tmap.elsewhere,
            )
        wmap = cls(model, entries)
        if post_load.processed(model):
            wmap._shadow_computed(maps, read)
        mapped = {n: maps[n] for n, e in entries.items() if e.refused is None and not e.computed_into}
        with loader_layout(model):
            for name, why in unproven(model, mapped, read).items():
                entries[name].refused = f"cannot be written in place: {why}"
                entries[name].landings = []
        wmap._check_replay()
        return wmap

    def _shadow_computed(self, maps: dict[str, TensorMap], read: Callable[[str], torch.Tensor]) -> None:
        """A tensor whose loader computes on it (its only problem: a write from a value that is not
        a view of it, or by another op) lands whole in a checkpoint-layout shadow (its bytes read
        now), and vLLM's loader is replayed from there (`post_load`); :meth:`_check_replay`
        then refuses it if that replay does not reproduce what the engine holds."""
        for name, e in self.entries.items():
            tmap = maps[name]
            if not tmap.problems or not tmap.written or any("refused it" in p for p in tmap.problems):
                continue
            key = f"{tmap.written[0].rpartition('.')[0]}.{_CKPT.format(name.replace('.', '/'))}"
            self.shadows[key] = read(name).contiguous().clone()
            whole = Region(tuple(e.shape), row_major_strides(tuple(e.shape)), 0)
            e.landings, e.computed_into, e.refused = [Landing(key, whole, whole, e.dtype)], list(tmap.written), None
            self.covered |= set(tmap.written)

    def _check_replay(self) -> None:
        """Refuse every tensor landing in a layer whose replay (:meth:`replay`) does not reproduce
        exactly what the engine holds now, just loaded from the checkpoint: named, with why."""
        for module in self.replayed(self.names()):
            layers = self._unit([module])
            try:
                bad = post_load.differs(self.model, layers, self._derive(layers))
                why = f"vLLM's processing of it does not replay exactly ({', '.join(bad[:4])} differ)" if bad else None
            except Exception as exc:  # noqa: BLE001 - any failure to replay: refused, with why
                why = f"vLLM's processing of it cannot be replayed ({type(exc).__name__}: {exc})"[:300]
            if why is not None:
                names = [n for n in self.names() if any(m is module for m in self.layers([n]))]
                self.refuse(names, why)

    @staticmethod
    def _why_refused(params: dict[str, torch.nn.Parameter], tmap: TensorMap, dtype: torch.dtype) -> str | None:
        if tmap.problems:
            return f"the engine's loader does more than copy it ({'; '.join(tmap.problems[:2])})"
        if tmap.elsewhere:
            return None
        if not tmap.landings:
            return "the engine's loader keeps none of it (a tied or unused tensor)"
        for ld in tmap.landings:
            held = params[ld.param].dtype
            if held != dtype and (dtype, held) not in LOSSLESS:
                return (
                    f"the engine converts it {dtype_to_str(dtype)} -> {dtype_to_str(held)} ({ld.param}), not losslessly"
                )
        return None

    # -- reading ---------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Every checkpoint tensor this rank holds in place."""
        return [n for n, e in self.entries.items() if e.refused is None and not e.elsewhere]

    def elsewhere(self) -> list[str]:
        """The checkpoint tensors another rank holds (expert parallelism): accepted, not held here."""
        return [n for n, e in self.entries.items() if e.elsewhere]

    def refuse(self, names: Iterable[str], why: str) -> None:
        """Refuse ``names`` from now on (:meth:`check` names each with ``why``): what the ranks'
        maps together show no rank holds (`contracts.engine_ranks.combine_map`)."""
        self.refusals += 1
        for name in names:
            e = self.entries[name]
            e.refused, e.elsewhere, e.landings = why, False, []
            self._dense_landings.pop(name, None)

    def unmapped(self) -> dict[str, torch.Tensor]:
        """Engine parameters no checkpoint tensor lands in, by engine name (not empty ones)."""
        seen: set[int] = set()
        out = {}
        for n, p in self.model.named_parameters():
            if n not in self.covered and p.numel() and id(p) not in seen:
                seen.add(id(p))
                out[n] = p.data
        return out

    def target(self, param: str) -> torch.Tensor:
        """The tensor a landing in ``param`` writes: a computed tensor's shadow, the loader-layout
        tensor of a parameter vLLM transformed after loading, else the parameter."""
        shadow = self.shadows.get(param)
        if shadow is not None:
            return shadow
        module, _, attr = param.rpartition(".")
        return _loader_copies(self.modules[module]).get(attr, self.params[param].data)

    def entry(self, name: str) -> Entry:
        e = self.entries.get(name)
        if e is None:
            raise ValueError(f"{name}: no such tensor in the engine's checkpoint")
        if e.refused is not None:
            raise ValueError(f"{name}: {e.refused}")
        return e

    def whole(self, name: str) -> torch.Tensor | None:
        """A view of the one region holding ``name`` whole in its own dtype and shape, if there is one."""
        e = self.entry(name)
        if len(e.landings) != 1:
            return None
        ld = e.landings[0]
        if (
            ld.src.offset != 0
            or ld.src.numel() != math.prod(e.shape)
            or ld.src.stride != row_major_strides(ld.src.size)
        ):
            return None
        dst = ld.dst.view(self.target(ld.param))
        if dst.dtype != e.dtype or not dst.is_contiguous():
            return None
        return dst.view(e.shape)

    def dense_landing(self, name: str) -> Landing | None:
        """The one landing of ``name`` when it takes the whole tensor, row-major, into one dense
        region of its parameter (element ``j`` of the tensor at ``dst.offset + j``); else None."""
        # Landings do not change once built; a refused entry's is forgotten (:meth:`refuse`), so
        # only a known entry that may still be taken is found here.
        if name in self._dense_landings:
            return self._dense_landings[name]
        e = self.entry(name)
        ld = e.landings[0] if len(e.landings) == 1 else None
        if ld is not None and not (_whole_source(ld.src, e.shape) and _dense(ld.dst.size, ld.dst.stride)):
            ld = None
        self._dense_landings[name] = ld
        return ld

    def host_slices(self, names: Iterable[str]) -> tuple[list[HostSlices], list[str]]:
        """Of ``names``, those held whole in their dtype in one dense region of a contiguous host
        tensor (what :meth:`whole` gives, on the CPU), grouped by that tensor:
        ``([(its bytes, [(name, first byte, end byte), ...]), ...], the rest)``. The proof reads
        each group's bytes once and checks every tensor's slice of them (a fused expert
        parameter's equal-sized slices), with no torch call per tensor."""
        groups, rest = self._host_groups(names)
        return [(data, slices) for _, data, slices in groups.values()], rest

    def host_proof(self, names: Iterable[str], expected: dict[str, str] | None = None) -> HostProof:
        """:meth:`host_slices` of ``names`` laid out for a later proof (`HostProof`), with what
        each should sum to when ``expected`` (name -> Adler-32) is given."""
        groups, rest = self._host_groups(names)
        where = [(param, target.data_ptr(), target.nbytes) for param, (target, _, _) in groups.items()]
        plan = ChecksumPlan((data, slices) for _, data, slices in groups.values())
        want = None if expected is None else [int(expected[n], 16) for n in plan.names]
        return HostProof(plan, rest, where, want)

    def _host_groups(
        self, names: Iterable[str]
    ) -> tuple[dict[str, tuple[torch.Tensor, memoryview, list[tuple[str, int, int]]]], list[str]]:
        groups: dict[str, tuple[torch.Tensor, memoryview | None, list[tuple[str, int, int]]]] = {}
        rest: list[str] = []
        for name in names:
            e = self.entry(name)
            ld = self.dense_landing(name)
            if ld is None:
                rest.append(name)
                continue
            group = groups.get(ld.param)
            if group is None:
                target = self.target(ld.param)
                group = groups[ld.param] = (target, _host_bytes(target), [])
            target, data, slices = group
            start = ld.dst.offset * target.element_size()
            end = start + ld.dst.numel() * target.element_size()
            if data is None or target.dtype != e.dtype or start < 0 or end > len(data) or end == start:
                rest.append(name)
            else:
                slices.append((name, start, end))
        kept = {p: (t, d, sl) for p, (t, d, sl) in groups.items() if d is not None and sl}
        return kept, rest

    def held(self, name: str) -> torch.Tensor:
        """What the engine holds for ``name`` (module docstring); ValueError for a tensor this rank
        holds only a slice of."""
        whole = self.whole(name)
        if whole is not None:
            return whole
        e = self.entry(name)
        if self.sliced(name):
            raise ValueError(f"{name}: this rank holds only a slice of it")
        return self.read_into(name, torch.empty(e.shape, dtype=e.dtype))

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Copy what this rank holds of ``name`` into the same regions of ``out`` (a tensor of the
        checkpoint's shape and dtype; a shard's other regions are left as they are)."""
        for ld in self.entry(name).landings:
            ld.src.view(out).copy_(ld.dst.view(self.target(ld.param)))
        return out

    def assembled_on_device(self, name: str) -> torch.Tensor | None:
        """``name`` assembled from its landings on the accelerator holding them, when this rank
        holds all of it there in the checkpoint's dtype (nothing leaves the device); else None."""
        e = self.entry(name)
        targets = [self.target(ld.param) for ld in e.landings]
        devices = {t.device for t in targets}
        if len(devices) != 1 or next(iter(devices)).type == "cpu" or any(t.dtype != e.dtype for t in targets):
            return None
        if self.sliced(name):
            return None
        return self.read_into(name, torch.empty(e.shape, dtype=e.dtype, device=next(iter(devices))))

    def sliced(self, name: str) -> bool:
        """Whether this rank holds only part of ``name`` (a tensor-parallel shard)."""
        e = self.entry(name)
        return sum(region.numel() for region in {ld.src for ld in e.landings}) < math.prod(e.shape)

    def pieces(self, name: str) -> list[tuple[Region, torch.Tensor]]:
        """Each region of ``name`` this rank holds (once, in the checkpoint's layout) with what the
        engine holds there, in the checkpoint's dtype."""
        e = self.entry(name)
        out: dict[Region, torch.Tensor] = {}
        for ld in e.landings:
            if ld.src not in out:
                out[ld.src] = ld.dst.view(self.target(ld.param)).to(device="cpu", dtype=e.dtype).contiguous()
        return list(out.items())

    def select(self, names: Sequence[str] | None) -> list[tuple[str, torch.Tensor]]:
        """``(name, held)`` for ``names`` in that order (every tensor held when None)."""
        return [(n, self.held(n)) for n in (self.names() if names is None else names)]

    # -- staging, writing, proving ------------------------------------------------------------

    def check(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Refuse (ValueError, naming each tensor) what cannot load in place byte for byte."""
        problems = []
        seen: set[str] = set()
        for name, t in tensors:
            e = self.entries.get(name)
            if name in seen:
                problems.append(f"{name}: given twice")
            elif e is None:
                problems.append(f"{name}: no such tensor in the engine's checkpoint")
            elif e.refused is not None:
                problems.append(f"{name}: {e.refused}")
            elif tuple(t.shape) != e.shape:
                problems.append(f"{name}: shape {tuple(t.shape)} != engine {e.shape}")
            elif t.dtype != e.dtype:
                problems.append(f"{name}: dtype {dtype_to_str(t.dtype)} != engine {dtype_to_str(e.dtype)}")
            seen.add(name)
        if problems:
            raise ValueError(f"refusing to load ({len(problems)} problem(s)): " + "; ".join(problems[:8]))

    def layers(self, names: Iterable[str]) -> list[torch.nn.Module]:
        """The modules whose parameters the tensors ``names`` land in (one lookup per parameter
        name), every module holding the parameter: a tied ``lm_head`` with the embedding, whose
        packed kernel copy is its own (:func:`_holders`)."""
        owners: dict[str, None] = {}
        for n in names:
            e = self.entries[n]
            for ld in e.landings:
                owners[ld.param] = None
            for param in e.computed_into:
                owners[param] = None
        out: dict[int, torch.nn.Module] = {}
        for param in owners:
            for module_name in self.holders.get(param, [param.rpartition(".")[0]]):
                module = self.modules[module_name]
                out[id(module)] = module
        return list(out.values())

    # -- replaying vLLM's loading and post-load processing (`post_load`) ---------------------

    def replayed(self, names: Iterable[str]) -> list[torch.nn.Module]:
        """Of the layers ``names`` land in, those whose tensors vLLM computes after its loader's
        copies: a loader-layout tensor kept by `post_load`, or a computed tensor landing there."""
        computed = {
            id(m) for m in self.layers(n for n, e in self.entries.items() if e.computed_into and e.refused is None)
        }
        return [m for m in self.layers(names) if post_load.loaded(m) or id(m) in computed]

    def _unit(self, layers: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """``layers`` and the deferred attention layers whose post-load step reads them."""
        out = {id(m): m for m in layers}
        for m in layers:
            out.update({id(d): d for d in self.dependents.get(id(m), [])})
        return list(out.values())

    def _derive(self, layers: list[torch.nn.Module]) -> dict[post_load.Key, torch.Tensor]:
        """What ``layers`` hold once vLLM loads every computed tensor landing in them from its
        shadow and processes them (`post_load.derive`)."""
        ids = {id(m) for m in layers}
        computed = [
            (n, self.shadows[e.landings[0].param])
            for n, e in self.entries.items()
            if e.computed_into and e.refused is None and any(id(m) in ids for m in self.layers([n]))
        ]
        return post_load.derive(self.model, layers, computed)

    def replay(self, names: Iterable[str]) -> None:
        """Replay vLLM's loading and post-load processing, in place, for the layers ``names`` land
        in whose tensors it computes (:meth:`replayed`)."""
        replayed = self.replayed(names)
        if replayed:
            layers = self._unit(replayed)
            post_load.apply(self.model, layers, self._derive(layers))

    def underived(self, names: Iterable[str]) -> list[str]:
        """Of ``names``, those landing in a layer whose tensors are not vLLM's processing of what
        its loader-layout tensors and shadows hold now (the proof after a swap)."""
        names = list(names)
        replayed = self.replayed(names)
        if not replayed:
            return []
        layers = self._unit(replayed)
        if not post_load.differs(self.model, layers, self._derive(layers)):
            return []
        bad = {id(m) for m in replayed}
        return [n for n in names if any(id(m) in bad for m in self.layers([n]))]

    def write(self, tensors: Sequence[tuple[str, torch.Tensor]], non_blocking: bool = False) -> None:
        """Copy each tensor into its landings (:meth:`rebuild` the layers next); ``non_blocking``:
        asynchronous copies from pinned memory (the caller waits for them)."""
        with torch.no_grad():
            for name, t in tensors:
                src = t.contiguous()
                for ld in self.entry(name).landings:
                    ld.dst.view(self.target(ld.param)).copy_(ld.src.view(src), non_blocking=non_blocking)

    def rebuild(self, names: Iterable[str], done: Collection[int] = ()) -> None:
        """Rebuild the kernel copies of the layers the tensors ``names`` land in, but those
        (by id) in ``done`` (derived at staging and put in place: `kernel_copies`): MoE packs,
        then `post_load`'s replay, then every GEMM kernel (a replayed layer's too: the replay
        keeps tensors, not the kernel vLLM's dispatch built on its scratch copies)."""
        names = list(names)
        replayed = {id(m) for m in self.replayed(names)}
        layers = [m for m in self.layers(names) if id(m) not in done]
        with torch.no_grad():
            for module in layers:
                if id(module) not in replayed:
                    cpu_moe.rebuild(module)
        self.replay(names)
        with torch.no_grad():
            # After the replay: it restores the tensors a GEMM kernel packs from (a bias vLLM's
            # dispatch widened to float32 on an AMX CPU makes the layer replayed), and the
            # kernel the replayed dispatch built on scratch copies is not kept.
            for module in layers:
                cpu_gemm.redispatch(module)

    def holds(self, name: str, t: torch.Tensor) -> bool:
        """Whether every landing of ``name`` holds its region of ``t`` bit for bit (widened to the
        parameter's dtype where it is wider)."""
        src = t.contiguous()
        for ld in self.entry(name).landings:
            held = ld.dst.view(self.target(ld.param))
            want = ld.src.view(src).to(device=held.device, dtype=held.dtype)
            if not torch.equal(bits(held), bits(want)):
                return False
        return True

    def unpacked(self, names: Iterable[str], done: Collection[int] = ()) -> list[str]:
        """Of ``names``, those landing in a layer whose kernel copy is not vLLM's packing of what
        it holds now: a MoE layer's prepack of its loader-layout copies, a linear layer's packed
        GEMM weight (`cpu_gemm.stale`, every module holding the weight: a tied ``lm_head`` too);
        one check per layer, but for the layers (by id) in ``done`` (derived at staging, proven
        against that: `kernel_copies`). Then those :meth:`underived`."""
        names = list(names)
        bad = {
            id(m)
            for m in self.layers(names)
            if id(m) not in done and (not cpu_moe.packed_from_loaded(m) or cpu_gemm.stale(m))
        }
        out = [n for n in names if any(id(m) in bad for m in self.layers([n]))] if bad else []
        return out + [n for n in self.underived(names) if n not in out]


def _holders(model: torch.nn.Module) -> dict[str, list[str]]:
    """For each parameter name, the names of every module holding a parameter on its storage:
    one tied parameter (a ``lm_head`` sharing the embedding's weight) has a name and a module
    per holder, and each holder may keep a kernel copy of its own (`cpu_gemm`)."""
    by_storage: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.numel():
            by_storage.setdefault(p.untyped_storage().data_ptr(), []).append(name)
    out: dict[str, list[str]] = {}
    for names in by_storage.values():
        modules = list(dict.fromkeys(n.rpartition(".")[0] for n in names))
        out.update({n: modules for n in names})
    return out


def _whole_source(src: Region, shape: tuple[int, ...]) -> bool:
    """Whether ``src`` is all of a checkpoint tensor of ``shape``, row-major."""
    return src.offset == 0 and src.numel() == math.prod(shape) and src.stride == row_major_strides(src.size)


def _dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a region of these sizes and strides is row-major contiguous (as torch's
    ``is_contiguous`` decides: a dimension of size 1 may have any stride)."""
    expected = 1
    for s, st in zip(reversed(size), reversed(stride)):
        if s != 1 and st != expected:
            return False
        expected *= s
    return True


def _host_bytes(target: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous host tensor, from its first element; None for one on an
    accelerator, empty or not contiguous."""
    if target.device.type != "cpu" or not target.is_contiguous() or not target.numel():
        return None
    return target.detach().reshape(-1).view(torch.uint8).numpy().data
