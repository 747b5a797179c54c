"""The one lifecycle of a weight update inside the engine: stage -> swap -> commit | discard.

:func:`take` (engine serving) checks every tensor loads in place and keeps it with its
roll-back copy and Adler-32, planning its crossing (`scatter.plan`) and deriving the CPU kernels'
copies of the layers it writes (`kernel_copies`: vLLM's prepack of a MoE layer, a linear
layer's kernel, from the values they will hold), giving way to another engine's pause on the
host between its steps (`host_pauses`); :func:`swap` (inside the pause) writes it in
and puts those copies in place (re-deriving only the layers left to it); :func:`commit` proves
what the engine holds (:func:`proof`) and answers ``verified`` or ``read_back_failed``;
discard drops the stage, rolling a swapped one back.
Invariants: :class:`StageSlot` holds one stage, a swapped stage refuses the next until it is
committed or discarded; a failed swap or proof restores the roll-back copies; a stage's
roll-back copy is always of the weights the engine serves; with ``hold`` (tensor parallel) a
proven stage stays swapped until released, so any rank's failure can still roll every rank back.
Engine-taken roll-back copies live in one reused host buffer, guarded by ``BACKUP_LOCK``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from replica.engine import host_pauses, kernel_copies, scatter
from replica.engine.device_checksum import adler32_device_hex
from replica.engine.tensors import adler32_hex, nbytes
from replica.engine.weight_map import HostProof, WeightMap

logger = logging.getLogger("rollouts.engine.stage")

BACKUP_LOCK = threading.Lock()
_BACKUP_POOL: torch.Tensor | None = None
_ALIGN = 64


@dataclass
class Stage:
    """Tensors checked and ready to swap in, with the engine's current values of the same
    tensors (the roll-back copy)."""

    label: str
    tensors: list[tuple[str, torch.Tensor]]
    backup: dict[str, torch.Tensor]
    expected_adler32: dict[str, str] | None = None  # proven again after the swap
    swapped: bool = False
    held: bool = False  # proven and kept swapped in until released (a rank of a TP engine)
    checked: bool = False  # the staged bytes were checked against ``expected_adler32`` when taken
    plan: scatter.Plan | None = None  # how each tensor crosses into the engine (`scatter.plan`)
    # The CPU kernels' copies derived from the values the swap writes (`kernel_copies`), until proven.
    kernels: kernel_copies.KernelCopies | None = None
    # The proof's host checksums laid out when taken (`WeightMap.host_proof`), so the pause only sums.
    host: HostProof | None = None
    # `WeightMap.refusals` when the tensors were checked: the swap checks them again only if a
    # tensor was refused since (the entries change only so).
    checked_at: int = -1

    def scattered(self) -> set[str]:
        """The tensors whose changed elements the swap scatters (:meth:`scatters`)."""
        return self.plan.scattered() if self.plan is not None else set()

    def scatters(self) -> list[scatter.Scatter]:
        return self.plan.scatters() if self.plan is not None else []

    def ready(self) -> list[tuple[str, torch.Tensor]]:
        """The staged tensors, each where it is held ready (on the engine's device when staged there)."""
        on_device = self.plan.on_device if self.plan is not None else {}
        return [(n, on_device.get(n, t)) for n, t in self.tensors] if on_device else self.tensors

    def dense(self) -> list[tuple[str, torch.Tensor]]:
        """What the swap copies whole and at once: :meth:`ready` but the scattered tensors and
        those held in pinned host memory (:meth:`pinned`)."""
        pinned = self.plan.pinned if self.plan is not None else {}
        return [(n, t) for n, t in _dense(self, self.ready()) if n not in pinned]

    def pinned(self) -> list[tuple[str, torch.Tensor]]:
        """The dense tensors held in pinned host memory for the pause's asynchronous copies."""
        return list(self.plan.pinned.items()) if self.plan is not None else []


def _backup_copies(wmap: WeightMap, names: list[str]) -> dict[str, torch.Tensor]:
    global _BACKUP_POOL
    entries = [wmap.entry(n) for n in names]
    sizes = [nbytes(e.dtype, e.shape) for e in entries]
    total = sum(-(-size // _ALIGN) * _ALIGN for size in sizes)
    if _BACKUP_POOL is None or _BACKUP_POOL.numel() < total:
        _BACKUP_POOL = None  # let the old one go before the new one is allocated
        _BACKUP_POOL = torch.empty(max(total, _ALIGN), dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for e, size in zip(entries, sizes):
        # What this rank holds of the tensor (all of it, or its shard's regions): what it restores.
        out[e.name] = wmap.read_into(e.name, _BACKUP_POOL[offset : offset + size].view(e.dtype).reshape(e.shape))
        offset += -(-size // _ALIGN) * _ALIGN
    return out


def take(
    wmap: WeightMap,
    label: str,
    tensors: list[tuple[str, torch.Tensor]],
    backup: dict[str, torch.Tensor] | None = None,
    expected_adler32: dict[str, str] | None = None,
    *,
    checked: bool = False,
    sparse: bool = False,
) -> Stage:
    """Check that ``tensors`` load into the engine ``wmap`` maps and keep them with their roll-back copies (the
    given ``backup``, views of bytes equal to what the engine serves, else copies taken now) and
    the Adler-32 the commit proves them against. ``checked``: the caller checked the tensors
    against those. ``sparse``: plan the swap by changed elements (`scatter.plan`: a delta's
    tensors, most of whose elements the engine already holds). The CPU kernels' copies of the
    layers written are derived here too (`kernel_copies.derive`)."""
    host_pauses.begin_stage()
    wmap.check(tensors)
    checked_at = wmap.refusals
    with BACKUP_LOCK:
        if backup is None:  # nothing to keep of another rank's experts: this rank holds none of them
            backup = _backup_copies(wmap, [n for n, _ in tensors if not wmap.entry(n).elsewhere])
        # The plan reads the roll-back copies: the pool's may not be refilled meanwhile.
        planned = scatter.plan(wmap, tensors, backup if sparse else None)
    expected = None if expected_adler32 is None else {n: c.lower() for n, c in expected_adler32.items()}
    kernels = kernel_copies.derive(wmap, tensors)
    host = None
    if expected is not None and all(n in expected for n, _ in tensors):
        host = wmap.host_proof((n for n, _ in tensors if not wmap.entry(n).elsewhere), expected)
    return Stage(
        label,
        tensors,
        backup,
        expected,
        checked=checked and expected is not None,
        plan=planned,
        kernels=kernels,
        host=host,
        checked_at=checked_at,
    )


def _dense(stage: Stage, pairs: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    skip = stage.scattered()
    return [(n, t) for n, t in pairs if n not in skip]


def roll_back(wmap: WeightMap, stage: Stage) -> None:
    """Put the stage's roll-back copies back into the engine: whole, unless the stage was proven
    (held: another rank failed), when the elements it changed are known to be the only ones
    that differ and a scattered tensor gets back only their old values. Every kernel copy of
    the layers written is re-derived in place from what was restored (a rare path)."""
    backup = list(stage.backup.items())
    if stage.held:
        wmap.write(_dense(stage, backup))
        scatter.roll_back(wmap, stage.scatters())
    else:
        wmap.write(backup)
    wmap.rebuild(n for n, _ in backup)
    stage.swapped = False


def swap(wmap: WeightMap, stage: Stage) -> dict[str, Any]:
    """Write the stage in place (a planned tensor's changed elements only); on any failure
    restore the roll-back copies and raise. The report: ``copy_s``, ``repack_s`` and, for a
    planned stage, its bytes (`scatter.Plan.report`)."""
    t0 = time.perf_counter()
    if stage.checked_at != wmap.refusals:
        wmap.check(stage.tensors)
    try:
        wmap.write(stage.dense())
        scatter.write_pinned(wmap, stage.pinned())
        scatter.write(wmap, stage.scatters())
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the copies landed: copy_s is their time, not their issue's
        t1 = time.perf_counter()
        if stage.kernels is None:
            wmap.rebuild(n for n, _ in stage.tensors)
        else:
            stage.kernels.put()
            if stage.kernels.pending:  # the layers left to the pause (`kernel_copies.KernelCopies`)
                wmap.rebuild(stage.kernels.pending, done=stage.kernels.ids())
    except BaseException:
        logger.exception("swap of %s failed; restoring the previous values", stage.label)
        roll_back(wmap, stage)
        raise
    stage.swapped = True
    report: dict[str, Any] = {"copy_s": round(t1 - t0, 6), "repack_s": round(time.perf_counter() - t1, 6)}
    if stage.plan is not None:
        report.update(stage.plan.report())
    return report


def engine_adler32(t: torch.Tensor) -> str:
    """Adler-32 of what the engine holds, computed where it lives: zlib on the host, torch
    reductions on an accelerator (`device_checksum`), so nothing is copied out of it."""
    return adler32_hex(t) if t.device.type == "cpu" else adler32_device_hex(t)


def proof(
    wmap: WeightMap,
    tensors: list[tuple[str, torch.Tensor]],
    expected_adler32: dict[str, str] | None,
    checked: bool = False,
    kernels: kernel_copies.KernelCopies | None = None,
    host: HostProof | None = None,
) -> tuple[list[str], dict[str, str]]:
    """Read back what the engine holds for ``tensors``: (tensors that differ, Adler-32 of each proven).

    With ``expected_adler32`` covering every tensor, a tensor held whole in its dtype is proven by
    the Adler-32 of the engine's own bytes where they live (on the host each parameter's bytes read
    once, on every core: `WeightMap.host_proof`, `tensors.ChecksumPlan`); others are bit-compared landing by
    landing with the bytes given. Every layer whose ``kernels`` were derived at staging must
    compute with them (`kernel_copies.KernelCopies.differ`: the packs' Adler-32 as vLLM made
    them); every kernel copy rebuilt in the pause (a MoE layer's prepack, a linear layer's packed
    weight: `cpu_gemm.stale`) must be vLLM's packing of what was written, and every replayed
    layer its processing (`WeightMap.unpacked`). ``host``: the host checksums laid out at staging,
    used while every parameter they read is where it was (else laid out again here).
    """
    if not (expected_adler32 and all(n in expected_adler32 for n, _ in tensors)):
        bad = [n for n, t in tensors if not wmap.holds(n, t)]
        return bad + [n for n in _unpacked(wmap, [n for n, _ in tensors], kernels) if n not in bad], {}
    if host is None or not host.current(wmap):
        host = wmap.host_proof(n for n, _ in tensors if not wmap.entry(n).elsewhere)  # another rank proves its experts
    held, bad = _host_proven(host, expected_adler32)
    if host.rest:
        given = dict(tensors)
        for n in host.rest:
            want = expected_adler32[n].lower()
            if _proven_alone(wmap, n, given[n], want, checked):
                held[n] = want
            else:
                bad.append(n)
    for n in _unpacked(wmap, list(held), kernels):
        bad.append(n)
        del held[n]
    return bad, held


def _host_proven(host: HostProof, expected: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """(proven, differing) of the tensors ``host`` sums: each slice's Adler-32 (every core at
    once) against ``expected``, the whole list compared at once (`HostProof.want`, laid out at
    staging) and tensor by tensor only when it differs."""
    names = host.plan.names
    want = host.want if host.want is not None else [int(expected[n], 16) for n in names]
    got = host.plan.values()
    if got == want:
        return {n: expected[n].lower() for n in names}, []
    held: dict[str, str] = {}
    bad: list[str] = []
    for n, g, w in zip(names, got, want, strict=True):
        if g == w:
            held[n] = expected[n].lower()
        else:
            bad.append(n)
    return held, bad


def _unpacked(wmap: WeightMap, names: list[str], kernels: kernel_copies.KernelCopies | None) -> list[str]:
    """Of ``names``, those landing in a layer that does not compute with kernel copies of what
    was written: against those derived at staging, else re-derived (`WeightMap.unpacked`)."""
    if kernels is None:
        return wmap.unpacked(names)
    bad = kernels.differ(wmap, names)
    if not kernels.pending:
        return bad
    seen, given = set(bad), set(names)
    pending = [n for n in kernels.pending if n in given]
    return bad + [n for n in wmap.unpacked(pending, done=kernels.ids()) if n not in seen]


def _proven_alone(wmap: WeightMap, name: str, t: torch.Tensor, want: str, checked: bool) -> bool:
    """:func:`proof` of one tensor not in a host parameter's slices: the Adler-32 of its one
    region or of its assembly on the accelerator, else a bit compare of its landings."""
    whole = wmap.whole(name)
    if whole is None:
        whole = wmap.assembled_on_device(name)
    if whole is not None:
        return engine_adler32(whole) == want
    return (checked or adler32_hex(t) == want) and wmap.holds(name, t)


def commit(wmap: WeightMap, stage: Stage, checksums: bool = True) -> dict[str, Any]:
    """Prove a swapped stage (:func:`proof`). ``{"verified": n, "checksums": {...}, "verify_s"}``
    (``checksums``: each proven tensor's, unless not asked for: the pause's own call leaves out a
    payload of one entry per tensor), or, after rolling back, ``{"read_back_failed": [names],
    "rolled_back": True}``."""
    t0 = time.perf_counter()
    bad, held = proof(wmap, stage.ready(), stage.expected_adler32, stage.checked, stage.kernels, stage.host)
    if bad:
        logger.error("read-back of %s differs for %s; rolling back", stage.label, bad[:8])
        roll_back(wmap, stage)
        return {"read_back_failed": bad, "rolled_back": True}
    stage.kernels = None  # proven: the engine holds them; a roll-back re-derives in place
    result: dict[str, Any] = {"verified": len(stage.tensors), "verify_s": round(time.perf_counter() - t0, 6)}
    if held and checksums:
        result["checksums"] = held
    return result


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """The cyclic garbage collector held off inside the pause's swap and proof, on as before
    after: a stage of tens of thousands of tensors made a collection there cost up to ~50 ms
    (48 x 128 experts in process: the pause's median 94 ms with it, 79 ms without)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class StageSlot:
    """The engine's one stage (module docstring); the methods run on the worker's RPC thread,
    except :meth:`put`, which a stage job calls when its stage is ready."""

    def __init__(self) -> None:
        self.stage: Stage | None = None

    def begin(self) -> None:
        """A new stage is starting: drop one not swapped in; refuse while one is."""
        if self.stage is not None and self.stage.swapped:
            raise RuntimeError(f"the stage {self.stage.label!r} is swapped in: commit or discard it first")
        self.stage = None

    def put(self, stage: Stage) -> None:
        self.stage = stage

    def _get(self, label: str, swapped: bool, held: bool = False) -> Stage:
        stage = self.stage
        if stage is None or stage.label != label:
            have = None if stage is None else stage.label
            raise RuntimeError(f"nothing staged for {label!r} (staged: {have!r})")
        if stage.swapped != swapped:
            raise RuntimeError(f"the stage {label!r} is {'already' if stage.swapped else 'not yet'} swapped in")
        if stage.held != held:
            raise RuntimeError(f"the stage {label!r} is {'already' if stage.held else 'not'} proven and held")
        return stage

    def swap(self, wmap: WeightMap, label: str) -> dict[str, Any]:
        stage = self._get(label, swapped=False)
        try:
            with BACKUP_LOCK, collector_held():
                return swap(wmap, stage)
        except BaseException:
            self.stage = None
            raise

    def commit(self, wmap: WeightMap, label: str, hold: bool = False, checksums: bool = True) -> dict[str, Any]:
        """Prove the swapped stage (:func:`commit`). ``hold``: a proven stage stays swapped in, so
        that :meth:`discard` can still roll it back (another rank of the engine failed its proof)
        until :meth:`release` drops it; a stage that failed is rolled back and dropped either way."""
        stage = self._get(label, swapped=True)
        with BACKUP_LOCK, collector_held():
            result = commit(wmap, stage, checksums)
        if hold and "verified" in result:
            stage.held = True
        else:
            self.stage = None
        return result

    def swap_and_commit(
        self, wmap: WeightMap, label: str, hold: bool = False, checksums: bool = True
    ) -> dict[str, Any]:
        """:meth:`swap` then :meth:`commit` in one call (one RPC inside the pause)."""
        result = self.swap(wmap, label)
        result.update(self.commit(wmap, label, hold, checksums))
        return result

    def release(self, label: str) -> dict[str, Any]:
        """Drop a proven stage held by :meth:`commit` (every rank proved it): it is committed."""
        self._get(label, swapped=True, held=True)
        self.stage = None
        return {"released": label}

    def discard(self, wmap: WeightMap) -> dict[str, Any]:
        stage, self.stage = self.stage, None
        if stage is None:
            return {"discarded": None, "rolled_back": False}
        rolled_back = stage.swapped
        if rolled_back:
            with BACKUP_LOCK:
                roll_back(wmap, stage)
        return {"discarded": stage.label, "rolled_back": rolled_back}
