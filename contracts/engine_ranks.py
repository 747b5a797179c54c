"""One answer from the ranks of a tensor-parallel engine: vLLM's ``collective_rpc`` returns a
result per worker, and both the agent's engine client and a Dynamo worker's swap route combine
them with these rules.

A swap is all-or-nothing across ranks: every rank swaps and proves its own shard with the stage
held (`replica.engine.stage`); :func:`combine_swap` says ``read_back_failed`` (naming every tensor
any rank failed) when one rank failed, and the caller then discards the stage on every rank, so
the ranks that proved theirs roll back too; else ``verified`` (each rank proves every staged
tensor's shard: one count) with the slowest rank's timings and every rank's bytes added up
(`BYTE_COUNTS`: what each rank moved into its shard inside the pause, and staged before it). A background job's result
is the first rank's, with every rank's failure named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

TIMINGS = ("copy_s", "repack_s", "verify_s")
# A swap's bytes (replica/engine/scatter.py): elements changed, bytes staged before the pause, bytes
# written into the engine inside it, what of the stage is held on the engine's device, and what
# in pinned host memory.
BYTE_COUNTS = ("changed_bytes", "staged_bytes", "pause_bytes", "device_staged_bytes", "pinned_staged_bytes")


def swap_bytes(swap: dict[str, Any]) -> dict[str, int]:
    """The byte counts of an engine's swap report (empty for an engine that reports none)."""
    return {k: int(swap[k]) for k in BYTE_COUNTS if k in swap}


def combine_swap(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if len(results) == 1:
        return dict(results[0])
    failed = sorted({n for r in results for n in r.get("read_back_failed", [])})
    if failed:
        return {"read_back_failed": failed, "rolled_back": True, "ranks": len(results)}
    counts = {int(r.get("verified", -1)) for r in results}
    if len(counts) != 1:
        raise ValueError(f"the engine's ranks proved different numbers of tensors: {sorted(counts)}")
    out: dict[str, Any] = {"verified": counts.pop(), **slowest(results)}
    checksums: dict[str, str] = {}
    for r in results:
        checksums.update(r.get("checksums", {}))
    if checksums:
        out["checksums"] = checksums
    return out


def slowest(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A swap's report from every rank (no proof yet): the slowest rank's timings."""
    if len(results) == 1:
        return dict(results[0])
    out: dict[str, Any] = {"ranks": len(results)}
    for key in TIMINGS:
        if any(key in r for r in results):
            out[key] = max(float(r.get(key, 0.0)) for r in results)
    for key in BYTE_COUNTS:
        if any(key in r for r in results):
            out[key] = sum(int(r.get(key, 0)) for r in results)
    return out


# Why a checkpoint tensor that every rank of an engine finds another rank's is refused.
HELD_BY_NO_RANK = "no rank of the engine holds it (each rank's expert layer maps it to another rank)"


def combine_map(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The weight maps of every rank: what every rank holds in place, what any rank refuses, and
    ``orphans``: the tensors every rank finds elsewhere (expert parallelism), which no rank holds,
    so the caller has every rank refuse them (``refuse_tensors``) before any stage."""
    refused: dict[str, str] = {}
    for r in results:
        refused.update(r.get("refused", {}))
    orphans = set.intersection(*(set(r.get("elsewhere", ())) for r in results))
    return {
        "tensors": int(results[0]["tensors"]),
        "held": min(int(r["held"]) for r in results),
        "refused": refused,
        "refused_count": max(int(r["refused_count"]) for r in results),
        "build_s": max(float(r["build_s"]) for r in results),
        "ranks": len(results),
        "orphans": sorted(orphans),
    }
