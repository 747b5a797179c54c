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

from snapshots.codec import adler32, default_workers, task_batches, threads_for
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
    replaces any earlier one of the same key atomically. Laid out as parallel lists (what a
    copier parses fastest at tens of thousands of tensors)."""
    remove_stale(directory)
    generation = uuid.uuid4().hex
    path = record_path(directory, key)
    tmp = path.with_name(f".{path.name}.{generation}")  # unique: publishers never share it
    names = list(tensors)
    position = {name: i for i, name in enumerate(names)}
    tmp.write_text(
        json.dumps(
            {
                "arena": arena_path,
                "size": arena_size,
                "generation": generation,
                "names": names,
                "offsets": [tensors[n][0] for n in names],
                "sizes": [tensors[n][1] for n in names],
                "checksums": [tensors[n][2] for n in names],
                "changed": {link: [position[n] for n in changed_names] for link, changed_names in changed.items()},
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
    """The record published as ``key``, if there is one and it is well formed (every tensor's
    bytes inside its arena, every change one of its tensors)."""
    path = record_path(directory, key)
    record = _read_record(path)
    if record is None:
        return None
    try:
        names, sums = record["names"], record["checksums"]
        offsets = np.asarray(record["offsets"])
        sizes = np.asarray(record["sizes"])
        size = int(record["size"])
        if not (len(names) == len(sums) == len(offsets) == len(sizes)) or len(set(names)) != len(names):
            return None
        if not all(type(n) is str for n in names) or not all(type(c) is str for c in sums):
            return None
        if names and (offsets.dtype.kind != "i" or sizes.dtype.kind != "i"):
            return None
        if names and (int(offsets.min()) < 0 or int(sizes.min()) < 0 or int((offsets + sizes).max()) > size):
            return None
        if any(type(i) is not int or i < 0 for positions in record["changed"].values() for i in positions):
            return None
        changed = {str(link): [names[i] for i in positions] for link, positions in record["changed"].items()}
        places = dict(zip(names, zip(offsets.tolist(), sizes.tolist(), strict=True), strict=True))
        checksums = dict(zip(names, (c.lower() for c in sums), strict=True))
        return Published(path, str(record["arena"]), size, str(record["generation"]), places, checksums, changed)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError):
        return None


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
    return _hex(value)


def _copy_all(
    mapped: mmap.mmap,
    names: list[str],
    places: dict[str, tuple[int, int]],
    dest: np.ndarray,
    layout: dict[str, tuple[int, int]],
    runs: bool,
    workers: int,
) -> dict[str, str]:
    """Copy every tensor out of the mapped arena into ``dest`` at ``layout`` (name -> (offset,
    nbytes)), in the arena's order on ``workers`` threads, a run of tensors lying the same
    distance apart in both (the same layout: its padding is padding in both) in one copy;
    returns each copy's Adler-32 (no view of the mapping outlives the call). ``names``: in the
    arena's order; ``runs``: their ``layout`` places are in the same order (else one at a time)."""
    source = np.frombuffer(mapped, dtype=np.uint8)

    def some(batch: list[str]) -> list[str]:
        digests: list[str] = []
        i = 0
        while i < len(batch):
            j = _run_end(batch, i, places, layout) if runs else i + 1
            first = places[batch[i]][0]
            shift = layout[batch[i]][0] - first
            if j == i + 1:  # one tensor (a large one: copied and summed a chunk at a time)
                size = places[batch[i]][1]
                digests.append(_copy_checked(source[first : first + size], dest[first + shift : first + shift + size]))
            else:
                last, size = places[batch[j - 1]]
                end = last + size
                np.copyto(dest[first + shift : end + shift], source[first:end])
                digests.extend(_hex(adler32(dest[o : o + n])) for o, n in (layout[name] for name in batch[i:j]))
            i = j
        return digests

    # Several tensors per task (a task per tensor costs more than copying a small one), and small
    # ones on one thread (`snapshots.codec.threads_for`).
    sizes = [layout[n][1] for n in names]
    workers = threads_for(sizes, workers)
    batches = [names[r.start : r.stop] for r in task_batches(sizes, workers)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, (d for digests in pool.map(some, batches) for d in digests)))


def _run_end(batch: list[str], i: int, places: dict[str, tuple[int, int]], layout: dict[str, tuple[int, int]]) -> int:
    """Where the run of ``batch[i:]`` copied at once ends: tensors after each other in the arena,
    the same distance apart in ``layout``, up to ``CHUNK_BYTES`` (the copy still in the CPU cache
    when its Adler-32 are computed)."""
    first, size = places[batch[i]]
    shift = layout[batch[i]][0] - first
    end, j = first + size, i + 1
    while j < len(batch) and end - first < CHUNK_BYTES:
        offset, nbytes = places[batch[j]]
        if offset < end or layout[batch[j]][0] - offset != shift or end + nbytes - first > CHUNK_BYTES:
            break
        end, j = offset + nbytes, j + 1
    return j


def _hex(value: int) -> str:
    return f"{value & 0xFFFFFFFF:08x}"


def copy_published(
    published: Published, dest: np.ndarray, layout: dict[str, tuple[int, int]], *, workers: int | None = None
) -> str | None:
    """Fill ``dest`` at ``layout`` (name -> (offset, nbytes): every tensor ``published`` holds,
    each its size) from the published decode, every tensor checked against the record's
    Adler-32; returns the arena copied from, or ``None`` when the caller must decode itself
    (module docstring)."""
    if set(layout) != set(published.places):
        return None
    if any(published.places[n][1] != nbytes or offset + nbytes > dest.nbytes for n, (offset, nbytes) in layout.items()):
        return None
    names = sorted(layout, key=lambda n: published.places[n][0])
    # A run copied at once must not write into another tensor's place: runs only where the
    # layout keeps the arena's order.
    runs = all(layout[b][0] >= layout[a][0] + layout[a][1] for a, b in zip(names, names[1:]))
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
        digests = _copy_all(mapped, names, published.places, dest, layout, runs, workers or default_workers())
    finally:
        try:
            mapped.close()
        except BufferError:
            pass
    if any(digests[n] != published.checksums[n] for n in layout):
        return None
    again = _read_record(published.path)
    if again is None or again.get("generation") != published.generation:
        return None
    return published.arena
