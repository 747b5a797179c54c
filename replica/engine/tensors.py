"""Tensors as bytes: the one dtype table, the one checksum helper, and transfer specs.

A tensor's checksum is the Adler-32 of its raw row-major bytes, 8 lowercase hex digits, the
snapshot format's (zlib-ng's SIMD one when installed, as `snapshots.codec` picks it). This module
imports torch and the standard library only, so the engine's stage, swap and proof
(`bench/gpu_hotload.py`) run on a machine with torch alone. A spec is
``[name, dtype, shape]`` with the dtype as ``"bfloat16"``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

try:  # zlib-ng's SIMD Adler-32 (~6x zlib's here), same values; not snapshots.codec: no zstd needed
    from zlib_ng.zlib_ng import adler32
except ImportError:  # pragma: no cover - a machine with torch alone
    from zlib import adler32

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "f16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "f32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "f64": torch.float64,
    "int8": torch.int8,
    "i8": torch.int8,
    "uint8": torch.uint8,
    "u8": torch.uint8,
    "int32": torch.int32,
    "i32": torch.int32,
    "int64": torch.int64,
    "i64": torch.int64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "f8_e4m3": torch.float8_e4m3fn,
}


def dtype_from_str(name: str) -> torch.dtype:
    key = name.lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}")
    return DTYPES[key]


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def row_major_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides, in elements, of a contiguous (row-major) tensor of ``shape``."""
    stride, out = 1, []
    for s in reversed(shape):
        out.append(stride)
        stride *= s
    return tuple(reversed(out))


_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as integers of the same width: equal exactly when the bits are."""
    return t.view(_INT[t.element_size()])


def flat_cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors``' elements one after the other, flat: concatenated along their first dimension
    when they share the others (a fused parameter's experts: no view made per tensor), else
    each flattened first."""
    rest = tensors[0].shape[1:]
    if all(t.dim() and t.shape[1:] == rest for t in tensors):
        return torch.cat(tensors).view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize  # (not a tensor made per call: this runs once per tensor of a stage)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of ``t`` (row-major), as safetensors stores them."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def adler32_hex(t: torch.Tensor) -> str:
    """Adler-32 of the tensor's raw bytes, 8 lowercase hex digits (the snapshot format's)."""
    return "%08x" % (adler32(tensor_bytes(t)) & 0xFFFFFFFF)


def adler32_slices(data: memoryview, slices: Iterable[tuple[str, int, int]]) -> Iterator[tuple[str, str]]:
    """``(name, Adler-32)`` of each ``data[first:end]`` slice, 8 lowercase hex digits: one C call
    per slice on one buffer (a fused expert parameter's tensors), equal to :func:`adler32_hex`
    of each tensor whose raw bytes the slice is."""
    for name, first, end in slices:
        yield name, "%08x" % (adler32(data[first:end]) & 0xFFFFFFFF)


ADLER_BASE = 65521
# The proof's Adler-32 on the host runs on this many threads (zlib and zlib-ng release the GIL
# over a buffer), over pieces of at most PIECE_BYTES of each slice, combined in order.
CHECKSUM_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
PIECE_BYTES = 16 << 20
_POOL: ThreadPoolExecutor | None = None


def adler32_combine(first: int, second: int, second_len: int) -> int:
    """The Adler-32 of bytes A then B from A's, B's and B's length (zlib's ``adler32_combine``):
    B's running sums restart at 1, so each of its ``second_len`` steps lacks A's sum minus 1."""
    a1, b1, a2, b2 = first & 0xFFFF, first >> 16, second & 0xFFFF, second >> 16
    a = (a1 + a2 - 1) % ADLER_BASE
    b = (b1 + b2 + second_len * (a1 - 1)) % ADLER_BASE
    return (b << 16) | a


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=CHECKSUM_THREADS, thread_name_prefix="adler32")
    return _POOL


