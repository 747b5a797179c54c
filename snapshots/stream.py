"""Streaming materialization: a full base + a chain of deltas -> a full checkpoint directory.

:func:`materialize_chain_report` (and :func:`snapshots.host.materialize_chain`) writes the same
checkpoint :meth:`HostWeights.materialize` does, never holding the model in memory. Invariants:
every changed tensor is checked after *each* delta that touches it (bounded frames as in
`snapshots.codec`, the writer's Adler-32), an untouched tensor against the base's recorded one;
all or nothing: everything goes into a temporary sibling that replaces ``out_dir`` only once
every link is verified (``out_dir`` may be the base: an in-place apply), else the first failure
(base, then deltas in chain order) is raised naming file and tensor and ``out_dir`` is untouched;
with ``fsync`` the result is durable before return; memory is two ``chunk_bytes`` buffers per
worker plus the frames in flight, whatever the model size; only the index, shard headers and
changed tensors' frames of a delta are read. :func:`stream_checksums` is the same pass without
writing.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

import snapshots.sparse as sparse
from snapshots.codec import (
    DeltaReport,
    adler32,
    check_frame,
    check_inflated,
    check_wire_size,
    default_workers,
    fill_from,
)
from snapshots.errors import ChecksumError, DeltaMismatchError, HeaderError
from snapshots.inspect import (
    INDEX_FILE,
    SHARD_SUFFIX,
    DeltaPlan,
    DeltaTensor,
    FullLayout,
    read_delta_plan,
    read_full_layout,
)
from snapshots.replace import fsync_path, replacing_directory
from snapshots.safetensors_io import encode_header, readinto_exact
from snapshots.storage import LocalSource, S3Source

#: Bytes of one tensor processed per step: small enough that the step's buffers stay in the CPU
#: cache between decompress, XOR, Adler-32 and write; large enough that per-call overhead is noise.
CHUNK_BYTES = 1 * 2**20
#: Non-shard files (config, tokenizer) larger than this are not carried along to a new checkpoint.
MAX_SIDE_FILE_BYTES = 256 * 2**20
#: Index metadata keys that describe a delta, dropped when weights are written as a full snapshot.
DELTA_KEYS = ("delta_encoding", "compression_format", "version", "base_version")
_PLACEHOLDER = "0" * 8  # an Adler-32 not known yet: same length, so the header keeps its size


# ------------------------------------------------------------------------ output layout


def shard_tensor_order(layout: FullLayout) -> dict[str, list[str]]:
    """The tensors of each shard, in the order the base file stores them."""
    by_shard: dict[str, list[str]] = {}
    for name, (shard, _) in layout.tensors.items():
        by_shard.setdefault(shard, []).append(name)
    for shard, names in by_shard.items():
        header = layout.headers[shard]
        names.sort(key=lambda n: header.tensors[n].begin)
    return by_shard


def full_shard_header(layout: FullLayout, shard: str, names: Sequence[str], checksums: dict[str, str]) -> bytes:
    """The safetensors header of ``shard`` written as a full snapshot: ``names`` packed in order,
    the base's own ``__metadata__`` kept and every tensor's Adler-32 added."""
    header = layout.headers[shard]
    metadata = {k: v for k, v in header.metadata.items() if k not in header.tensors}
    metadata.update({n: checksums[n] for n in names})
    return encode_header(
        ((n, header.tensors[n].dtype, header.tensors[n].shape, header.tensors[n].nbytes) for n in names), metadata
    )


def full_index(layout: FullLayout) -> str:
    """``model.safetensors.index.json`` of ``layout`` written as a checksummed full snapshot."""
    metadata = {k: v for k, v in layout.index.metadata.items() if k not in DELTA_KEYS}
    metadata["total_size"] = layout.tensor_bytes
    metadata["checksum_format"] = "adler32"
    index = {"metadata": metadata, "weight_map": {n: shard for n, (shard, _) in layout.tensors.items()}}
    return json.dumps(index, indent=2) + "\n"


def side_files(layout: FullLayout) -> list[str]:
    """The base's small non-shard files (config, tokenizer) that go along with its weights."""
    return sorted(
        name
        for name, size in layout.files.items()
        if not name.endswith(SHARD_SUFFIX) and name != INDEX_FILE and size <= MAX_SIDE_FILE_BYTES
    )


