"""The delta codec: bounded zstd inflation, XOR, Adler-32, applied all or nothing.

A frame is checked before anything is decompressed (:func:`check_frame`: one zstd frame, no
trailing bytes, no larger than a frame of the tensor's length can be, no other declared size),
inflated into a per-thread scratch of exactly the tensor's length (one byte more is refused, so
a zstd bomb is never allocated), XORed into the target and checked by Adler-32. A sparse tensor
is bounded and checked before it is read, then scattered (old values kept). Invariants: tensors
run in parallel, and if any fails every tensor already applied is put back from frames kept in
memory (the undo cannot fail on I/O) and the first failure in delta order is raised: the target
is exactly as before. Readers must not read the target during an apply.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

try:  # zlib-ng's SIMD Adler-32 runs ~6x zlib's on these machines; same values
    from zlib_ng.zlib_ng import adler32 as adler32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; keep working without it
    from zlib import adler32 as adler32  # type: ignore[assignment]

import snapshots.sparse as sparse
from snapshots.errors import ChecksumError, DeltaMismatchError, SnapshotError
from snapshots.inspect import DeltaPlan, DeltaTensor
from snapshots.storage import OpenedSource

#: zstd's "content size unknown" answer from ``frame_content_size``.
_UNKNOWN_SIZE = -1


def default_workers() -> int:
    """Worker threads for codec work: the CPU count, capped at 16 (memory bandwidth saturates)."""
    return max(1, min(16, os.cpu_count() or 4))


def adler32_hex(buf: Any) -> str:
    """Adler-32 of a buffer as the 8 lowercase hex digits slime, cwtrain and the engine use."""
    return f"{adler32(buf) & 0xFFFFFFFF:08x}"


def as_byte_array(buf: Any, *, writable: bool = False, what: str = "buffer") -> np.ndarray:
    """A flat ``uint8`` view (no copy) of a contiguous buffer: bytearray, memoryview, numpy."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise SnapshotError(f"{what} is not C-contiguous")
        arr = buf.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(buf, dtype=np.uint8)
    if writable and not arr.flags.writeable:
        raise SnapshotError(f"{what} is read-only; apply needs writable buffers")
    return arr


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.scratch = np.empty(0, dtype=np.uint8)
        self.dctx = zstandard.ZstdDecompressor()

    def buffer(self, nbytes: int) -> np.ndarray:
        # Reused across tensors: fresh allocations would page-fault on every tensor, which costs
        # more than the decompression itself.
        if self.scratch.nbytes < nbytes:
            self.scratch = np.empty(nbytes, dtype=np.uint8)
        return self.scratch[:nbytes]


_state = _ThreadState()


def max_frame_bytes(nbytes: int) -> int:
    """The most bytes a zstd frame of ``nbytes`` decompressed bytes can take.

    zstd's ``ZSTD_COMPRESSBOUND`` (what every zstd writer stays within), plus room for the
    largest frame header and a content checksum. Longer "frames" are refused before they are
    read, so a delta cannot make the reader fetch or hold more than about one tensor.
    """
    small = (128 * 1024 - nbytes) >> 11 if nbytes < 128 * 1024 else 0
    return nbytes + (nbytes >> 8) + small + 32


def check_wire_size(wire_bytes: int, nbytes: int, *, file: str | None = None, tensor: str | None = None) -> None:
    """Refuse a frame longer than any zstd frame of ``nbytes`` can be (see :func:`max_frame_bytes`)."""
    if wire_bytes > max_frame_bytes(nbytes):
        raise DeltaMismatchError(
            f"frame is {wire_bytes} bytes, more than any zstd frame of the base tensor's {nbytes} "
            f"bytes can be ({max_frame_bytes(nbytes)}); refused without reading it",
            file=file,
            tensor=tensor,
        )


_BLOCK_RLE, _BLOCK_RESERVED = 1, 3


