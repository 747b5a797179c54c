"""Writers: deltas between two full checkpoints, and checksummed full snapshots.

:func:`write_delta` writes exactly the layout slime and cwtrain write and the service reads
(docs/design.md, "The snapshot format"): zstd level 1 frames of ``new XOR base`` for the changed
tensors only, shards of at most ``shard_bytes``, each new tensor's Adler-32 recorded. Both
checkpoints must hold the same names, dtypes and shapes; an empty delta is reported
(``DeltaStats.changed == 0``), never written. It streams (memory: a few tensors plus one shard).
:func:`write_full_snapshot` writes a state dict or re-writes a checkpoint with every tensor's
Adler-32, like cwtrain's ``write_full_snapshot``.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from snapshots.codec import adler32_hex, default_workers
from snapshots.errors import DeltaMismatchError, SnapshotError
from snapshots.host import HostWeights
from snapshots.inspect import CONFIG_FILE, INDEX_FILE, FullLayout, read_full_layout
from snapshots.replace import replacing_directory
from snapshots.safetensors_io import DTYPE_SIZES, TensorSpec, write_safetensors
from snapshots.storage import LocalSource

SHARD_TARGET_BYTES = 2 * 2**30
FULL_SHARD_TARGET_BYTES = 5 * 2**30
ZSTD_LEVEL = 1


@dataclass
class DeltaStats:
    """What :func:`write_delta` produced. ``changed == 0`` means nothing was written."""

    path: str
    version: str
    base_version: str
    tensors_total: int = 0
    changed: int = 0  # tensors whose bytes differ
    bytes_total: int = 0  # raw bytes of all tensors
    bytes_changed: int = 0  # raw bytes of the changed tensors
    wire_bytes: int = 0  # compressed frame bytes (what travels)
    shards: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.changed == 0

    @property
    def ratio(self) -> float:
        """Wire bytes as a fraction of the full checkpoint's tensor bytes."""
        return self.wire_bytes / self.bytes_total if self.bytes_total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": round(self.ratio, 6), "empty": self.is_empty}


