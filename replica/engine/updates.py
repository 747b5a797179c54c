"""The bodies of the engine's background jobs (`replica.engine.jobs`), free of vLLM: each takes
the engine's `weight_map.WeightMap` and returns a JSON-able report.

Stages (each returns ``(Stage, report)``): :func:`stage_from_files` (checked against the
expected Adler-32), :func:`stage_from_arena` (zero-copy views of the agent's stage arena, proven
at the commit in any case), :func:`stage_from_peer` (checked against the sender's Adler-32,
saved for the agent's host copy). Transfers: :func:`send_views`, :func:`send_files`,
:func:`receive_files`; :func:`served_checksums`. ``join`` returns a joined `PeerGroup`, which is
closed whatever happens.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from replica.engine import stage as stages
from replica.engine.files import plain_file_name, read_file_tensor, read_safetensors, save_tensors, write_files
from replica.engine.peer_group import PeerGroup
from replica.engine.shared_memory import Views, map_shared
from replica.engine.tensors import adler32_hex, check_expected, dtype_from_str, normalize_specs
from replica.engine.weight_map import WeightMap

Join = Callable[[], PeerGroup]


def _size(tensors: list[tuple[str, torch.Tensor]]) -> int:
    return sum(t.nbytes for _, t in tensors)


def stage_from_files(
    wmap: WeightMap, label: str, paths: list[str], names: list[str] | None, expected: dict[str, str] | None
) -> tuple[stages.Stage, dict[str, Any]]:
    tensors = read_safetensors(paths, names)
    check_expected(tensors, expected)
    stage = stages.take(wmap, label, tensors, expected_adler32=expected, checked=True)
    return stage, {"staged": label, "tensors": len(tensors), "bytes": _size(tensors)}


def stage_from_arena(
    wmap: WeightMap,
    label: str,
    path: str,
    entries: list[list[Any]],
    expected: dict[str, str],
    verify: bool,
    backup_path: str | None,
    backup_offsets: dict[str, int] | None,
) -> tuple[stages.Stage, dict[str, Any]]:
    """``entries`` are ``[name, dtype, shape, byte offset]`` in the file at ``path``; every one
    needs an expected Adler-32. ``backup_path`` + ``backup_offsets`` (name -> offset): where the
    agent's host copy holds each tensor as the engine serves it now."""
    expected = {n: c.lower() for n, c in expected.items()}
    t0 = time.perf_counter()
    arena = Views(map_shared(path), "arena")
    dtypes: dict[str, torch.dtype] = {}
    tensors = []
    for name, dtype, shape, offset in entries:
        torch_dtype = dtypes.get(str(dtype))
        if torch_dtype is None:
            torch_dtype = dtypes[str(dtype)] = dtype_from_str(str(dtype))
        tensors.append((str(name), arena.at(str(name), int(offset), torch_dtype, tuple(map(int, shape)))))
    missing = [n for n, _ in tensors if n not in expected]
    if missing:
        raise ValueError(f"no expected Adler-32 for {missing[:8]}")
    t1 = time.perf_counter()
    if verify:
        check_expected(tensors, expected)
    t2 = time.perf_counter()
    backup = None
    if backup_path is not None:
        offsets = backup_offsets or {}
        missing_backup = [n for n, _ in tensors if n not in offsets]
        if missing_backup:
            raise ValueError(f"no roll-back bytes given for {missing_backup[:8]}")
        host = Views(map_shared(backup_path), "host copy")
        backup = {n: host.at(n, int(offsets[n]), t.dtype, tuple(t.shape)) for n, t in tensors}
    t3 = time.perf_counter()
    # A delta's tensors: the swap writes only the elements it changes (`scatter`).
    stage = stages.take(wmap, label, tensors, backup, expected, checked=verify, sparse=True)
    t4 = time.perf_counter()
    return stage, {
        "staged": label,
        "tensors": len(tensors),
        "bytes": _size(tensors),
        "map_s": round(t1 - t0, 6),
        "check_s": round(t2 - t1, 6),
        "backup_s": round(t3 - t2, 6),
        "plan_s": round(t4 - t3, 6),
        "backup": "host copy" if backup_path is not None else "copied",
    }


