"""Replica lists in a workflow's memo, in chunks, so a change rewrites only its own chunk.

A memo upsert lands in the workflow's history with every key it sets. A deployment or hot-load
of N replicas whose whole replica list were one key would write N entries on each of its ~N
changes (N² bytes: past Temporal's 50 MB history limit near a few hundred replicas). The list is
kept instead under `replicas.0`, `replicas.1`, ..., and a writer upserts only the chunks that
changed (`ChunkedList.changes`); a reader joins them (`replica_list`). A list whose order never
changes (a hot-load's walk) is cut in order, `CHUNK` entries each; a list whose members come and
go (a deployment's replicas) is bucketed by name (`by_name`: a hash of the name picks one of
`NAME_BUCKETS` chunks), so one member's arrival rewrites one chunk, not every chunk after it. A
memo written before chunking holds the whole list under `replicas`.
"""

from __future__ import annotations

import zlib
from typing import Any

KEY = "replicas"
CHUNK = 16
NAME_BUCKETS = 64


def chunk_key(index: int, key: str = KEY) -> str:
    return f"{key}.{index}"


def replica_list(memo: dict[str, Any], key: str = KEY) -> list[dict[str, Any]]:
    """The memo's replica list: its chunks in order (or the whole list of an older memo)."""
    chunks = sorted(
        (int(k.removeprefix(f"{key}.")), v)
        for k, v in memo.items()
        if k.startswith(f"{key}.") and k.removeprefix(f"{key}.").isdigit()
    )
    if not chunks:
        return list(memo.get(key) or [])
    return [entry for _, part in chunks for entry in (part or [])]


class ChunkedList:
    """What a writer last published of one list, to upsert only the chunks that changed."""

    def __init__(self, key: str = KEY, *, by_name: bool = False) -> None:
        self.key = key
        self.by_name = by_name
        self.published: dict[str, list[dict[str, Any]]] = {}

    def changes(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """The memo keys to upsert for `entries` as the list now stands: changed chunks, and
        None (deletes the key) for chunks past its end. Empty: nothing changed."""
        if self.by_name:
            chunks: dict[str, list[dict[str, Any]]] = {}
            for entry in entries:
                bucket = zlib.crc32(str(entry.get("name", "")).encode()) % NAME_BUCKETS
                chunks.setdefault(chunk_key(bucket, self.key), []).append(entry)
        else:
            chunks = {chunk_key(i // CHUNK, self.key): entries[i : i + CHUNK] for i in range(0, len(entries), CHUNK)}
        out: dict[str, Any] = {k: v for k, v in chunks.items() if self.published.get(k) != v}
        out.update({k: None for k in self.published if k not in chunks})
        if not self.published:
            out[self.key] = None  # an older memo's whole list, if any, gives way to the chunks
        self.published = chunks
        return out
