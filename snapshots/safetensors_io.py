"""Strict safetensors header parsing, tensor reads, and a streaming writer.

A safetensors file is ``u64 little-endian N`` + ``N`` bytes of JSON header + the data area. The
header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (relative
to the data area) and may hold a ``__metadata__`` object of string -> string.

:func:`parse_header` trusts nothing: the header length must fit in the file (and under 100 MiB,
the reference implementation's cap), the JSON must be an object, every dtype must be known,
every shape a list of non-negative ints, ``end - begin`` must equal ``prod(shape) * itemsize``,
no tensor may run past the end of the file, and no two tensors may overlap. Errors are
:class:`~snapshots.errors.HeaderError` naming the file and, where it applies, the tensor.

Offsets in :class:`TensorEntry` are *absolute* file offsets, so callers read
``[begin, end)`` of the file directly (``os.pread``/``readinto`` locally, a ranged GET on S3).
Sub-byte dtypes (``F4``, ``F6_*``) are not supported: no checkpoint the service serves uses them
and their byte sizes are not ``prod(shape) * itemsize``.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import IO, Any, TypeGuard

import numpy as np

from snapshots.errors import HeaderError, SnapshotError

METADATA_KEY = "__metadata__"
#: The reference implementation refuses larger headers; so do we, before allocating one.
MAX_HEADER_BYTES = 100 * 2**20
#: Bytes fetched up front when the header is read remotely: most headers fit, saving a round trip.
HEADER_PROBE_BYTES = 64 * 2**10

DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file; ``begin``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated safetensors header."""

    file: str
    tensors: dict[str, TensorEntry]  # in header order
    metadata: dict[str, str]
    data_start: int  # absolute offset of the data area (8 + header length)
    file_size: int

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.tensors[name]
        except KeyError:
            raise HeaderError("tensor is not in this file", file=self.file, tensor=name) from None


def header_length(prefix: bytes, file_size: int, file: str) -> int:
    """The JSON header length from the first 8 bytes, checked against the file size."""
    if file_size < 8 or len(prefix) < 8:
        raise HeaderError(f"truncated: {file_size} bytes is too short for a safetensors file", file=file)
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {length} exceeds the {MAX_HEADER_BYTES}-byte cap", file=file)
    if 8 + length > file_size:
        raise HeaderError(f"header length {length} runs past the end of the file ({file_size} bytes)", file=file)
    return length


def parse_json_object(body: bytes, what: str, error: type[SnapshotError], file: str) -> dict[str, Any]:
    """``body`` as a JSON object; else ``error`` naming ``what`` ("header", "index") and ``file``."""
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise error(f"{what} is not valid JSON ({exc})", file=file) from exc
    if not isinstance(raw, dict):
        raise error(f"{what} is not a JSON object", file=file)
    return raw


def _is_shape(shape: Any) -> TypeGuard[list[int]]:
    """A list of non-negative ints (a bool is not one): one dimension checked without a generator."""
    if type(shape) is not list:
        return False
    if len(shape) == 1:
        return type(shape[0]) is int and shape[0] >= 0
    return all(type(d) is int and d >= 0 for d in shape)


def _is_offset_pair(begin: Any, end: Any) -> bool:
    return type(begin) is int and type(end) is int and 0 <= begin <= end


def parse_header(header_bytes: bytes, file_size: int, file: str) -> SafetensorsHeader:
    """Validate the JSON header of a file of ``file_size`` bytes (see the module docstring)."""
    data_start = 8 + len(header_bytes)
    raw = parse_json_object(header_bytes, "header", HeaderError, file)
    metadata_raw = raw.get(METADATA_KEY) or {}
    if not isinstance(metadata_raw, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata_raw.items()
    ):
        raise HeaderError("__metadata__ must map strings to strings", file=file)
    data_size = file_size - data_start
    tensors: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        if name == METADATA_KEY:
            continue
        if type(info) is not dict:  # (JSON objects decode as dict itself)
            raise HeaderError("entry is not an object", file=file, tensor=name)
        dtype = info.get("dtype")
        if type(dtype) is not str or dtype not in DTYPE_SIZES:
            raise HeaderError(f"unknown dtype {dtype!r}", file=file, tensor=name)
        width = DTYPE_SIZES[dtype]
        shape = info.get("shape")
        if not _is_shape(shape):
            raise HeaderError(f"shape {shape!r} is not a list of non-negative ints", file=file, tensor=name)
        offsets = info.get("data_offsets")
        if not (type(offsets) is list and len(offsets) == 2 and _is_offset_pair(offsets[0], offsets[1])):
            raise HeaderError(
                f"data_offsets {offsets!r} are not [begin, end] with 0 <= begin <= end", file=file, tensor=name
            )
        begin, end = offsets
        expected = (shape[0] if len(shape) == 1 else math.prod(shape)) * width
        if end - begin != expected:
            raise HeaderError(
                f"data_offsets span {end - begin} bytes but {dtype}{shape} needs {expected}",
                file=file,
                tensor=name,
            )
        if end > data_size:
            raise HeaderError(
                f"data ends at byte {data_start + end} but the file has {file_size} bytes (truncated shard?)",
                file=file,
                tensor=name,
            )
        tensors[name] = TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end)
    spans = sorted((t for t in tensors.values() if t.end > t.begin), key=attrgetter("begin"))
    for prev, nxt in zip(spans, spans[1:]):
        if nxt.begin < prev.end:
            raise HeaderError(
                f"data overlaps tensor {prev.name!r} ([{prev.begin}, {prev.end}) and [{nxt.begin}, {nxt.end}))",
                file=file,
                tensor=nxt.name,
            )
    return SafetensorsHeader(file, tensors, dict(metadata_raw), data_start, file_size)