def copy_side_files(layout: FullLayout, directory: Path, *, fsync: bool = False) -> None:
    """Copy :func:`side_files` of the base into ``directory``."""
    source = layout.source
    for name in side_files(layout):
        if isinstance(source, LocalSource):
            shutil.copyfile(source.path(name), directory / name)
        else:
            (directory / name).write_bytes(source.read_all(name))
        if fsync:
            fsync_path(directory / name)


# ------------------------------------------------------------------------ reports


@dataclass
class MaterializeReport:
    """What :func:`materialize_chain_report` wrote (``out`` is ``None`` for a checksum pass)."""

    out: Path | None
    tensors: int
    bytes_total: int  # raw tensor bytes of the checkpoint
    deltas: list[DeltaReport] = field(default_factory=list)  # one per link, in chain order
    checksums: dict[str, str] = field(default_factory=dict)  # every tensor, index order

    @property
    def bytes_changed(self) -> int:
        """Raw bytes of changed tensors, summed over the links (a tensor counts once per link)."""
        return sum(r.bytes_changed for r in self.deltas)


# ------------------------------------------------------------------------ reading


class _ThreadBuffers(threading.local):
    def __init__(self) -> None:
        self.data = np.empty(0, dtype=np.uint8)
        self.diff = np.empty(0, dtype=np.uint8)
        self.dctxs: list[zstandard.ZstdDecompressor] = []

    def buffers(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        # Reused across tensors and chunks: fresh allocations would page-fault every time.
        if self.data.nbytes < nbytes:
            self.data = np.empty(nbytes, dtype=np.uint8)
            self.diff = np.empty(nbytes, dtype=np.uint8)
        return self.data, self.diff

    def decompressors(self, count: int) -> list[zstandard.ZstdDecompressor]:
        # One per link: a decompressor drives one stream at a time, and a tensor's links are
        # decompressed in lockstep.
        while len(self.dctxs) < count:
            self.dctxs.append(zstandard.ZstdDecompressor())
        return self.dctxs[:count]


_thread = _ThreadBuffers()


class _TensorReader:
    """Sequential reads of one tensor's bytes in the base: ``readinto(view)`` fills ``view``."""

    def __init__(self, source: Any, shard: str, begin: int, nbytes: int, fd: int | None, tensor: str) -> None:
        self.source, self.shard, self.pos, self.fd = source, shard, begin, fd
        self.file, self.tensor = source.describe(shard), tensor
        self.body: Any = None
        if fd is None and isinstance(source, S3Source) and nbytes:
            # One ranged GET per tensor, read as a stream: one request, bounded memory.
            self.body = source.open_range(shard, begin, nbytes)

    def readinto(self, view: memoryview) -> None:
        want = len(view)
        if self.fd is not None:
            try:
                readinto_exact(self.fd, self.pos, view)
            except HeaderError as exc:
                raise HeaderError(
                    f"{exc.detail} (the shard changed or is truncated)", file=self.file, tensor=self.tensor
                ) from None
        else:
            got = 0
            while got < want:
                if self.body is not None:
                    data = self.body.read(want - got)
                else:
                    data = self.source.read_range(self.shard, self.pos + got, want - got)
                if not data:
                    raise HeaderError(
                        f"object ends at byte {self.pos + got}, inside the tensor", file=self.file, tensor=self.tensor
                    )
                view[got : got + len(data)] = data
                got += len(data)
        self.pos += want

    def close(self) -> None:
        if self.body is not None:
            self.body.close()


@dataclass
class _Link:
    """One delta's frame for one tensor."""

    position: int  # link index in the chain (0-based over the deltas)
    order: int  # the tensor's position in that delta
    item: DeltaTensor
    file: str  # for messages


@dataclass
class _Task:
    """One tensor of the base and the links that change it."""

    name: str
    shard: str
    begin: int
    nbytes: int
    dtype: str
    base_order: int
    recorded: str | None  # the Adler-32 the base records for it
    links: list[_Link] = field(default_factory=list)
    out_offset: int = 0
    link: _Link | None = None  # the link being worked on (None: the base), for failure order

    def failure_key(self) -> tuple[int, int]:
        """Where a failure now sorts among all: the base first, then the links in chain order."""
        return (0, self.base_order) if self.link is None else (self.link.position + 1, self.link.order)


class _Failure(Exception):
    """A tensor's error, with where it sorts among all failures."""

    def __init__(self, key: tuple[int, int], error: BaseException) -> None:
        super().__init__(str(error))
        self.key, self.error = key, error


# ------------------------------------------------------------------------ the pass


@dataclass
class _Pass:
    """One streamed pass over a checkpoint and its chain (see the module doc)."""

    layout: FullLayout
    plans: list[DeltaPlan]
    chunk_bytes: int
    writeback: bool  # start write-back of each written tensor at once (fsync comes later)
    base_fds: dict[str, int] = field(default_factory=dict)  # local base shards
    out_fds: dict[str, int] = field(default_factory=dict)  # new shards, when writing
    abort: threading.Event = field(default_factory=threading.Event)

    def tasks(self) -> list[_Task]:
        tasks = {
            name: _Task(name, shard, entry.begin, entry.nbytes, entry.dtype, i, self.layout.checksums.get(name))
            for i, (name, (shard, entry)) in enumerate(self.layout.tensors.items())
        }
        for position, plan in enumerate(self.plans):
            for order, item in enumerate(plan.tensors.values()):
                file = plan.source.describe(item.file)
                task = tasks.get(item.name)
                if task is None:
                    raise DeltaMismatchError("is in the delta but not in the base", file=file, tensor=item.name)
                if item.sparse is not None:
                    sparse.check_size(item.sparse.values, task.nbytes, task.dtype, file=file, tensor=item.name)
                else:
                    check_wire_size(item.wire_bytes, task.nbytes, file=file, tensor=item.name)
                task.links.append(_Link(position, order, item, file))
        return list(tasks.values())

    def run(self, task: _Task) -> tuple[str, list[str]]:
        """Stream one tensor through its links; returns its final Adler-32 and each link's.
        Any error comes out as a :class:`_Failure` keyed by :meth:`_Task.failure_key`."""
        try:
            return self._stream(task)
        except BaseException as exc:
            self.abort.set()
            if isinstance(exc, zstandard.ZstdError):
                file = task.link.file if task.link else None
                exc = DeltaMismatchError(f"corrupt zstd frame ({exc})", file=file, tensor=task.name)
            raise _Failure(task.failure_key(), exc) from exc

    def _frames(self, task: _Task) -> list[Any]:
        """Each link's zstd frame, checked, or (a sparse link) its positions and values."""
        frames: list[Any] = []
        for task.link in task.links:
            item, source = task.link.item, self.plans[task.link.position].source
            if item.sparse is not None:
                frames.append(sparse.read(source, item.sparse, task.nbytes, file=task.link.file))
                continue
            frame = source.read_range(item.file, item.begin, item.wire_bytes)
            if len(frame) != item.wire_bytes:
                raise DeltaMismatchError("frame is truncated", file=task.link.file, tensor=task.name)
            frames.append(check_frame(frame, task.nbytes, file=task.link.file, tensor=task.name))
        task.link = None
        return frames

    def _stream(self, task: _Task) -> tuple[str, list[str]]:
        frames = self._frames(task)
        out_fd = self.out_fds.get(task.shard)
        data_buf, diff_buf = _thread.buffers(min(self.chunk_bytes, max(task.nbytes, 1)))
        decompressors = _thread.decompressors(len(frames))
        readers = [
            f if isinstance(f, tuple) else d.stream_reader(f, read_across_frames=False)
            for d, f in zip(decompressors, frames)
        ]
        # Running Adler-32 of the base bytes, then of the bytes after each link.
        running = [adler32(b"")] * (len(frames) + 1)
        base = _TensorReader(
            self.layout.source, task.shard, task.begin, task.nbytes, self.base_fds.get(task.shard), task.name
        )
        try:
            done = 0
            while done < task.nbytes:
                if self.abort.is_set():  # another tensor failed: the output is discarded anyway
                    return "", []
                step = min(self.chunk_bytes, task.nbytes - done)
                data, diff = data_buf[:step], diff_buf[:step]
                task.link = None
                base.readinto(data.data)
                if not task.links:  # a changed tensor is proven by its links' checksums instead
                    running[0] = adler32(data, running[0])
                for k, (task.link, reader) in enumerate(zip(task.links, readers)):
                    if isinstance(reader, tuple):  # a sparse link: its positions and values
                        sparse.scatter_chunk(data, done, *reader)
                        running[k + 1] = adler32(data, running[k + 1])
                        continue
                    got = fill_from(reader, diff.data)
                    if got != step:
                        check_inflated(done + got, b"", task.nbytes, file=task.link.file, tensor=task.name)
                    np.bitwise_xor(data, diff, out=data)
                    running[k + 1] = adler32(data, running[k + 1])
                if out_fd is not None:
                    _pwrite_all(out_fd, data.data, task.out_offset + done)
                done += step
            if out_fd is not None and self.writeback and task.nbytes:
                # Start writing this tensor to disk now (asynchronously: Linux's FADV_DONTNEED
                # starts write-back of dirty pages and drops only clean ones), so the final
                # fsync finds most of the checkpoint written instead of all of it to do.
                os.posix_fadvise(out_fd, task.out_offset, task.nbytes, os.POSIX_FADV_DONTNEED)
            for task.link, reader in zip(task.links, readers):
                # One byte more than the tensor is refused, and never more than that is inflated.
                if not isinstance(reader, tuple):
                    check_inflated(task.nbytes, reader.read(1), task.nbytes, file=task.link.file, tensor=task.name)
        finally:
            base.close()
            for reader in readers:
                if not isinstance(reader, tuple):
                    reader.close()
        digests = [f"{r & 0xFFFFFFFF:08x}" for r in running]
        task.link = None
        if not task.links and task.recorded is not None and digests[0] != task.recorded:
            raise ChecksumError(
                f"checksum mismatch: __metadata__ records {task.recorded}, the bytes have {digests[0]}",
                file=self.layout.source.describe(task.shard),
                tensor=task.name,
            )
        for k, task.link in enumerate(task.links):
            if digests[k + 1] != task.link.item.checksum:
                raise ChecksumError(
                    f"checksum mismatch: the writer recorded {task.link.item.checksum}, the "
                    f"reconstructed bytes have {digests[k + 1]}",
                    file=task.link.file,
                    tensor=task.name,
                )
        return digests[-1], digests[1:]


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _run(
    layout: FullLayout, plans: list[DeltaPlan], tmp: Path | None, *, workers: int, chunk_bytes: int, fsync: bool
) -> MaterializeReport:
    """The pass over every tensor; writes the new shards into ``tmp`` when it is given."""
    p = _Pass(layout, plans, chunk_bytes, writeback=fsync)
    tasks = p.tasks()
    by_name = {t.name: t for t in tasks}
    order = shard_tensor_order(layout)
    results: dict[str, tuple[str, list[str]]] = {}
    failures: list[_Failure] = []
    try:
        if isinstance(layout.source, LocalSource):
            for shard in layout.index.shards:
                p.base_fds[shard] = os.open(layout.source.path(shard), os.O_RDONLY)
        if tmp is not None:
            placeholder = dict.fromkeys(layout.tensors, _PLACEHOLDER)
            for shard, names in order.items():
                offset = len(full_shard_header(layout, shard, names, placeholder))
                for name in names:
                    by_name[name].out_offset = offset
                    offset += by_name[name].nbytes
                p.out_fds[shard] = os.open(tmp / shard, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.ftruncate(p.out_fds[shard], offset)
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(tasks)))) as pool:
            try:
                # Largest first, so no big tensor starts last and runs alone.
                futures = {t.name: pool.submit(p.run, t) for t in sorted(tasks, key=lambda t: -t.nbytes)}
                for name, future in futures.items():
                    try:
                        results[name] = future.result()
                    except _Failure as failure:
                        failures.append(failure)
            except BaseException:
                p.abort.set()  # interrupted: stop the workers at their next chunk
                raise
        if failures:
            raise min(failures, key=lambda f: f.key).error
        checksums = {name: results[name][0] for name in layout.tensors}
        if tmp is not None:
            for shard, names in order.items():
                head = full_shard_header(layout, shard, names, checksums)
                if len(head) != by_name[names[0]].out_offset:
                    raise AssertionError(f"{shard}: header changed size")  # checksums are 8 hex digits
                _pwrite_all(p.out_fds[shard], memoryview(head), 0)
            if fsync:
                with ThreadPoolExecutor(max_workers=max(1, min(workers, len(p.out_fds)))) as pool:
                    list(pool.map(os.fsync, p.out_fds.values()))
    finally:
        for fd in (*p.base_fds.values(), *p.out_fds.values()):
            os.close(fd)
    report = MaterializeReport(None, len(layout.tensors), layout.tensor_bytes, checksums=checksums)
    for position, plan in enumerate(plans):
        delta = DeltaReport(plan.uri, plan.version, plan.base_version)
        for item in plan.tensors.values():
            task = by_name[item.name]
            k = next(i for i, link in enumerate(task.links) if link.position == position)
            delta.changed.append(item.name)
            delta.bytes_changed += task.nbytes
            delta.wire_bytes += item.wire_bytes
            delta.checksums[item.name] = results[item.name][1][k]
        report.deltas.append(delta)
    return report