class _MappedCheckpoint:
    """Read-only memory maps of a local full checkpoint's shards, with a view per tensor."""

    def __init__(self, layout: FullLayout) -> None:
        if not isinstance(layout.source, LocalSource):
            raise SnapshotError("write_delta reads local checkpoint directories", file=layout.source.uri)
        self.layout = layout
        self._maps: list[mmap.mmap] = []
        self.views: dict[str, np.ndarray] = {}
        arrays: dict[str, np.ndarray] = {}
        for shard in layout.index.shards:
            with open(layout.source.path(shard), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
            if m is not None:
                self._maps.append(m)
                arrays[shard] = np.frombuffer(m, dtype=np.uint8)
            else:
                arrays[shard] = np.empty(0, dtype=np.uint8)
        for name, (shard, entry) in layout.tensors.items():
            self.views[name] = arrays[shard][entry.begin : entry.end]

    def close(self) -> None:
        self.views.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still referenced somewhere; the GC will unmap it
                pass


class _WriterThread(threading.local):
    def __init__(self) -> None:
        self.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.scratch = np.empty(0, dtype=np.uint8)

    def buffer(self, nbytes: int) -> np.ndarray:
        if self.scratch.nbytes < nbytes:
            self.scratch = np.empty(nbytes, dtype=np.uint8)
        return self.scratch[:nbytes]


_thread = _WriterThread()


def _check_same_layout(base: FullLayout, new: FullLayout) -> None:
    names_base, names_new = set(base.tensors), set(new.tensors)
    only_base, only_new = sorted(names_base - names_new), sorted(names_new - names_base)
    if only_base:
        raise DeltaMismatchError(
            f"is in the base but not in the new checkpoint ({len(only_base)} such tensors)",
            file=new.source.uri,
            tensor=only_base[0],
        )
    if only_new:
        raise DeltaMismatchError(
            f"is in the new checkpoint but not in the base ({len(only_new)} such tensors)",
            file=new.source.uri,
            tensor=only_new[0],
        )
    for name, (shard, entry) in new.tensors.items():
        _, old = base.tensors[name]
        if (old.dtype, old.shape) != (entry.dtype, entry.shape):
            raise DeltaMismatchError(
                f"dtype/shape changed: base {old.dtype}{list(old.shape)}, new {entry.dtype}{list(entry.shape)}",
                file=new.source.describe(shard),
                tensor=name,
            )


_Diff = tuple[str, bytes | None, str, int]


def _diff_tensor(base_map: _MappedCheckpoint, new_map: _MappedCheckpoint, name: str) -> _Diff:
    """One tensor's (name, zstd frame of new XOR base, Adler-32 of new, raw bytes); the frame is
    None when the bytes are the same (or the tensor is empty)."""
    old_bytes, new_bytes = base_map.views[name], new_map.views[name]
    if old_bytes.nbytes == 0:
        return name, None, "", 0
    xor = _thread.buffer(new_bytes.nbytes)
    np.bitwise_xor(new_bytes, old_bytes, out=xor)
    if not xor.any():
        return name, None, "", 0
    frame = _thread.cctx.compress(xor.data)
    return name, frame, adler32_hex(new_bytes), new_bytes.nbytes


def _diffs_in_order(
    pool: ThreadPoolExecutor, names: list[str], workers: int, diff: Callable[[str], _Diff]
) -> Iterator[_Diff]:
    """``diff`` of every name, in order, with at most ``2 * workers`` in flight (bounded memory)."""
    pending_names = iter(names)
    inflight: deque[Future[_Diff]] = deque()
    for name in pending_names:
        inflight.append(pool.submit(diff, name))
        if len(inflight) >= 2 * workers:
            break
    while inflight:
        done = inflight.popleft().result()
        following = next(pending_names, None)
        if following is not None:
            inflight.append(pool.submit(diff, following))
        yield done


class _ShardWriter:
    """Frames gathered into part files of at most ``shard_bytes`` (a larger frame alone) under
    ``tmp``; the final names need the shard count, known only at the end (:meth:`finish`)."""

    def __init__(self, tmp: Path, shard_bytes: int) -> None:
        self.tmp, self.shard_bytes = tmp, shard_bytes
        self.parts: list[tuple[str, list[str]]] = []
        self.pending: dict[str, bytes] = {}
        self.digests: dict[str, str] = {}
        self.pending_bytes = 0

    def add(self, name: str, frame: bytes, digest: str) -> None:
        if self.pending and self.pending_bytes + len(frame) > self.shard_bytes:
            self.flush()
        self.pending[name] = frame
        self.digests[name] = digest
        self.pending_bytes += len(frame)

    def flush(self) -> None:
        if not self.pending:
            return
        self.tmp.mkdir(parents=True, exist_ok=True)
        part = f"part-{len(self.parts):05d}.safetensors"
        write_safetensors(
            self.tmp / part,
            (TensorSpec(n, "U8", (len(f),), f) for n, f in self.pending.items()),
            self.digests,
        )
        self.parts.append((part, list(self.pending)))
        self.pending, self.digests, self.pending_bytes = {}, {}, 0

    def finish(self) -> tuple[list[str], dict[str, str]]:
        """Rename the parts to ``model-{i}-of-{n}``; returns the shard names and the weight map."""
        shards: list[str] = []
        weight_map: dict[str, str] = {}
        for i, (part, tensor_names) in enumerate(self.parts):
            shard = f"model-{i:05d}-of-{len(self.parts):05d}.safetensors"
            os.replace(self.tmp / part, self.tmp / shard)
            weight_map.update(dict.fromkeys(tensor_names, shard))
            shards.append(shard)
        return shards, weight_map


def _write_delta_index(tmp: Path, weight_map: dict[str, str], version: str, base_version: str) -> None:
    index = {
        "metadata": {
            "version": str(version),
            "base_version": str(base_version),
            "delta_encoding": "xor",
            "compression_format": "zstd",
            "checksum_format": "adler32",
        },
        "weight_map": weight_map,
    }
    (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_delta(
    base_dir: str | os.PathLike[str],
    new_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    version: str,
    base_version: str,
    workers: int | None = None,
    shard_bytes: int = SHARD_TARGET_BYTES,
) -> DeltaStats:
    """Write the delta turning checkpoint ``base_dir`` into ``new_dir`` at ``out_dir``.

    ``out_dir`` is replaced atomically (written to a temporary sibling, then renamed). If no
    tensor changed, nothing is written and the stats say ``changed == 0``.

    Raises:
        SnapshotError: either checkpoint is malformed, or they differ in tensor names, dtypes
            or shapes (naming the first such tensor).
    """
    base = read_full_layout(base_dir)
    new = read_full_layout(new_dir)
    _check_same_layout(base, new)
    out = Path(out_dir)
    stats = DeltaStats(str(out), str(version), str(base_version), tensors_total=len(new.tensors))
    stats.bytes_total = new.tensor_bytes
    workers = workers or default_workers()
    base_map, new_map = _MappedCheckpoint(base), _MappedCheckpoint(new)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shards = _ShardWriter(tmp, shard_bytes)
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            diff = partial(_diff_tensor, base_map, new_map)
            for name, frame, digest, nbytes in _diffs_in_order(pool, sorted(new.tensors), workers, diff):
                if frame is None:
                    continue
                stats.changed += 1
                stats.bytes_changed += nbytes
                stats.wire_bytes += len(frame)
                shards.add(name, frame, digest)
        shards.flush()
        if stats.changed == 0:
            return stats
        stats.shards, weight_map = shards.finish()
        _write_delta_index(tmp, weight_map, version, base_version)
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
        return stats
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        base_map.close()
        new_map.close()


# ---------------------------------------------------------------------------- full snapshots

_NUMPY_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "int8": "I8",
    "int16": "I16",
    "uint16": "U16",
    "float16": "F16",
    "int32": "I32",
    "uint32": "U32",
    "float32": "F32",
    "int64": "I64",
    "uint64": "U64",
    "float64": "F64",
    "complex64": "C64",
}
_TORCH_NAMES = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.int16": "I16",
    "torch.uint16": "U16",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int32": "I32",
    "torch.uint32": "U32",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.uint64": "U64",
    "torch.float64": "F64",
    "torch.complex64": "C64",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e8m0fnu": "F8_E8M0",
}


