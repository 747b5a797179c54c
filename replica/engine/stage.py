"""The one lifecycle of a weight update inside the engine: stage -> swap -> commit | discard.

- **stage** (a background job, the engine serving): :func:`take` checks that every tensor loads
  in place byte for byte (`views.check_loadable`: name, shape and dtype equal the parameter's)
  and keeps it with its roll-back copy, either the views given (the agent's host copy in shared
  memory, which holds exactly what the engine serves until the commit) or copies of the engine's
  current values taken now, and with the Adler-32 the commit proves it against.
- **swap** (inside a pause): :func:`swap` loads the staged tensors in place
  (``model.load_weights``; a CPU layer's packed kernel copy is rebuilt, `cpu_gemm`). A failure
  restores the roll-back copies and drops the stage.
- **commit** (inside the same pause, before a token is served on the new weights):
  :func:`commit` reads back what the engine holds (:func:`proof`): against the expected Adler-32
  when they cover every tensor (the snapshot's), else bit for bit against the staged bytes. A
  difference restores the roll-back copies and is answered as ``read_back_failed`` naming the
  tensors; otherwise ``verified`` counts the tensors proven.
- **discard**: drop the stage; a swapped one is rolled back first.

:class:`StageSlot` holds the engine's one stage: a new stage replaces one not yet swapped, and
is refused while one is swapped in (commit or discard it first). Every swap takes the slot's
stage, so a stage's roll-back copy is always of the weights the engine serves.

The roll-back copies taken by the engine live in one host buffer kept across updates (a fresh
allocation of a model's size costs several times the copy itself in page faults), in host memory
even for a GPU engine (a whole model's copy does not fit beside its weights and KV cache);
``BACKUP_LOCK`` keeps a stage from refilling it while a swapped stage may still roll back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from replica.engine import cpu_gemm
from replica.engine.tensors import adler32_hex
from replica.engine.views import View, check_loadable, checkpoint_views

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

    def touched(self, views: dict[str, View]) -> list[torch.nn.Module]:
        return list({id(views[n].module): views[n].module for n, _ in self.tensors}.values())


def _backup_copies(views: dict[str, View], names: list[str]) -> dict[str, torch.Tensor]:
    global _BACKUP_POOL
    sizes = [views[n].tensor.numel() * views[n].tensor.element_size() for n in names]
    total = sum(-(-size // _ALIGN) * _ALIGN for size in sizes)
    if _BACKUP_POOL is None or _BACKUP_POOL.numel() < total:
        _BACKUP_POOL = None  # let the old one go before the new one is allocated
        _BACKUP_POOL = torch.empty(max(total, _ALIGN), dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, size in zip(names, sizes):
        src = views[name].tensor
        dst = _BACKUP_POOL[offset : offset + size].view(src.dtype).reshape(src.shape)
        dst.copy_(src.detach())
        out[name] = dst
        offset += -(-size // _ALIGN) * _ALIGN
    return out


def take(
    model: torch.nn.Module, label: str, tensors: list[tuple[str, torch.Tensor]],
    backup: dict[str, torch.Tensor] | None = None, expected_adler32: dict[str, str] | None = None,
) -> Stage:
    """Check that ``tensors`` load into ``model`` and keep them with their roll-back copies (the
    given ``backup``, views of bytes equal to what the engine serves, else copies taken now) and
    the Adler-32 the commit proves them against."""
    views = check_loadable(model, tensors)
    if backup is None:
        with BACKUP_LOCK:
            backup = _backup_copies(views, [n for n, _ in tensors])
    expected = None if expected_adler32 is None else {n: c.lower() for n, c in expected_adler32.items()}
    return Stage(label, tensors, backup, expected)


def roll_back(model: torch.nn.Module, stage: Stage) -> None:
    """Put the stage's roll-back copies back into the engine."""
    with torch.no_grad():
        views, _ = checkpoint_views(model)
        for n, old in stage.backup.items():
            views[n].tensor.copy_(old)
        for module in stage.touched(views):
            cpu_gemm.redispatch(module)
    stage.swapped = False