def zstd_frame_length(frame: Any) -> int | None:
    """Where the first zstd frame in ``frame`` ends, from its header and block headers alone.

    Returns ``None`` when ``frame`` ends before the frame does. Raises ``zstandard.ZstdError``
    (bad magic or header) or ``ValueError`` (a reserved block type).
    """
    view = memoryview(frame).cast("B")
    size = len(view)
    pos = zstandard.frame_header_size(view)
    while True:
        if pos + 3 > size:
            return None
        header = view[pos] | view[pos + 1] << 8 | view[pos + 2] << 16
        kind = (header >> 1) & 3
        if kind == _BLOCK_RESERVED:
            raise ValueError(f"reserved block type at byte {pos}")
        # An RLE block stores one byte however many it stands for.
        pos += 3 + (1 if kind == _BLOCK_RLE else header >> 3)
        if header & 1:  # last block
            break
    if zstandard.get_frame_parameters(view).has_checksum:
        pos += 4
    return pos if pos <= size else None


def check_frame(frame: Any, nbytes: int, *, file: str | None = None, tensor: str | None = None) -> memoryview:
    """Check, without decompressing, that ``frame`` is one zstd frame that may inflate to
    ``nbytes``: not empty, a zstd header, no declared size other than ``nbytes``, no bytes after
    the frame, not cut short. Returns it as a byte memoryview.

    Raises:
        DeltaMismatchError: naming ``file`` and ``tensor``.
    """
    return _checked_frame(frame, nbytes, file, tensor)[0]


def _checked_frame(frame: Any, nbytes: int, file: str | None, tensor: str | None) -> tuple[memoryview, bool]:
    """:func:`check_frame`, and whether the frame declares its size (then exactly ``nbytes``)."""
    view = memoryview(frame).cast("B")
    if len(view) == 0:
        raise DeltaMismatchError("empty zstd frame", file=file, tensor=tensor)
    try:
        declared = zstandard.frame_content_size(view)
        end = zstd_frame_length(view)
    except (zstandard.ZstdError, ValueError) as exc:
        raise DeltaMismatchError(f"not a zstd frame ({exc})", file=file, tensor=tensor) from None
    if declared != _UNKNOWN_SIZE and declared != nbytes:
        raise DeltaMismatchError(
            f"frame decompresses to {declared} bytes but the base tensor has {nbytes}; refused without decompressing",
            file=file,
            tensor=tensor,
        )
    if end is None:
        raise DeltaMismatchError(
            f"zstd frame is cut short: its blocks run past the tensor's {len(view)} bytes",
            file=file,
            tensor=tensor,
        )
    if end != len(view):
        raise DeltaMismatchError(
            f"{len(view) - end} trailing bytes after the zstd frame (it ends at byte {end} of {len(view)}); refused",
            file=file,
            tensor=tensor,
        )
    return view, declared != _UNKNOWN_SIZE


def fill_from(reader: Any, out: memoryview) -> int:
    """Read from a zstd stream reader into ``out`` until it is full or the frame ends."""
    got = 0
    while got < len(out):
        n = reader.readinto(out[got:])
        if not n:
            break
        got += n
    return got


def inflate_exact(frame: Any, out: np.ndarray, *, file: str | None = None, tensor: str | None = None) -> None:
    """Decompress the single zstd frame ``frame`` into ``out``, which it must fill exactly.

    Raises:
        DeltaMismatchError: not a zstd frame, trailing bytes, corrupt, or it decompresses to a
            size other than ``out.nbytes`` (checked from the frame header first, then by
            decompressing into ``out`` and probing for one byte more, so an oversize frame is
            never allocated).
    """
    _stream_into(check_frame(frame, out.nbytes, file=file, tensor=tensor), out, file, tensor)