def to_tensor_spec(name: str, value: Any) -> TensorSpec:
    """A :class:`TensorSpec` for a torch tensor, a numpy array, or a spec itself (no copy when
    the value is already contiguous on the CPU)."""
    if isinstance(value, TensorSpec):
        return value
    if isinstance(value, np.ndarray):
        dtype = _NUMPY_DTYPES.get(value.dtype.name)
        if dtype is None:
            raise SnapshotError(f"numpy dtype {value.dtype} has no safetensors equivalent", tensor=name)
        arr = np.ascontiguousarray(value)
        return TensorSpec(name, dtype, tuple(arr.shape), arr.reshape(-1).view(np.uint8))
    module = type(value).__module__
    if module.startswith("torch"):
        dtype = _TORCH_NAMES.get(str(value.dtype))
        if dtype is None:
            raise SnapshotError(f"torch dtype {value.dtype} has no safetensors equivalent", tensor=name)
        import torch  # noqa: PLC0415 - torch loads only to write torch tensors

        flat = value.detach().to("cpu").contiguous().reshape(-1)
        raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)
        return TensorSpec(name, dtype, tuple(value.shape), raw)
    raise SnapshotError(f"cannot write a {type(value).__name__} as a tensor", tensor=name)


def write_full_snapshot(
    tensors: Mapping[str, Any] | str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    *,
    shard_bytes: int = FULL_SHARD_TARGET_BYTES,
    metadata: Mapping[str, Any] | None = None,
    workers: int | None = None,
) -> Path:
    """Write a full snapshot with per-tensor Adler-32 checksums at ``out_dir`` (replaced).

    Args:
        tensors: name -> torch tensor / numpy array / :class:`TensorSpec`, written in that order
            into shards ``model-{i:05d}-of-{n:05d}.safetensors`` (1-based, as Hugging Face
            names them) of about ``shard_bytes``; or a full checkpoint location, re-written
            with checksums (same shard names), like cwtrain's ``write_full_snapshot``.
        config: ``config.json`` as a mapping or the path of one. Required for tensors; for a
            checkpoint location the checkpoint's own is used when ``None``.
        metadata: Extra index metadata (``total_size`` and ``checksum_format`` are set here).
    """
    out = Path(out_dir)
    if isinstance(tensors, (str, os.PathLike)):
        weights = HostWeights.load(tensors, verify=True, workers=workers, mmap=True)
        written = weights.materialize(out)
        if config is not None:
            _write_config(written, config)
        return written
    if config is None:
        raise SnapshotError("a full snapshot needs a config.json", file=str(out))
    specs = [to_tensor_spec(name, value) for name, value in tensors.items()]
    if not specs:
        raise SnapshotError("a full snapshot needs at least one tensor", file=str(out))
    groups: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec.shape) * DTYPE_SIZES[spec.dtype]
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    with replacing_directory(out) as tmp:
        with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
            digests = dict(zip((s.name for s in specs), pool.map(lambda s: adler32_hex(s.data), specs)))
        weight_map: dict[str, str] = {}
        for i, group in enumerate(groups, start=1):
            shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            shard_meta = {"format": "pt", **{s.name: digests[s.name] for s in group}}
            write_safetensors(tmp / shard, group, shard_meta)
            weight_map.update(dict.fromkeys((s.name for s in group), shard))
        index_meta = {
            **(metadata or {}),
            "total_size": sum(math.prod(s.shape) * DTYPE_SIZES[s.dtype] for s in specs),
            "checksum_format": "adler32",
        }
        (tmp / INDEX_FILE).write_text(json.dumps({"metadata": index_meta, "weight_map": weight_map}, indent=2) + "\n")
        _write_config(tmp, config)
    return out


def _write_config(directory: Path, config: Mapping[str, Any] | str | os.PathLike[str]) -> None:
    if isinstance(config, Mapping):
        (directory / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    else:
        shutil.copyfile(config, directory / CONFIG_FILE)


__all__ = ["DeltaStats", "SHARD_TARGET_BYTES", "to_tensor_spec", "write_delta", "write_full_snapshot"]
