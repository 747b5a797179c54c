"""``HostWeights``: a replica's host-side copy of the weights it serves, in checkpoint format.

Every tensor's bytes exactly as the trainer's checkpoint holds them (names, dtypes, shapes,
shard layout), so the replica applies deltas to them, proves what it serves (Adler-32), hands
tensors to the engine (:meth:`tensor`, zero-copy views) and writes them out (:meth:`materialize`).
Invariants: loading verifies the Adler-32 a full snapshot records; :meth:`apply_delta` is all or
nothing (on failure the weights are exactly as before and a ``SnapshotError`` names file and
tensor); it changes buffers in place, so views see new values and must not be read during an
apply. Memory: one buffer per shard (``mmap=True``: local shards copy-on-write).
"""

from __future__ import annotations

import mmap as mmap_module
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from snapshots.codec import DeltaReport, adler32_hex, apply_plan_in_place, as_byte_array, default_workers
from snapshots.errors import ChecksumError, SnapshotError
from snapshots.inspect import (
    INDEX_FILE,
    DeltaPlan,
    FullLayout,
    read_delta_plan,
    read_full_layout,
)
from snapshots.replace import replacing_directory
from snapshots.safetensors_io import readinto_exact
from snapshots.storage import LocalSource
from snapshots.stream import (
    full_index,
    full_shard_header,
    materialize_chain_report,
    shard_tensor_order,
    side_files,
    stream_checksums,
)

#: Remote shards are fetched in parts of this size, concurrently.
_REMOTE_PART_BYTES = 64 * 2**20

_TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    nbytes: int
    shard: str

    @property
    def torch_dtype(self) -> str:
        """The torch dtype's name ("bfloat16" for BF16)."""
        return _TORCH_DTYPES[self.dtype]


