"""One decode of an update per host: replicas that stage the same delta links on the same weights
copy the first one's checked result instead of decoding it again.

:func:`publish` writes ``rollouts-decoded-KEY.json`` (arena path, each tensor's offset, size and
Adler-32, the names each link changed, a fresh generation) after a checked decode; KEY
(:func:`decode_key`) digests the weights decoded against and every link's identity and files
(a shard's header, which holds each tensor's frame and Adler-32, else the whole file), so only
the same update on the same weights finds it, and a copier finds it before it reads any delta
plan. :meth:`Publication.withdraw` unlinks it before its arena is rewritten and at stop; stale
records are removed by the next publish or agent start (:func:`remove_stale`).
:func:`read_published` then :func:`copy_published` check every copied tensor's Adler-32 against
the record (whose key binds the headers the decode checked them against) and that the
generation did not change; any miss returns ``None`` and the caller decodes itself.
Invariant: sharing only saves time, it never changes what is staged.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from snapshots.codec import adler32, default_workers, task_batches
from snapshots.safetensors_io import HEADER_PROBE_BYTES

#: Bytes copied and checksummed per step: the copy's bytes are still in the CPU cache when
#: their Adler-32 is computed.
CHUNK_BYTES = 1 << 20


def decode_key(applied: Sequence[str], links: Sequence[str], link_dirs: Sequence[Path]) -> str:
    """The digest that names one update decoded on one set of weights (module docstring)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(list(applied)).encode())
    for link, directory in zip(links, link_dirs, strict=True):
        digest.update(json.dumps(link).encode())
        for path in sorted(p for p in Path(directory).iterdir() if p.is_file()):
            digest.update(json.dumps(path.name).encode())
            digest.update(_identifying_bytes(path))
    return digest.hexdigest()[:32]


def _identifying_bytes(path: Path) -> bytes:
    """A safetensors shard's length prefix and header (every frame's place and its tensor's
    Adler-32: what a decode checks against), else the whole (small) file."""
    with open(path, "rb") as f:
        if not path.name.endswith(".safetensors"):
            return f.read()
        probe = f.read(HEADER_PROBE_BYTES)
        length = int.from_bytes(probe[:8], "little") if len(probe) >= 8 else 0
        return probe[: 8 + length] + f.read(max(0, 8 + length - len(probe)))


def record_path(directory: Path, key: str) -> Path:
    return directory / f"rollouts-decoded-{key}.json"


@dataclass
class Publication:
    """A published decode; withdraw it before its arena is written again."""

    path: Path
    generation: str

    def withdraw(self) -> None:
        try:
            if json.loads(self.path.read_text()).get("generation") == self.generation:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def publish(
    directory: Path,
    key: str,
    arena_path: str,
    arena_size: int,
    tensors: dict[str, tuple[int, int, str]],
    changed: dict[str, list[str]],
) -> Publication:
    """Record that ``arena_path`` holds, at ``tensors`` (name -> (offset, nbytes, Adler-32)), the
    checked decode named ``key``, whose links changed ``changed`` (link -> names); the record
    replaces any earlier one of the same key atomically."""
    remove_stale(directory)
    generation = uuid.uuid4().hex
    path = record_path(directory, key)
    tmp = path.with_name(f".{path.name}.{generation}")  # unique: publishers never share it
    tmp.write_text(
        json.dumps(
            {
                "arena": arena_path,
                "size": arena_size,
                "generation": generation,
                "tensors": {n: list(v) for n, v in tensors.items()},
                "changed": changed,
            }
        )
    )
    tmp.replace(path)
    return Publication(path, generation)


@dataclass
class Published:
    """A decode record as read: where each tensor lies in ``arena`` and its checked Adler-32."""

    path: Path
    arena: str
    size: int
    generation: str
    places: dict[str, tuple[int, int]]  # name -> (offset, nbytes)
    checksums: dict[str, str]
    changed: dict[str, list[str]]  # link -> the names it changed


