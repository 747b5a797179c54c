"""Write a sparse delta (`snapshots.sparse`): the changed elements of every tensor that differs
between two full checkpoints, as ``NAME.indices`` (I32, or I64 for a tensor of 2^31 elements or
more) and ``NAME.values`` in one shard ``model-00000-of-00001.safetensors``, each tensor's
Adler-32 in its ``__metadata__``, and the index with ``delta_encoding: sparse`` and
``checksum_format: adler32``. An element differs when its bytes do (so a NaN that stays the same
NaN is unchanged, and -0.0 and 0.0 differ). Both checkpoints are read into memory (they must hold
the same tensor names, dtypes and shapes); ``out_dir`` is replaced atomically. When nothing
changed, nothing is written and the stats say ``changed == 0``.

What a trainer that publishes changed elements writes is this layout; the service's own
publishers write XOR deltas (`snapshots.writer.write_delta`), and tests and benchmarks use this
one to exercise the sparse path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from snapshots.codec import adler32_hex
from snapshots.errors import SnapshotError
from snapshots.host import HostWeights
from snapshots.inspect import INDEX_FILE
from snapshots.replace import replacing_directory
from snapshots.safetensors_io import DTYPE_SIZES, TensorSpec, write_safetensors
from snapshots.sparse import INDICES, SPARSE, UINTS, VALUES
from snapshots.writer import DeltaStats

SHARD = "model-00000-of-00001.safetensors"


def write_sparse_delta(
    base_dir: str | os.PathLike[str],
    new_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    version: str,
    base_version: str,
) -> DeltaStats:
    """Write the sparse delta turning checkpoint ``base_dir`` into ``new_dir`` at ``out_dir``."""
    base, new = HostWeights.load(base_dir), HostWeights.load(new_dir)
    if sorted(base.names()) != sorted(new.names()):
        raise SnapshotError(
            f"the checkpoints hold different tensors: {sorted(set(base.names()) ^ set(new.names()))[:4]}"
        )
    out = Path(out_dir)
    stats = DeltaStats(str(out), str(version), str(base_version), tensors_total=len(new.names()))
    stats.bytes_total = new.total_bytes
    specs: list[TensorSpec] = []
    checksums: dict[str, str] = {}
    for name in sorted(new.names()):
        old_info, new_info = base.info(name), new.info(name)
        if (old_info.dtype, old_info.shape) != (new_info.dtype, new_info.shape):
            raise SnapshotError(
                f"{old_info.dtype}{list(old_info.shape)} in the base, "
                f"{new_info.dtype}{list(new_info.shape)} in the new checkpoint",
                tensor=name,
            )
        width = UINTS[DTYPE_SIZES[new_info.dtype]]
        old_elems, new_elems = base.raw(name).view(width), new.raw(name).view(width)
        positions = np.flatnonzero(old_elems != new_elems)
        if not positions.size:
            continue
        index_dtype = ("I32", np.int32) if new_elems.size < 2**31 else ("I64", np.int64)
        specs.append(TensorSpec(name + INDICES, index_dtype[0], (positions.size,), positions.astype(index_dtype[1])))
        specs.append(TensorSpec(name + VALUES, new_info.dtype, (positions.size,), new_elems[positions].copy()))
        checksums[name] = adler32_hex(new.raw(name))
        stats.changed += 1
        stats.bytes_changed += new_info.nbytes
        stats.wire_bytes += positions.size * (np.dtype(index_dtype[1]).itemsize + DTYPE_SIZES[new_info.dtype])
    if not specs:
        return stats
    with replacing_directory(out) as tmp:
        write_safetensors(tmp / SHARD, specs, checksums)
        index = {
            "metadata": {
                "version": str(version),
                "base_version": str(base_version),
                "delta_encoding": SPARSE,
                "checksum_format": "adler32",
            },
            "weight_map": {spec.name: SHARD for spec in specs},
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    stats.shards.append(SHARD)
    return stats