class HostWeights:
    """The full set of tensors of one checkpoint, held in host memory, updatable by deltas."""

    def __init__(
        self,
        layout: FullLayout,
        shard_buffers: dict[str, np.ndarray],
        side_files: dict[str, bytes],
        *,
        workers: int | None = None,
    ) -> None:
        """Use :meth:`load`."""
        self._layout = layout
        self._buffers = shard_buffers
        self._side_files = side_files
        self.workers = workers or default_workers()
        self._info: dict[str, TensorInfo] = {}
        self._views: dict[str, np.ndarray] = {}
        for name, (shard, entry) in layout.tensors.items():
            self._info[name] = TensorInfo(name, entry.dtype, entry.shape, entry.nbytes, shard)
            self._views[name] = shard_buffers[shard][entry.begin : entry.end]
        self._checksums: dict[str, str] = {}
        #: ``version`` of every delta applied since load, in order.
        self.applied: list[str | None] = []
        self.source_uri = layout.source.uri

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        location: Any,
        *,
        s3: Any = None,
        mmap: bool = False,
        verify: bool = True,
        workers: int | None = None,
        allocate: Callable[[dict[str, int]], dict[str, np.ndarray]] | None = None,
    ) -> HostWeights:
        """Load a full checkpoint (directory or ``s3://`` prefix).

        Args:
            s3: A boto3 S3 client for ``s3://`` locations.
            mmap: Map local shards copy-on-write instead of reading them (the files are never
                written). Ignored for S3 and with ``allocate``.
            allocate: Given every shard's size (shard name -> bytes), returns a writable flat
                ``uint8`` buffer of that size per shard (e.g. in memory shared with another
                process); default: private memory.
            verify: Check the Adler-32 recorded in shard ``__metadata__``, when there are any.

        Raises:
            SnapshotError: the checkpoint is malformed or a recorded checksum does not match.
        """
        layout = read_full_layout(location, s3=s3)
        workers = workers or default_workers()
        source = layout.source
        shards = layout.index.shards
        buffers: dict[str, np.ndarray] = {}
        local = isinstance(source, LocalSource)
        sizes = {shard: (os.path.getsize(source.path(shard)) if local else layout.files[shard]) for shard in shards}  # type: ignore[attr-defined]
        if allocate is not None:
            given = allocate(sizes)
            for shard, buf in given.items():
                if buf.dtype != np.uint8 or buf.ndim != 1 or buf.nbytes != sizes[shard]:
                    raise ValueError(
                        f"allocate() gave a buffer of {buf.nbytes} bytes for shard {shard} of {sizes[shard]}"
                    )
        else:  # private memory; with `mmap`, local shards are mapped copy-on-write instead
            given = {
                shard: np.empty(size, dtype=np.uint8) for shard, size in sizes.items() if not (mmap and local and size)
            }
        if local:
            for shard in shards:
                with open(source.path(shard), "rb", buffering=0) as f:  # type: ignore[attr-defined]
                    if shard not in given:
                        mapped = mmap_module.mmap(f.fileno(), sizes[shard], access=mmap_module.ACCESS_COPY)
                        buffers[shard] = np.frombuffer(mapped, dtype=np.uint8)
                    else:
                        readinto_exact(f, 0, given[shard])
                        buffers[shard] = given[shard]
        else:
            parts: list[tuple[str, int, int]] = []
            for shard in shards:
                size = sizes[shard]
                buffers[shard] = given[shard]
                parts += [
                    (shard, off, min(_REMOTE_PART_BYTES, size - off)) for off in range(0, size, _REMOTE_PART_BYTES)
                ]

            def fetch(part: tuple[str, int, int]) -> None:
                shard, offset, length = part
                data = source.read_range(shard, offset, length)
                if len(data) != length:
                    raise SnapshotError("object is shorter than listed", file=source.describe(shard))
                buffers[shard][offset : offset + length] = np.frombuffer(data, dtype=np.uint8)

            with ThreadPoolExecutor(max_workers=min(workers, max(1, len(parts)))) as pool:
                list(pool.map(fetch, parts))
        weights = cls(layout, buffers, {name: source.read_all(name) for name in side_files(layout)}, workers=workers)
        if verify and layout.checksums:
            weights._verify_recorded(layout.checksums)
        return weights

    def _verify_recorded(self, recorded: dict[str, str]) -> None:
        names = sorted(recorded)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            computed = list(pool.map(lambda n: adler32_hex(self._views[n]), names))
        for name, digest in zip(names, computed):
            if digest != recorded[name]:
                raise ChecksumError(
                    f"checksum mismatch: __metadata__ records {recorded[name]}, the bytes have {digest}",
                    file=self._layout.source.describe(self._info[name].shard),
                    tensor=name,
                )
            self._checksums[name] = digest

    # ------------------------------------------------------------------ reading

    def __contains__(self, name: object) -> bool:
        return name in self._info

    def __len__(self) -> int:
        return len(self._info)

    def __iter__(self) -> Iterator[str]:
        return iter(self._info)

    def names(self) -> list[str]:
        """Tensor names, in the checkpoint index's order."""
        return list(self._info)

    def info(self, name: str) -> TensorInfo:
        """dtype, shape, byte size and shard of one tensor."""
        try:
            return self._info[name]
        except KeyError:
            raise SnapshotError("no such tensor in the host weights", tensor=name) from None

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a flat ``uint8`` array (a view: do not write to it)."""
        self.info(name)
        return self._views[name]

    def tensor(self, name: str) -> Any:
        """The tensor as a CPU ``torch.Tensor`` of its dtype and shape, sharing memory with the
        host copy (``.clone()`` it to keep a value across a later :meth:`apply_delta`)."""
        import torch  # noqa: PLC0415 - torch loads only for torch tensors: the snapshot tools run on numpy

        info = self.info(name)
        dtype = getattr(torch, _TORCH_DTYPES[info.dtype])
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(self._views[name], dtype=dtype).view(info.shape)

    def save(self, names: list[str]) -> dict[str, np.ndarray]:
        """Copies of the named tensors' bytes, for :meth:`restore` (undo of a multi-delta chain)."""
        return {name: self.raw(name).copy() for name in names}

    def restore(self, saved: dict[str, np.ndarray], checksums: dict[str, str] | None = None) -> None:
        """Put back bytes from :meth:`save` (or bytes received elsewhere). Their cached checksums
        are dropped, or set from ``checksums`` when the caller has verified the bytes."""
        for name, old in saved.items():
            self._views[name][...] = old
            if checksums is not None and name in checksums:
                self._checksums[name] = checksums[name].lower()
            else:
                self._checksums.pop(name, None)

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._info.values())

    # ------------------------------------------------------------------ updating

    def apply_delta(self, delta_location: Any, *, s3: Any = None) -> list[str]:
        """Apply one delta (directory, ``s3://`` prefix or :class:`DeltaPlan`), all-or-nothing.

        Returns:
            The names of the tensors that changed, in the delta's order.

        Raises:
            SnapshotError: naming file and tensor; the weights are unchanged.
        """
        return self.apply_delta_report(delta_location, s3=s3).changed

    def apply_delta_report(self, delta_location: Any, *, s3: Any = None) -> DeltaReport:
        """Like :meth:`apply_delta`, returning the full :class:`DeltaReport` (sizes, checksums)."""
        plan = delta_location if isinstance(delta_location, DeltaPlan) else read_delta_plan(delta_location, s3=s3)
        report = apply_plan_in_place(self._views, plan, workers=self.workers, dtypes=self.dtypes())
        self._checksums.update(report.checksums)
        self.applied.append(plan.version)
        return report

    def decode_delta_into(self, plan: DeltaPlan, out: dict[str, np.ndarray], decoded: set[str]) -> DeltaReport:
        """Decode one delta into ``out`` (name -> flat writable buffer of the tensor's size),
        leaving these weights untouched: a tensor in ``decoded`` (written by an earlier link of
        the same chain) is updated in place there, any other is written as this copy's bytes
        XOR the delta. Every changed tensor's Adler-32 is checked. The caller adds the report's
        ``changed`` to ``decoded``; :meth:`restore` with the report's checksums adopts ``out``.

        Raises:
            SnapshotError: naming file and tensor (a tensor absent from ``out`` is "in the delta
                but not in the base"); ``out`` then holds unspecified bytes.
        """
        sources = {n: self._views[n] for n in plan.tensors if n not in decoded and n in self._views}
        return apply_plan_in_place(out, plan, workers=self.workers, sources=sources, dtypes=self.dtypes())

    def dtypes(self) -> dict[str, str]:
        """Every tensor's safetensors dtype ("BF16"), by name."""
        return {name: info.dtype for name, info in self._info.items()}

    # ------------------------------------------------------------------ proving and writing

    def checksums(self) -> dict[str, str]:
        """Adler-32 (8 hex digits) of every tensor's current bytes, in index order.

        Checksums verified at load or by a delta are reused; the rest are computed once."""
        missing = [n for n in self._info if n not in self._checksums]
        if missing:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                for name, digest in zip(missing, pool.map(lambda n: adler32_hex(self._views[n]), missing)):
                    self._checksums[name] = digest
        return {name: self._checksums[name] for name in self._info}

    def manifest(self, identity: str, version: str | None = None) -> dict[str, Any]:
        """The ``_manifests/IDENTITY.json`` record of the current weights."""
        return {
            "identity": identity,
            "version": version if version is not None else identity,
            "checksum_format": "adler32",
            "tensors": dict(sorted(self.checksums().items())),
        }

    def materialize(self, out_dir: str | os.PathLike[str]) -> Path:
        """Write the current weights as a full checkpoint directory at ``out_dir`` (replaced).

        Same shard names and tensor order as the loaded checkpoint; each shard's
        ``__metadata__`` carries every tensor's Adler-32 and the index says
        ``checksum_format: adler32``, like cwtrain's full snapshots. ``config.json`` and the other
        small files of the base are copied. Written to a temporary sibling and renamed, so
        ``out_dir`` never holds a partial checkpoint.
        """
        out = Path(out_dir)
        checksums = self.checksums()
        with replacing_directory(out) as tmp:
            for shard, names in shard_tensor_order(self._layout).items():
                with open(tmp / shard, "wb") as f:
                    f.write(full_shard_header(self._layout, shard, names, checksums))
                    for n in names:
                        f.write(self._views[n].data)
            (tmp / INDEX_FILE).write_text(full_index(self._layout))
            for name, body in self._side_files.items():
                (tmp / name).write_bytes(body)
        return out


