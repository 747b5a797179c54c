"""The delta codec: bounded zstd inflation, XOR, Adler-32, applied all-or-nothing.

A delta tensor is one zstd frame of ``new XOR base`` over the tensor's raw bytes. To apply it:

1. the frame is inflated into a per-thread scratch buffer of exactly the base tensor's byte
   length. A frame that *declares* another size is refused before anything is decompressed; a
   frame without a declared size is decompressed into that fixed buffer and refused if it
   would produce even one byte more (so a zstd bomb is never allocated) or fewer;
2. the scratch is XORed into the target tensor in place;
3. the Adler-32 of the result is compared with the writer's; on a mismatch the XOR is undone
   at once (XOR is its own inverse).

**All-or-nothing.** Every tensor is staged and verified this way in parallel (zstd, numpy and
zlib release the GIL). If any tensor fails, every tensor already applied is XORed back with its
frame (kept in memory until the end, so the undo cannot fail on I/O), and the first failure in
delta order is raised: the target is exactly as before. Only when every tensor passed does the
call return. Memory beyond the target: one scratch buffer per worker thread (the largest tensor)
plus the compressed frames (the delta's wire size). Readers must not read the target while an
apply runs; they would see intermediate bytes.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zstandard

from snapshots.errors import ChecksumError, DeltaMismatchError, SnapshotError
from snapshots.inspect import DeltaPlan, DeltaTensor, read_delta_plan

#: zstd's "content size unknown" answer from ``frame_content_size``.
_UNKNOWN_SIZE = -1


def default_workers() -> int:
    """Worker threads for codec work: the CPU count, capped at 16 (memory bandwidth saturates)."""
    return max(1, min(16, os.cpu_count() or 4))


def adler32_hex(buf: Any) -> str:
    """Adler-32 of a buffer as the 8 lowercase hex digits slime, cwtrain and the engine use."""
    return f"{zlib.adler32(buf) & 0xFFFFFFFF:08x}"


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


def inflate_exact(frame: Any, out: np.ndarray, *, file: str | None = None, tensor: str | None = None) -> None:
    """Decompress the single zstd frame ``frame`` into ``out``, which it must fill exactly.

    Raises:
        DeltaMismatchError: not a zstd frame, corrupt, or it decompresses to a size other than
            ``out.nbytes`` (checked from the frame header first, then by decompressing into
            ``out`` and probing for one byte more, so an oversize frame is never allocated).
    """
    nbytes = out.nbytes
    view = memoryview(frame)
    if len(view) == 0:
        raise DeltaMismatchError("empty zstd frame", file=file, tensor=tensor)
    try:
        declared = zstandard.frame_content_size(view)
    except zstandard.ZstdError as exc:
        raise DeltaMismatchError(f"not a zstd frame ({exc})", file=file, tensor=tensor) from None
    if declared != _UNKNOWN_SIZE and declared != nbytes:
        raise DeltaMismatchError(
            f"frame decompresses to {declared} bytes but the base tensor has {nbytes}; refused "
            "without decompressing",
            file=file,
            tensor=tensor,
        )
    target = memoryview(out).cast("B")
    got = 0
    try:
        with _state.dctx.stream_reader(view, read_across_frames=False) as reader:
            while got < nbytes:
                n = reader.readinto(target[got:])
                if not n:
                    break
                got += n
            overflow = reader.read(1) if got == nbytes else b""
    except zstandard.ZstdError as exc:
        raise DeltaMismatchError(f"corrupt zstd frame ({exc})", file=file, tensor=tensor) from None
    if got != nbytes:
        raise DeltaMismatchError(
            f"frame decompresses to {got} bytes but the base tensor has {nbytes}",
            file=file,
            tensor=tensor,
        )
    if overflow:
        raise DeltaMismatchError(
            f"frame inflates past the base tensor's {nbytes} bytes; refused without "
            "decompressing the rest",
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


def _xor_into(target: np.ndarray, diff: np.ndarray) -> None:
    np.bitwise_xor(target, diff, out=target)


def apply_plan_in_place(
    targets: Mapping[str, np.ndarray], plan: DeltaPlan, *, workers: int | None = None
) -> DeltaReport:
    """Apply a validated delta to flat writable ``uint8`` arrays, all-or-nothing (module doc).

    Raises:
        SnapshotError: a delta tensor absent from ``targets``, a frame of the wrong size or
            corrupt, or a checksum mismatch; nothing in ``targets`` has changed.
    """
    report = DeltaReport(plan.uri, plan.version, plan.base_version)
    items: list[DeltaTensor] = list(plan.tensors.values())
    for item in items:
        target = targets.get(item.name)
        if target is None:
            raise DeltaMismatchError(
                "is in the delta but not in the base", file=plan.source.describe(item.file), tensor=item.name
            )
        if not target.flags.writeable:
            raise SnapshotError("base tensor buffer is read-only", tensor=item.name)
    if not items:
        return report

    abort = threading.Event()
    lock = threading.Lock()
    applied: dict[str, bytes] = {}  # name -> its frame, kept so a rollback needs no I/O

    def stage(item: DeltaTensor) -> str:
        if abort.is_set():
            return ""
        file = plan.source.describe(item.file)
        frame = plan.source.read_range(item.file, item.begin, item.wire_bytes)
        if len(frame) != item.wire_bytes:
            raise DeltaMismatchError("frame is truncated", file=file, tensor=item.name)
        target = targets[item.name]
        diff = _state.buffer(target.nbytes)
        inflate_exact(frame, diff, file=file, tensor=item.name)
        if abort.is_set():
            return ""
        _xor_into(target, diff)
        digest = adler32_hex(target)
        if digest != item.checksum:
            _xor_into(target, diff)  # undo this tensor before reporting it
            raise ChecksumError(
                f"checksum mismatch: the writer recorded {item.checksum}, the reconstructed bytes "
                f"have {digest}",
                file=file,
                tensor=item.name,
            )
        with lock:
            applied[item.name] = frame
        return digest

    def rollback(name: str) -> None:
        target = targets[name]
        diff = _state.buffer(target.nbytes)
        inflate_exact(applied[name], diff, tensor=name)
        _xor_into(target, diff)

    errors: dict[int, BaseException] = {}
    digests: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=min(workers or default_workers(), len(items))) as pool:
        futures = [pool.submit(stage, item) for item in items]
        for position, (item, future) in enumerate(zip(items, futures)):
            try:
                digests[item.name] = future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below after the rollback
                errors[position] = exc
                abort.set()
        if errors:
            list(pool.map(rollback, list(applied)))
    if errors:
        raise errors[min(errors)]
    for item in items:
        report.changed.append(item.name)
        report.bytes_changed += targets[item.name].nbytes
        report.wire_bytes += item.wire_bytes
        report.checksums[item.name] = digests[item.name]
    return report


def apply_delta(
    base: Mapping[str, Any] | str | os.PathLike[str],
    delta_location: Any,
    *,
    s3: Any = None,
    workers: int | None = None,
) -> dict[str, np.ndarray]:
    """Apply one delta to ``base``, all-or-nothing, and return the changed tensors' new bytes.

    Args:
        base: A mapping of tensor name -> writable contiguous buffer (``bytearray``,
            ``memoryview``, numpy array), changed in place; or a full checkpoint location,
            loaded into memory (see :class:`snapshots.host.HostWeights`) and left untouched.
        delta_location: A delta directory, ``s3://`` prefix, or a :class:`DeltaPlan`.
        s3: A boto3 S3 client for ``s3://`` locations.

    Returns:
        name -> flat ``uint8`` array of the new bytes, for every changed tensor. For a mapping
        base these are views of the caller's buffers.

    Raises:
        SnapshotError: the delta is malformed or does not fit ``base``; ``base`` is unchanged.
    """
    plan = delta_location if isinstance(delta_location, DeltaPlan) else read_delta_plan(delta_location, s3=s3)
    if isinstance(base, Mapping):
        targets = {name: as_byte_array(buf, writable=True, what=f"base tensor {name!r}") for name, buf in base.items()}
        report = apply_plan_in_place(targets, plan, workers=workers)
        return {name: targets[name] for name in report.changed}
    from snapshots.host import HostWeights

    weights = HostWeights.load(base, s3=s3, workers=workers)
    changed = weights.apply_delta(plan)
    return {name: weights.raw(name) for name in changed}


__all__ = [
    "DeltaReport",
    "adler32_hex",
    "apply_delta",
    "apply_plan_in_place",
    "as_byte_array",
    "default_workers",
    "inflate_exact",
]