def swap(model: torch.nn.Module, stage: Stage) -> dict[str, Any]:
    """Load the stage in place; on any failure restore the roll-back copies and raise."""
    t0 = time.perf_counter()
    views = check_loadable(model, stage.tensors)
    try:
        with torch.no_grad():
            model.load_weights(iter(stage.tensors))  # type: ignore[operator]
            t1 = time.perf_counter()
            for module in stage.touched(views):
                cpu_gemm.redispatch(module)
    except BaseException:
        logger.exception("swap of %s failed; restoring the previous values", stage.label)
        roll_back(model, stage)
        raise
    stage.swapped = True
    return {"copy_s": round(t1 - t0, 6), "repack_s": round(time.perf_counter() - t1, 6)}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` holds exactly ``b``'s bytes (same dtype and shape; no conversion)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    b = b.to(a.device)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def proof(views: dict[str, View], tensors: list[tuple[str, torch.Tensor]],
          expected_adler32: dict[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """Read back what the engine holds for ``tensors``: (tensors that differ, Adler-32 of each
    tensor proven by it).

    With ``expected_adler32`` covering every tensor, each is proven against it: by the Adler-32
    of the engine's own bytes when they live in host memory, else by the Adler-32 of the bytes
    given plus a bit compare of the engine's copy with them. Without it, the engine's bytes are
    bit-compared with the bytes given."""
    missing = [n for n, _ in tensors if n not in views]
    present = [(n, t) for n, t in tensors if n in views]
    if not (expected_adler32 and all(n in expected_adler32 for n, _ in tensors)):
        return missing + [n for n, t in present if not _same_bits(views[n].tensor, t)], {}
    held: dict[str, str] = {}
    bad: list[str] = list(missing)
    for n, t in present:
        want = expected_adler32[n].lower()
        engine_t = views[n].tensor
        if engine_t.device.type == "cpu":
            ok = engine_t.dtype == t.dtype and adler32_hex(engine_t) == want
        else:
            ok = adler32_hex(t) == want and _same_bits(engine_t, t)
        if ok:
            held[n] = want
        else:
            bad.append(n)
    return bad, held


def commit(model: torch.nn.Module, stage: Stage) -> dict[str, Any]:
    """Prove a swapped stage (:func:`proof`, on parameters resolved again: a loader may replace
    a parameter object). ``{"verified": n, "checksums": {...}, "verify_s"}``, or, after rolling
    back, ``{"read_back_failed": [names], "rolled_back": True}``."""
    t0 = time.perf_counter()
    views, _ = checkpoint_views(model)
    bad, held = proof(views, stage.tensors, stage.expected_adler32)
    if bad:
        logger.error("read-back of %s differs for %s; rolling back", stage.label, bad[:8])
        roll_back(model, stage)
        return {"read_back_failed": bad, "rolled_back": True}
    result: dict[str, Any] = {"verified": len(stage.tensors), "verify_s": round(time.perf_counter() - t0, 6)}
    if held:
        result["checksums"] = held
    return result


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

    def _get(self, label: str, swapped: bool) -> Stage:
        stage = self.stage
        if stage is None or stage.label != label:
            have = None if stage is None else stage.label
            raise RuntimeError(f"nothing staged for {label!r} (staged: {have!r})")
        if stage.swapped != swapped:
            raise RuntimeError(f"the stage {label!r} is {'already' if stage.swapped else 'not yet'} swapped in")
        return stage

    def swap(self, model: torch.nn.Module, label: str) -> dict[str, Any]:
        stage = self._get(label, swapped=False)
        try:
            with BACKUP_LOCK:
                return swap(model, stage)
        except BaseException:
            self.stage = None
            raise

    def commit(self, model: torch.nn.Module, label: str) -> dict[str, Any]:
        stage = self._get(label, swapped=True)
        self.stage = None
        with BACKUP_LOCK:
            return commit(model, stage)

    def swap_and_commit(self, model: torch.nn.Module, label: str) -> dict[str, Any]:
        """:meth:`swap` then :meth:`commit` in one call (one RPC inside the pause)."""
        result = self.swap(model, label)
        result.update(self.commit(model, label))
        return result

    def discard(self, model: torch.nn.Module) -> dict[str, Any]:
        stage, self.stage = self.stage, None
        if stage is None:
            return {"discarded": None, "rolled_back": False}
        rolled_back = stage.swapped
        if rolled_back:
            with BACKUP_LOCK:
                roll_back(model, stage)
        return {"discarded": stage.label, "rolled_back": rolled_back}
