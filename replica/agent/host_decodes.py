"""One decode of an update per host: replicas that stage the same delta links on the same weights
copy the first one's checked result instead of decoding it again.

:func:`publish` writes ``rollouts-decoded-KEY.json`` (arena path, each tensor's offset and size,
a fresh generation) after a checked decode; KEY (:func:`decode_key`) digests the weights
decoded against and every link's identity and checksums, so only the same update on the same
weights finds it. :meth:`Publication.withdraw` unlinks it before its arena is rewritten and at
stop; stale records are removed by the next publish or agent start (:func:`remove_stale`).
:func:`copy_published` checks every copied tensor's Adler-32 against the caller's own delta
record and that the generation did not change; any miss returns ``None`` and the caller decodes
itself. Invariant: sharing only saves time, it never changes what is staged.
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
from snapshots.inspect import DeltaPlan

#: Bytes copied and checksummed per step: the copy's bytes are still in the CPU cache when
#: their Adler-32 is computed.
CHUNK_BYTES = 1 << 20


def decode_key(applied: Sequence[str], links: Sequence[str], plans: Sequence[DeltaPlan]) -> str:
    """The digest that names one update decoded on one set of weights (module docstring)."""
    digest = hashlib.sha256()
    digest.update(json.dumps(list(applied)).encode())
    for link, plan in zip(links, plans, strict=True):
        digest.update(json.dumps([link, sorted((t.name, t.checksum) for t in plan.tensors.values())]).encode())
    return digest.hexdigest()[:32]


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
    directory: Path, key: str, arena_path: str, arena_size: int, tensors: dict[str, tuple[int, int]]
) -> Publication:
    """Record that ``arena_path`` holds, at ``tensors`` (name -> (offset, nbytes)), the checked
    decode named ``key``; the record replaces any earlier one of the same key atomically."""
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
            }
        )
    )
    tmp.replace(path)
    return Publication(path, generation)


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


def copy_published(
    directory: Path, key: str, out: dict[str, np.ndarray], expected: dict[str, str], *, workers: int | None = None
) -> str | None:
    """Fill ``out`` (name -> flat buffer) from the decode published as ``key``, every tensor
    checked against ``expected``; returns the arena copied from, or ``None`` when the caller
    must decode itself (module docstring: nothing is trusted that was not checked)."""
    path = record_path(directory, key)
    record = _read_record(path)
    if record is None:
        return None
    try:
        places = {n: (int(record["tensors"][n][0]), int(record["tensors"][n][1])) for n in out}
        size, arena, generation = int(record["size"]), str(record["arena"]), record["generation"]
    except (KeyError, TypeError, ValueError, IndexError):
        return None
    if any(nbytes != out[n].nbytes or offset + nbytes > size for n, (offset, nbytes) in places.items()):
        return None
    if set(out) != set(expected):
        return None
    try:
        fd = os.open(arena, os.O_RDONLY)
    except OSError:
        return None  # its agent is gone, or the descriptor was closed
    try:
        if os.fstat(fd).st_size < size:
            return None
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    try:
        digests = _copy_all(mapped, places, out, workers or default_workers())
    finally:
        try:
            mapped.close()
        except BufferError:
            pass
    if any(digests[n] != expected[n].lower() for n in out):
        return None
    again = _read_record(path)
    if again is None or again.get("generation") != generation:
        return None
    return arena