def _prepare(base: Any, deltas: Sequence[Any], s3: Any) -> tuple[FullLayout, list[DeltaPlan]]:
    layout = base if isinstance(base, FullLayout) else read_full_layout(base, s3=s3)
    plans = [d if isinstance(d, DeltaPlan) else read_delta_plan(d, s3=s3) for d in deltas]
    return layout, plans


def materialize_chain_report(
    base: Any,
    deltas: Sequence[Any],
    out_dir: str | os.PathLike[str],
    *,
    s3: Any = None,
    workers: int | None = None,
    fsync: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
    discard: Callable[[Path], None] = shutil.rmtree,
) -> MaterializeReport:
    """Reconstruct ``base`` + ``deltas`` as a full checkpoint directory ``out_dir`` (module doc).

    Args:
        base: A full checkpoint directory, ``s3://`` prefix or :class:`FullLayout`.
        deltas: Delta directories, ``s3://`` prefixes or :class:`DeltaPlan` s, in chain order
            (may be empty: the base is re-written with checksums).
        out_dir: Replaced whole on success; may be ``base`` itself (an in-place apply).
        s3: A boto3 S3 client for ``s3://`` locations.
        fsync: Make the new files durable before they replace ``out_dir``.
        discard: Removes what ``out_dir`` held once the new checkpoint replaced it
            (snapshots/replace.py; :func:`remove_in_background` returns at once).

    Raises:
        SnapshotError: naming file and tensor; ``out_dir`` is untouched.
        ValueError: ``chunk_bytes`` is not a positive multiple of 8.
    """
    if chunk_bytes <= 0 or chunk_bytes % 8:
        raise ValueError(f"chunk_bytes {chunk_bytes}: a positive multiple of 8 (no element may straddle two chunks)")
    layout, plans = _prepare(base, deltas, s3)
    out = Path(out_dir)
    with replacing_directory(out, fsync=fsync, discard=discard) as tmp:
        report = _run(layout, plans, tmp, workers=workers or default_workers(), chunk_bytes=chunk_bytes, fsync=fsync)
        (tmp / INDEX_FILE).write_text(full_index(layout))
        copy_side_files(layout, tmp, fsync=fsync)
        if fsync:
            fsync_path(tmp / INDEX_FILE)
            fsync_path(tmp)
    report.out = out
    return report


def stream_checksums(
    base: Any,
    deltas: Sequence[Any] = (),
    *,
    s3: Any = None,
    workers: int | None = None,
    verify: bool = True,
) -> dict[str, str]:
    """Adler-32 of every tensor of ``base`` + ``deltas``, computed in one bounded-memory pass.

    Args:
        verify: Also check the checksums the base records and the deltas' (as
            :func:`materialize_chain_report` does); without it, the base's bytes are just summed.

    Raises:
        SnapshotError: naming file and tensor.
    """
    layout, plans = _prepare(base, deltas, s3)
    if not verify:
        layout = FullLayout(layout.source, layout.index, layout.files, layout.headers, layout.tensors, {})
    return _run(
        layout, plans, None, workers=workers or default_workers(), chunk_bytes=CHUNK_BYTES, fsync=False
    ).checksums


__all__ = [
    "CHUNK_BYTES",
    "DELTA_KEYS",
    "MAX_SIDE_FILE_BYTES",
    "MaterializeReport",
    "copy_side_files",
    "full_index",
    "full_shard_header",
    "materialize_chain_report",
    "shard_tensor_order",
    "side_files",
    "stream_checksums",
]