def _stream_into(view: memoryview, out: np.ndarray, file: str | None, tensor: str | None) -> None:
    """Decompress the checked frame ``view`` into ``out`` (:func:`inflate_exact`'s second half)."""
    nbytes = out.nbytes
    try:
        with _state.dctx.stream_reader(view, read_across_frames=False) as reader:
            got = fill_from(reader, out.data.cast("B"))
            overflow = reader.read(1) if got == nbytes else b""
    except zstandard.ZstdError as exc:
        raise DeltaMismatchError(f"corrupt zstd frame ({exc})", file=file, tensor=tensor) from None
    check_inflated(got, overflow, nbytes, file=file, tensor=tensor)


#: Frames of up to this many bytes inflated in one call into a fresh buffer (no stream reader per
#: tensor: it costs more than decompressing a small one); larger ones stream into the reused one.
SMALL_FRAME_BYTES = 64 << 10


def inflated(frame: Any, nbytes: int, *, file: str | None = None, tensor: str | None = None) -> np.ndarray:
    """The ``nbytes`` bytes the single zstd frame ``frame`` holds, as :func:`inflate_exact` checks
    them, read-only; valid until this thread's next call (it may be this thread's reused buffer)."""
    view, declared = _checked_frame(frame, nbytes, file, tensor)
    if nbytes > SMALL_FRAME_BYTES or not declared:
        out = _state.buffer(nbytes)
        _stream_into(view, out, file, tensor)
        return out
    try:
        # The frame declares exactly ``nbytes`` (checked above) and zstd holds it to that.
        data = _state.dctx.decompress(view)
    except zstandard.ZstdError as exc:
        raise DeltaMismatchError(f"corrupt zstd frame ({exc})", file=file, tensor=tensor) from None
    check_inflated(len(data), b"", nbytes, file=file, tensor=tensor)
    return np.frombuffer(data, dtype=np.uint8)


def check_inflated(got: int, overflow: bytes, nbytes: int, *, file: str | None, tensor: str | None) -> None:
    """Refuse a frame that produced ``got`` bytes instead of ``nbytes``, or had more to give."""
    if got != nbytes:
        raise DeltaMismatchError(
            f"frame decompresses to {got} bytes but the base tensor has {nbytes}",
            file=file,
            tensor=tensor,
        )
    if overflow:
        raise DeltaMismatchError(
            f"frame inflates past the base tensor's {nbytes} bytes; refused without decompressing the rest",
            file=file,
            tensor=tensor,
        )


@dataclass
class DeltaReport:
    """What one applied delta changed."""

    location: str
    version: str | None
    base_version: str | None
    changed: list[str] = field(default_factory=list)  # in delta order
    bytes_changed: int = 0  # raw bytes of the changed tensors
    wire_bytes: int = 0  # compressed frame bytes
    checksums: dict[str, str] = field(default_factory=dict)  # verified Adler-32 of new bytes


def _mismatch(item: DeltaTensor, digest: str, file: str) -> ChecksumError:
    return ChecksumError(
        f"checksum mismatch: the writer recorded {item.checksum}, the reconstructed bytes have {digest}",
        file=file,
        tensor=item.name,
    )


def _xor_into(target: np.ndarray, diff: np.ndarray) -> None:
    np.bitwise_xor(target, diff, out=target)


def _check_targets(targets: Mapping[str, np.ndarray], plan: DeltaPlan, sources: Mapping[str, np.ndarray]) -> None:
    """Refuse, before any byte changes, a delta tensor the base lacks, a read-only target, or a
    source whose length differs from its target's."""
    for item in plan.tensors.values():
        target = targets.get(item.name)
        if target is None:
            raise DeltaMismatchError(
                "is in the delta but not in the base", file=plan.source.describe(item.file), tensor=item.name
            )
        if not target.flags.writeable:
            raise SnapshotError("base tensor buffer is read-only", tensor=item.name)
        source = sources.get(item.name)
        if source is not None and source.nbytes != target.nbytes:
            raise SnapshotError(f"source has {source.nbytes} bytes, target {target.nbytes}", tensor=item.name)