def materialize_chain(base: Any, deltas: Sequence[Any], out_dir: str | os.PathLike[str], **options: Any) -> Path:
    """Reconstruct ``base`` + ``deltas`` (in order) as a full checkpoint directory ``out_dir``.

    Streams, in memory bounded by a few tensors whatever the model size:
    :func:`snapshots.stream.materialize_chain_report` (whose keyword ``options`` - ``s3``,
    ``workers``, ``fsync`` - this takes) states the contract. Every delta is validated and
    applied all-or-nothing; on any failure ``out_dir`` is not created (or replaced) and the error
    names the file and tensor. ``out_dir`` may be ``base`` (an in-place apply).
    """
    out = materialize_chain_report(base, deltas, out_dir, **options).out
    assert out is not None
    return out


def checkpoint_checksums(location: Any, *, s3: Any = None, workers: int | None = None) -> dict[str, str]:
    """Adler-32 of every tensor of a full checkpoint, computed from its bytes (streamed)."""
    return stream_checksums(location, s3=s3, workers=workers, verify=False)


def compare_checksums(ours: dict[str, str], theirs: dict[str, str]) -> list[str]:
    """Human-readable differences between two ``{name: adler32}`` maps (empty when equal)."""
    problems = []
    for name in sorted(set(ours) | set(theirs)):
        a, b = ours.get(name), theirs.get(name)
        if a is None:
            problems.append(f"{name}: missing on the left")
        elif b is None:
            problems.append(f"{name}: missing on the right")
        elif a != b:
            problems.append(f"{name}: {a} != {b}")
    return problems


def apply_delta(
    base: Mapping[str, Any] | str | os.PathLike[str],
    delta_location: Any,
    *,
    s3: Any = None,
    workers: int | None = None,
) -> dict[str, np.ndarray]:
    """Apply one delta to ``base``, all or nothing, and return name -> flat ``uint8`` new bytes of
    every changed tensor (views of the caller's buffers for a mapping ``base``).

    ``base`` is a mapping of name -> writable contiguous buffer, changed in place, or a full
    checkpoint location, loaded and left untouched. Raises SnapshotError (``base`` unchanged).
    """
    plan = delta_location if isinstance(delta_location, DeltaPlan) else read_delta_plan(delta_location, s3=s3)
    if isinstance(base, Mapping):
        targets = {name: as_byte_array(buf, writable=True, what=f"base tensor {name!r}") for name, buf in base.items()}
        report = apply_plan_in_place(targets, plan, workers=workers)
        return {name: targets[name] for name in report.changed}
    weights = HostWeights.load(base, s3=s3, workers=workers)
    changed = weights.apply_delta(plan)
    return {name: weights.raw(name) for name in changed}


__all__ = ["HostWeights", "TensorInfo", "apply_delta", "checkpoint_checksums", "compare_checksums", "materialize_chain"]
