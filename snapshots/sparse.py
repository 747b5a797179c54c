"""Sparse deltas: only the changed elements of each tensor, as indices and values, the way trainers
that sync changed elements publish them (layout: docs/wire.md, "Sparse deltas").

Chain rules, Adler-32 proofs and replay are the same as an XOR delta's; only how the new bytes
are made differs. This module depends on no other snapshot module's types: :func:`pairs`
validates the layout from the index and shard headers, :func:`check_size` bounds what will be
read before it is, :func:`read` reads and checks (:func:`decode`) one tensor's indices and
values, and :func:`scatter` writes them into a flat buffer, returning the old values for undo.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from snapshots.errors import ChecksumError, DeltaMismatchError, HeaderError, LayoutError
from snapshots.safetensors_io import DTYPE_SIZES, SafetensorsHeader

SPARSE = "sparse"
INDICES, VALUES = ".indices", ".values"
INDEX_DTYPES: dict[str, np.dtype[np.signedinteger]] = {"I32": np.dtype("<i4"), "I64": np.dtype("<i8")}
UINTS: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}  # an element's bytes, by width
_HEX = set("0123456789abcdefABCDEF")


@dataclass(frozen=True)
class Part:
    """Where one half of a sparse tensor is: shard, absolute byte range, dtype, element count."""

    file: str  # the shard's name in the snapshot
    begin: int
    end: int
    dtype: str
    count: int


@dataclass(frozen=True)
class SparseTensor:
    name: str
    indices: Part
    values: Part
    checksum: str  # 8 lowercase hex digits: the whole new tensor's Adler-32


def pairs(weight_map: Mapping[str, str], headers: Mapping[str, SafetensorsHeader]) -> dict[str, SparseTensor]:
    """The changed tensors of a sparse delta, validated (module docstring)."""
    halves: dict[str, dict[str, str]] = {}
    for key, shard in weight_map.items():
        if key.endswith(INDICES):
            halves.setdefault(key[: -len(INDICES)], {})[INDICES] = shard
        elif key.endswith(VALUES):
            halves.setdefault(key[: -len(VALUES)], {})[VALUES] = shard
        else:
            raise LayoutError(
                f"a sparse delta holds only NAME{INDICES} and NAME{VALUES} tensors",
                file=headers[shard].file,
                tensor=key,
            )
    out: dict[str, SparseTensor] = {}
    for name, where in halves.items():
        for half in (INDICES, VALUES):
            if half not in where:
                other = next(iter(where.values()))
                raise LayoutError(
                    f"has no {name}{half} beside it",
                    file=headers[other].file,
                    tensor=name + (VALUES if half == INDICES else INDICES),
                )
        parts = {half: _part(where[half], headers[where[half]], name + half) for half in (INDICES, VALUES)}
        indices, values = parts[INDICES], parts[VALUES]
        if indices.dtype not in INDEX_DTYPES:
            raise HeaderError(
                f"indices must be I32 or I64, got {indices.dtype}",
                file=headers[indices.file].file,
                tensor=name + INDICES,
            )
        if values.dtype == "BOOL":
            raise HeaderError("values must be numbers, got BOOL", file=headers[values.file].file, tensor=name + VALUES)
        if indices.count != values.count:
            raise HeaderError(
                f"{indices.count} indices but {values.count} values", file=headers[values.file].file, tensor=name
            )
        header = headers[where[VALUES]]
        checksum = header.metadata.get(name)
        if checksum is None:
            raise ChecksumError("no Adler-32 checksum for this tensor in __metadata__", file=header.file, tensor=name)
        if len(checksum) != 8 or not set(checksum) <= _HEX:
            raise ChecksumError(f"checksum {checksum!r} is not 8 hex digits", file=header.file, tensor=name)
        out[name] = SparseTensor(name, indices, values, checksum.lower())
    return out


def _part(shard: str, header: SafetensorsHeader, key: str) -> Part:
    entry = header.tensors.get(key)
    if entry is None:
        raise LayoutError("weight_map names this tensor but the shard does not hold it", file=header.file, tensor=key)
    if len(entry.shape) != 1:
        raise HeaderError(f"must be 1-D, got shape {list(entry.shape)}", file=header.file, tensor=key)
    return Part(shard, entry.begin, entry.end, entry.dtype, int(entry.shape[0]))


def element_size(values_dtype: str) -> int:
    return DTYPE_SIZES[values_dtype]


def check_size(values: Part, nbytes: int, dtype: str | None, *, file: str | None, tensor: str) -> None:
    """Before anything is read: the values' dtype is the base tensor's (when it is known), and
    there are no more of them than the tensor has elements."""
    size = element_size(values.dtype)
    if dtype is not None and dtype != values.dtype:
        raise DeltaMismatchError(f"values are {values.dtype} but the base tensor is {dtype}", file=file, tensor=tensor)
    if nbytes % size:
        raise DeltaMismatchError(
            f"values are {values.dtype} ({size} bytes) but the base tensor's {nbytes} bytes "
            f"are not a whole number of them",
            file=file,
            tensor=tensor,
        )
    if values.count > nbytes // size:
        raise DeltaMismatchError(
            f"{values.count} changed elements, more than the base tensor's {nbytes // size}", file=file, tensor=tensor
        )


def read(source: Any, item: SparseTensor, nbytes: int, *, file: str | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`decode` of ``item``'s indices and values, read from ``source`` (a snapshot source:
    ``read_range(shard, offset, length)``)."""
    index_bytes = source.read_range(item.indices.file, item.indices.begin, item.indices.end - item.indices.begin)
    value_bytes = source.read_range(item.values.file, item.values.begin, item.values.end - item.values.begin)
    return decode(index_bytes, value_bytes, item, nbytes, file=file)