class _PlanApply:
    """One all-or-nothing apply: stages each tensor (any thread), remembers what an undo needs
    for the in-place ones, and rolls those back when any tensor failed."""

    def __init__(
        self,
        targets: Mapping[str, np.ndarray],
        plan: DeltaPlan,
        sources: Mapping[str, np.ndarray],
        dtypes: Mapping[str, str],
    ) -> None:
        self.targets, self.plan, self.sources, self.dtypes = targets, plan, sources, dtypes
        self.source = OpenedSource(plan.source)  # a local file opened once, not once per tensor
        self.abort = threading.Event()
        self.lock = threading.Lock()
        # name -> its frame (XOR) or (positions, old values) (sparse), kept so a rollback needs no I/O
        self.applied: dict[str, Any] = {}

    def _remember(self, name: str, undo: Any) -> None:
        with self.lock:
            self.applied[name] = undo

    def stage(self, item: DeltaTensor) -> str:
        """Apply and verify one tensor; its Adler-32, or "" when another tensor failed first."""
        if self.abort.is_set():
            return ""
        if item.sparse is not None:
            return self._stage_sparse(item, item.sparse)
        return self._stage_frame(item)

    def _stage_sparse(self, item: DeltaTensor, spec: sparse.SparseTensor) -> str:
        file = self.source.describe(spec.values.file)
        target = self.targets[item.name]
        sparse.check_size(spec.values, target.nbytes, self.dtypes.get(item.name), file=file, tensor=item.name)
        positions, values = sparse.read(self.source, spec, target.nbytes, file=file)
        if self.abort.is_set():
            return ""
        source = self.sources.get(item.name)
        if source is not None:
            np.copyto(target, source)
        old = sparse.scatter(target, positions, values)
        digest = adler32_hex(target)
        if digest != item.checksum:
            if source is None:
                sparse.scatter(target, positions, old)  # undo this tensor before reporting it
            raise _mismatch(item, digest, file)
        if source is None:
            self._remember(item.name, (positions, old))
        return digest

    def _stage_frame(self, item: DeltaTensor) -> str:
        file = self.source.describe(item.file)
        target = self.targets[item.name]
        check_wire_size(item.wire_bytes, target.nbytes, file=file, tensor=item.name)
        frame = self.source.read_range(item.file, item.begin, item.wire_bytes)
        if len(frame) != item.wire_bytes:
            raise DeltaMismatchError("frame is truncated", file=file, tensor=item.name)
        diff = inflated(frame, target.nbytes, file=file, tensor=item.name)
        if self.abort.is_set():
            return ""
        source = self.sources.get(item.name)
        if source is None:
            _xor_into(target, diff)
        else:
            np.bitwise_xor(source, diff, out=target)
        digest = adler32_hex(target)
        if digest != item.checksum:
            if source is None:
                _xor_into(target, diff)  # undo this tensor before reporting it
            raise _mismatch(item, digest, file)
        if source is None:  # out-of-place targets need no undo
            self._remember(item.name, frame)
        return digest

    def rollback(self, name: str) -> None:
        """Put one in-place tensor back as it was before ``stage``."""
        target = self.targets[name]
        undo = self.applied[name]
        if isinstance(undo, tuple):
            sparse.scatter(target, *undo)
            return
        diff = inflated(undo, target.nbytes, tensor=name)
        _xor_into(target, diff)

    def run(self, items: list[DeltaTensor], workers: int) -> dict[str, str]:
        """Stage every tensor in parallel; on any failure roll back all that were applied and
        raise the first failure in delta order. Returns name -> verified Adler-32."""
        errors: dict[int, BaseException] = {}
        digests: dict[str, str] = {}

        def stage_batch(batch: range) -> None:
            # Several tensors per task: a task per tensor costs more than the decode at tens of
            # thousands of small tensors. Each tensor's error is kept by its position, as before.
            for position in batch:
                try:
                    digests[items[position].name] = self.stage(items[position])
                except BaseException as exc:  # noqa: BLE001 - re-raised below after the rollback
                    errors[position] = exc
                    self.abort.set()

        sizes = [self.targets[item.name].nbytes for item in items]
        n_workers = threads_for(sizes, workers)
        with ThreadPoolExecutor(max_workers=n_workers) as pool:
            list(pool.map(stage_batch, task_batches(sizes, n_workers)))
            if errors:
                list(pool.map(self.rollback, list(self.applied)))
        if errors:
            raise errors[min(errors)]
        return digests