def stage_from_peer(
    wmap: WeightMap,
    label: str,
    join: Join,
    specs: list[list[Any]],
    expected: dict[str, str] | None,
    save_path: str | None,
) -> tuple[stages.Stage, dict[str, Any]]:
    wanted = normalize_specs(specs)
    group = join()
    try:
        received = group.receive(wanted, 0)
    finally:
        group.close()
    check_expected(received, expected)
    if save_path:
        save_tensors(received, save_path)
    stage = stages.take(wmap, label, received, expected_adler32=expected, checked=True, sparse=True)
    return stage, {"staged": label, "tensors": len(received), "bytes": _size(received)}


def send_views(wmap: WeightMap, names: list[str] | None, join: Join) -> dict[str, Any]:
    """Send what the engine holds for ``names`` as rank 0; tensors it cannot read (a name it does
    not hold) are a failure it tells the receivers (`PeerGroup.send_failure`) before raising."""
    group = join()
    try:
        try:
            tensors = wmap.select(names)
        except Exception:
            group.send_failure(0)
            raise
        sent = group.send(tensors, 0)
    finally:
        group.close()
    return {"sent": len(tensors), "bytes": sent}


def send_files(paths: list[str], join: Join) -> dict[str, Any]:
    """Send whole files as rank 0. One it cannot read still joins the group and tells the
    receivers (`PeerGroup.send_failure`) before raising, so none waits for bytes that never come."""
    try:
        files = [(os.path.basename(p), read_file_tensor(p)) for p in paths]
    except OSError:
        group = join()
        try:
            group.send_failure(0)
        finally:
            group.close()
        raise
    group = join()
    try:
        sent = group.send(files, 0)
    finally:
        group.close()
    return {"sent": len(files), "bytes": sent}


def receive_files(specs: list[list[Any]], expected: dict[str, str], out_dir: str, join: Join) -> dict[str, Any]:
    """Receive files, check each one's Adler-32, then write them all to ``out_dir``."""
    wanted = normalize_specs(specs)
    for name, _, _ in wanted:
        plain_file_name(name)
    t0 = time.perf_counter()
    group = join()
    t1 = time.perf_counter()
    try:
        received = group.receive(wanted, 0)
    finally:
        group.close()
    t2 = time.perf_counter()
    received = [(n, t.to("cpu")) for n, t in received]
    check_expected(received, expected)
    write_files(received, out_dir)
    return {
        "files": len(received),
        "bytes": sum(t.numel() for _, t in received),
        "join_s": round(t1 - t0, 6),
        "transfer_s": round(t2 - t1, 6),
    }


def split_sliced(wmap: WeightMap, names: list[str] | None) -> tuple[list[str], list[str]]:
    """``names`` (every tensor held when None) as (held whole by this rank, held in part)."""
    order = wmap.names() if names is None else list(names)
    sliced = {n for n in order if wmap.sliced(n)}
    return [n for n in order if n not in sliced], [n for n in order if n in sliced]


def region_digests(wmap: WeightMap, name: str, digest: Callable[[torch.Tensor], str] = adler32_hex) -> list[list[Any]]:
    """``[[size], [stride], offset, digest], ...]``: each region of ``name`` this rank holds (in
    elements of the checkpoint tensor, row-major) with the digest of what the engine holds there."""
    return [[list(r.size), list(r.stride), r.offset, digest(t)] for r, t in wmap.pieces(name)]


def served_checksums(wmap: WeightMap, names: list[str] | None) -> dict[str, Any]:
    """``{"checksums": {name: adler32}}`` of the tensors this rank holds whole, ``"regions"``
    (:func:`region_digests`) of those it holds a shard of."""
    whole, sliced = split_sliced(wmap, names)
    views = wmap.select(whole)
    # zlib releases the GIL on large buffers: a few threads read the weights in parallel.
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(lambda nt: adler32_hex(nt[1]), views))
    return {
        "checksums": {n: d for (n, _), d in zip(views, digests)},
        "regions": {n: region_digests(wmap, n) for n in sliced},
    }