def decode(
    index_bytes: bytes, value_bytes: bytes, item: SparseTensor, nbytes: int, *, file: str | None
) -> tuple[np.ndarray, np.ndarray]:
    """(positions as int64, values as unsigned integers of the element's width), checked: as
    many of each as the header says, positions strictly increasing and inside the tensor."""
    size = element_size(item.values.dtype)
    if len(index_bytes) != item.indices.end - item.indices.begin or len(value_bytes) != item.values.count * size:
        raise DeltaMismatchError("indices or values are truncated", file=file, tensor=item.name)
    positions = np.frombuffer(index_bytes, dtype=INDEX_DTYPES[item.indices.dtype]).astype(np.int64)
    values = np.frombuffer(value_bytes, dtype=UINTS[size])
    if positions.size:
        if positions[0] < 0 or positions[-1] >= nbytes // size:
            raise DeltaMismatchError(
                f"an index is outside the tensor's {nbytes // size} elements "
                f"(indices run {positions[0]}..{positions[-1]})",
                file=file,
                tensor=item.name,
            )
        if positions.size > 1 and not bool(np.all(positions[1:] > positions[:-1])):
            raise DeltaMismatchError("indices are not strictly increasing", file=file, tensor=item.name)
    return positions, values


def scatter(target: np.ndarray, positions: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Write ``values`` at ``positions`` of the flat byte buffer ``target`` (in elements of the
    values' width); returns what was there (pass it back to undo)."""
    view = target.view(values.dtype)
    old = view[positions].copy()
    view[positions] = values
    return old


def scatter_chunk(data: np.ndarray, start: int, positions: np.ndarray, values: np.ndarray) -> None:
    """:func:`scatter` into ``data``, the bytes ``[start, start + len(data))`` of the tensor
    (``start`` and the length multiples of the element width)."""
    size = values.dtype.itemsize
    lo, hi = np.searchsorted(positions, [start // size, (start + len(data)) // size])
    if hi > lo:
        data.view(values.dtype)[positions[lo:hi] - start // size] = values[lo:hi]


__all__ = [
    "INDEX_DTYPES",
    "INDICES",
    "Part",
    "SPARSE",
    "SparseTensor",
    "UINTS",
    "VALUES",
    "check_size",
    "decode",
    "element_size",
    "pairs",
    "read",
    "scatter",
    "scatter_chunk",
]