def read_header_from(read_range: Any, file_size: int, file: str) -> SafetensorsHeader:
    """Read and validate a header with ``read_range(offset, length) -> bytes`` (one or two reads)."""
    probe = read_range(0, min(file_size, HEADER_PROBE_BYTES))
    length = header_length(probe, file_size, file)
    if 8 + length <= len(probe):
        header_bytes = probe[8 : 8 + length]
    else:
        header_bytes = probe[8:] + read_range(len(probe), 8 + length - len(probe))
    if len(header_bytes) != length:
        raise HeaderError("truncated while reading the header", file=file)
    return parse_header(header_bytes, file_size, file)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of a local safetensors file."""
    path = Path(path)
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            return read_header_from(lambda off, n: os.pread(f.fileno(), n, off), size, str(path))
    except OSError as exc:
        raise HeaderError(f"cannot read: {exc.strerror}", file=str(path)) from exc


def list_tensors(path: str | os.PathLike[str]) -> list[TensorEntry]:
    """Every tensor of a local safetensors file: name, dtype, shape, absolute byte range."""
    return list(read_header(path).tensors.values())


def readinto_exact(f: IO[bytes] | int, offset: int, out: memoryview | np.ndarray) -> None:
    """Fill ``out`` from file ``f`` at ``offset`` (no intermediate copy), or raise on a short read."""
    fd = f if isinstance(f, int) else f.fileno()
    view = memoryview(out).cast("B")  # type: ignore[arg-type]  # numpy types __buffer__ from Python 3.12 only
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise HeaderError(f"short read at byte {offset + done}")
        done += n


def read_tensor_bytes(path: str | os.PathLike[str], entry: TensorEntry, out: np.ndarray | None = None) -> np.ndarray:
    """The raw bytes of one tensor as a ``uint8`` array (into ``out`` when given)."""
    buf = np.empty(entry.nbytes, dtype=np.uint8) if out is None else out
    if buf.nbytes != entry.nbytes:
        raise HeaderError(
            f"output buffer holds {buf.nbytes} bytes, tensor has {entry.nbytes}",
            file=str(path),
            tensor=entry.name,
        )
    with open(path, "rb", buffering=0) as f:
        try:
            readinto_exact(f, entry.begin, buf)
        except HeaderError as exc:
            raise HeaderError(exc.detail, file=str(path), tensor=entry.name) from None
    return buf


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: its dtype, shape, and raw bytes (any C-contiguous buffer)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: Any  # bytes-like; len(memoryview(data).cast("B")) == nbytes


def encode_header(entries: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: Mapping[str, str]) -> bytes:
    """``u64 length`` + JSON header for ``(name, dtype, shape, nbytes)`` packed in order.

    The JSON is padded with spaces to 8-byte alignment, as the reference writer does, so the
    data area (and every tensor whose offset is aligned) is aligned for zero-copy views.
    """
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = dict(metadata)
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def write_safetensors(
    path: str | os.PathLike[str], tensors: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``tensors`` in order as one safetensors file; returns the file size.

    Data is streamed from each tensor's buffer (no concatenated copy of the file in memory).
    """
    specs = list(tensors)
    views = []
    for spec in specs:
        view = (
            memoryview(spec.data).cast("B")
            if not isinstance(spec.data, np.ndarray)
            else np.ascontiguousarray(spec.data).reshape(-1).view(np.uint8).data
        )
        expected = math.prod(spec.shape) * DTYPE_SIZES[spec.dtype]
        if len(view) != expected:
            raise HeaderError(
                f"{len(view)} bytes given for {spec.dtype}{list(spec.shape)} ({expected} needed)",
                file=str(path),
                tensor=spec.name,
            )
        views.append(view)
    head = encode_header(((s.name, s.dtype, s.shape, len(v)) for s, v in zip(specs, views)), metadata or {})
    with open(path, "wb") as f:
        f.write(head)
        for view in views:
            f.write(view)
    return len(head) + sum(len(v) for v in views)


__all__ = [
    "DTYPE_SIZES",
    "METADATA_KEY",
    "SafetensorsHeader",
    "TensorEntry",
    "TensorSpec",
    "encode_header",
    "header_length",
    "list_tensors",
    "parse_header",
    "parse_json_object",
    "read_header",
    "read_header_from",
    "read_tensor_bytes",
    "readinto_exact",
    "write_safetensors",
]