def read_published(directory: Path, key: str) -> Published | None:
    """The record published as ``key``, if there is one and it is well formed."""
    path = record_path(directory, key)
    record = _read_record(path)
    if record is None:
        return None
    try:
        places, checksums = {}, {}
        for name, (offset, nbytes, checksum) in record["tensors"].items():
            places[str(name)] = (int(offset), int(nbytes))
            checksums[str(name)] = str(checksum).lower()
        changed = {str(link): [str(n) for n in names] for link, names in record["changed"].items()}
        published = Published(
            path, str(record["arena"]), int(record["size"]), str(record["generation"]), places, checksums, changed
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if any(offset < 0 or offset + nbytes > published.size for offset, nbytes in places.values()):
        return None
    if any(name not in places for names in changed.values() for name in names):
        return None
    return published


def read_records(directory: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every readable decode record in ``directory``, with its path."""
    records = []
    for path in directory.glob("rollouts-decoded-*.json"):
        record = _read_record(path)
        if record is not None:
            records.append((path, record))
    return records


def arena_pid(record: dict[str, Any]) -> int | None:
    """The process whose arena a record names (``/proc/PID/fd/FD``); None if it names no such path."""
    parts = str(record.get("arena", "")).split("/")
    if len(parts) == 5 and parts[1] == "proc" and parts[2].isdigit():
        return int(parts[2])
    return None


def remove_stale(directory: Path) -> list[Path]:
    """Remove the records of agents that are gone (their arena's process no longer exists);
    returns what was removed."""
    removed = []
    for path, record in read_records(directory):
        pid = arena_pid(record)
        if pid is not None and not Path("/proc", str(pid)).exists():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _copy_checked(src: np.ndarray, dst: np.ndarray) -> str:
    value = 1
    for start in range(0, dst.nbytes, CHUNK_BYTES):
        chunk = dst[start : start + CHUNK_BYTES]
        np.copyto(chunk, src[start : start + CHUNK_BYTES])
        value = adler32(chunk, value)
    return f"{value & 0xFFFFFFFF:08x}"


def _copy_all(
    mapped: mmap.mmap, places: dict[str, tuple[int, int]], out: dict[str, np.ndarray], workers: int
) -> dict[str, str]:
    """Copy every tensor out of the mapped arena, largest first, on ``workers`` threads; returns
    each copy's Adler-32 (no view of the mapping outlives the call)."""
    source = np.frombuffer(mapped, dtype=np.uint8)
    names = sorted(out, key=lambda n: -out[n].nbytes)

    def some(batch: list[str]) -> list[str]:
        out_ = []
        for name in batch:
            offset, nbytes = places[name]
            out_.append(_copy_checked(source[offset : offset + nbytes], out[name]))
        return out_

    # Several tensors per task (a task per tensor costs more than copying a small one).
    workers = max(1, min(workers, len(names)))
    batches = [names[r.start : r.stop] for r in task_batches([out[n].nbytes for n in names], workers)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, (d for digests in pool.map(some, batches) for d in digests)))


def copy_published(published: Published, out: dict[str, np.ndarray], *, workers: int | None = None) -> str | None:
    """Fill ``out`` (name -> flat buffer: every tensor ``published`` holds, each its size) from
    the published decode, every tensor checked against the record's Adler-32; returns the arena
    copied from, or ``None`` when the caller must decode itself (module docstring)."""
    if set(out) != set(published.places):
        return None
    if any(published.places[n][1] != buf.nbytes for n, buf in out.items()):
        return None
    try:
        fd = os.open(published.arena, os.O_RDONLY)
    except OSError:
        return None  # its agent is gone, or the descriptor was closed
    try:
        if os.fstat(fd).st_size < published.size:
            return None
        mapped = mmap.mmap(fd, published.size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    try:
        digests = _copy_all(mapped, published.places, out, workers or default_workers())
    finally:
        try:
            mapped.close()
        except BufferError:
            pass
    if any(digests[n] != published.checksums[n] for n in out):
        return None
    again = _read_record(published.path)
    if again is None or again.get("generation") != published.generation:
        return None
    return published.arena