def apply_plan_in_place(
    targets: Mapping[str, np.ndarray],
    plan: DeltaPlan,
    *,
    workers: int | None = None,
    sources: Mapping[str, np.ndarray] | None = None,
    dtypes: Mapping[str, str] | None = None,
) -> DeltaReport:
    """Apply a validated delta to flat writable ``uint8`` arrays, all-or-nothing (module doc).

    With ``sources``, a tensor named there is decoded out of place: ``targets[name]`` receives
    ``sources[name] XOR diff`` (same length) and the source is only read. On a failure such a
    target holds unspecified bytes (it held nothing of value); in-place ones are restored.
    ``dtypes`` (name -> safetensors dtype): a sparse delta's values must be of the tensor's.

    Raises:
        SnapshotError: a delta tensor absent from ``targets``, a frame of the wrong size or
            corrupt, or a checksum mismatch; nothing in ``targets`` has changed.
    """
    report = DeltaReport(plan.uri, plan.version, plan.base_version)
    items: list[DeltaTensor] = list(plan.tensors.values())
    _check_targets(targets, plan, sources or {})
    if not items:
        return report
    apply = _PlanApply(targets, plan, sources or {}, dtypes or {})
    with apply.source:
        digests = apply.run(items, workers or default_workers())
    for item in items:
        report.changed.append(item.name)
        report.bytes_changed += targets[item.name].nbytes
        report.wire_bytes += item.wire_bytes
        report.checksums[item.name] = digests[item.name]
    return report


BATCH_TENSORS = 256  # at most this many tensors per task
TASKS_PER_WORKER = 4  # at least, where there are that many tensors (the workers stay evenly loaded)


#: Below this many bytes per tensor on average, work on tensors is done on one thread: a tensor of a
#: few KB costs less to decode or copy than to hand between threads that take turns holding the
#: GIL (18,867 tensors of ~4 KB: decoded in 0.22 s on one thread, 0.32-0.37 s on two).
THREADED_MEAN_BYTES = 256 << 10


def threads_for(sizes: list[int], workers: int) -> int:
    """How many of ``workers`` threads to spread tensors of these byte ``sizes`` over."""
    if not sizes or sum(sizes) < THREADED_MEAN_BYTES * len(sizes):
        return 1
    return max(1, min(workers, len(sizes)))


def task_batches(sizes: list[int], workers: int) -> list[range]:
    """Consecutive positions of tensors of these byte ``sizes`` in thread-pool tasks: a task per
    tensor costs more than decoding or copying a small one, so a task takes up to
    ``BATCH_TENSORS`` of them, and no more than a ``TASKS_PER_WORKER * workers``-th of the
    bytes or of the tensors (a big tensor goes alone; the workers stay evenly loaded)."""
    if not sizes:
        return []
    tasks = TASKS_PER_WORKER * max(1, workers)
    per_task = max(1, min(BATCH_TENSORS, -(-len(sizes) // tasks)))
    cap = max(1, sum(sizes) // tasks)
    out: list[range] = []
    start, size = 0, 0
    for i, n in enumerate(sizes):
        if i > start and (i - start >= per_task or size + n > cap):
            out.append(range(start, i))
            start, size = i, 0
        size += n
    out.append(range(start, len(sizes)))
    return out


__all__ = [
    "DeltaReport",
    "adler32_hex",
    "apply_plan_in_place",
    "as_byte_array",
    "check_frame",
    "check_inflated",
    "check_wire_size",
    "task_batches",
    "threads_for",
    "default_workers",
    "fill_from",
    "inflate_exact",
    "inflated",
    "max_frame_bytes",
    "zstd_frame_length",
]