class ChecksumPlan:
    """``{name: Adler-32}`` of every ``data[first:end]`` slice of every group, as
    :func:`adler32_slices` gives them, on every core of the process: laid out once (a stage lays
    its proof out before the pause) and :meth:`run` as often as needed: each slice cut into pieces of at most
    ``PIECE_BYTES``, the pieces summed in tasks of about that many bytes (many small slices one
    task: a task per slice would cost more than its sum) on ``CHECKSUM_THREADS`` threads, and
    combined in order (:func:`adler32_combine`). The bytes are read when it runs, not before."""

    def __init__(self, groups: Iterable[tuple[memoryview, Sequence[tuple[str, int, int]]]]) -> None:
        self.names: list[str] = []
        self.pieces: list[tuple[int, memoryview, int, int]] = []  # (slice index, bytes, first, end)
        for data, slices in groups:
            for name, first, end in slices:
                self.names.append(name)
                if end - first <= PIECE_BYTES:
                    self.pieces.append((len(self.names) - 1, data, first, end))
                else:
                    starts = range(first, end, PIECE_BYTES)
                    self.pieces.extend((len(self.names) - 1, data, a, min(a + PIECE_BYTES, end)) for a in starts)
        self.batches = list(_batches(self.pieces))

    def run(self) -> dict[str, str]:
        """``{name: Adler-32}`` of every slice, as its bytes are now."""
        return {name: "%08x" % value for name, value in zip(self.names, self.values())}

    def values(self) -> list[int]:
        """The Adler-32 of every slice as an int, in :attr:`names` order (what :meth:`run` gives
        without a string per slice: a proof compares the whole list at once)."""
        if CHECKSUM_THREADS > 1 and len(self.batches) > 1:
            sums = [v for part in _pool().map(_summed, self.batches) for v in part]
        else:
            sums = [v for batch in self.batches for v in _summed(batch)]
        if len(sums) == len(self.names):  # every slice one piece: the sums are the slices'
            return sums
        out: list[int | None] = [None] * len(self.names)
        for (index, _, first, end), value in zip(self.pieces, sums, strict=True):
            held = out[index]
            out[index] = value if held is None else adler32_combine(held, value, end - first)
        return [value or 0 for value in out]


def _summed(batch: list[tuple[int, memoryview, int, int]]) -> list[int]:
    return [adler32(data[first:end]) & 0xFFFFFFFF for _, data, first, end in batch]


def _batches(pieces: list[tuple[int, memoryview, int, int]]) -> Iterator[list[tuple[int, memoryview, int, int]]]:
    """``pieces`` in order, cut into runs of about ``PIECE_BYTES`` (one task each)."""
    batch: list[tuple[int, memoryview, int, int]] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += piece[3] - piece[2]
        if size >= PIECE_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def sha256_hex(t: torch.Tensor) -> str:
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


ALGORITHMS = {"adler32": adler32_hex, "sha256": sha256_hex}


def check_expected(tensors: list[tuple[str, torch.Tensor]], expected: dict[str, str] | None) -> None:
    """Compare each tensor's Adler-32 with ``expected`` (name -> 8 hex digits); ValueError naming
    every tensor that differs or is missing. Called before anything changes."""
    if not expected:
        return
    have = dict(tensors)
    missing = sorted(set(expected) - have.keys())
    bad = [
        f"{n}: adler32 {adler32_hex(t)} != expected {expected[n].lower()}"
        for n, t in tensors
        if n in expected and adler32_hex(t) != expected[n].lower()
    ]
    if missing or bad:
        raise ValueError(
            "checksum check failed, nothing loaded: "
            + "; ".join(bad[:8] + [f"{n}: expected but not given" for n in missing[:8]])
        )


def spec_of(name: str, t: torch.Tensor) -> list[Any]:
    return [name, dtype_to_str(t.dtype), list(t.shape)]


def normalize_specs(specs: Iterable[Sequence[Any]]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    out = []
    for spec in specs:
        name, dtype, shape = spec
        out.append((str(name), dtype_from_str(str(dtype)), tuple(int(s) for s in shape)))
    return out
