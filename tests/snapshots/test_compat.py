"""Compatibility with the reference writers and readers: slime's layout and cwtrain 1.0.2.

The slime fixture follows ``UpdateWeightFromDiskDelta._write_delta_files`` in THUDM/slime: one
shard per writing rank that has changes, numbered among those ranks only
(``model-{offset:05d}-of-{total:05d}.safetensors``, 0-based), written with
``safetensors.numpy.save(delta, metadata=checksums)``; the index (compact JSON) has ``version`` /
``base_version`` like ``000001`` / ``000000``. cwtrain runs in its own Python 3.12 venv, driven
through subprocesses.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import zstandard

from snapshots import HostWeights, UnsupportedFormatError, inspect_snapshot, write_delta, write_full_snapshot
from snapshots.host import checkpoint_checksums
from tests.helpers.snapshot_helpers import raw_bytes


def write_slime_delta(base: Path, new: Path, disk_dir: Path, *, ranks: int = 3, checksum: str = "adler32") -> Path:
    old_w, new_w = HostWeights.load(base), HostWeights.load(new)
    version_dir = disk_dir / "weight_v000001"
    version_dir.mkdir(parents=True)
    names = old_w.names()
    per_rank = [names[r::ranks] for r in range(ranks)]
    # Rank 1 holds only unchanged tensors (norms), so it writes no shard, as happens in slime.
    moved = [n for n in per_rank[1] if old_w.raw(n).tobytes() != new_w.raw(n).tobytes()]
    per_rank[0] += moved
    per_rank[1] = [n for n in per_rank[1] if n not in moved]
    deltas: list[tuple[dict[str, np.ndarray], dict[str, str]]] = []
    for rank_names in per_rank:
        delta, sums = {}, {}
        for name in rank_names:
            diff = new_w.raw(name) ^ old_w.raw(name)
            if not np.count_nonzero(diff):
                continue
            delta[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(diff), dtype=np.uint8)
            sums[name] = f"{zlib.adler32(new_w.raw(name)):08x}" if checksum == "adler32" else "0" * 32
        deltas.append((delta, sums))
    counts = [int(bool(d)) for d, _ in deltas]
    total = sum(counts)
    weight_map = {}
    for rank, (delta, sums) in enumerate(deltas):
        if not delta:
            continue
        fname = f"model-{sum(counts[:rank]):05d}-of-{total:05d}.safetensors"
        (version_dir / fname).write_bytes(safetensors.numpy.save(delta, metadata=sums))
        weight_map.update(dict.fromkeys(delta, fname))
    index = {
        "metadata": {
            "version": "000001",
            "base_version": "000000",
            "delta_encoding": "xor",
            "compression_format": "zstd",
            "checksum_format": checksum,
        },
        "weight_map": weight_map,
    }
    (version_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return version_dir


def test_slime_layout_applies_byte_exact(pair: tuple[Path, Path], tmp_path: Path) -> None:
    d = write_slime_delta(pair[0], pair[1], tmp_path / "disk")
    assert sorted(p.name for p in d.glob("*.safetensors")) == [
        "model-00000-of-00002.safetensors",
        "model-00001-of-00002.safetensors",
    ]
    info = inspect_snapshot(d)
    assert info.type == "delta" and info.metadata["version"] == "000001"
    weights = HostWeights.load(pair[0])
    weights.apply_delta(d)
    assert raw_bytes(weights) == raw_bytes(HostWeights.load(pair[1]))


def test_slime_default_checksum_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    d = write_slime_delta(pair[0], pair[1], tmp_path / "disk", checksum="xxh3-128")
    with pytest.raises(UnsupportedFormatError, match="checksum_format 'xxh3-128' is not supported"):
        inspect_snapshot(d)


def test_cwtrain_delta_applies_byte_exact(cw, pair: tuple[Path, Path], tmp_path: Path) -> None:
    result = cw(
        "import sys; from cwtrain.hotload.delta import write_delta as w;"
        "s = w(sys.argv[1], sys.argv[2], sys.argv[3], version='000001', base_version='000000'); "
        "print(s.tensors_changed)",
        str(pair[0]),
        str(pair[1]),
        str(tmp_path / "cwd"),
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0
    weights = HostWeights.load(pair[0])
    assert len(weights.apply_delta(tmp_path / "cwd")) == int(result.stdout)
    assert raw_bytes(weights) == raw_bytes(HostWeights.load(pair[1]))


def test_our_delta_passes_cwtrain_inspect_and_mirror(cw, pair: tuple[Path, Path], tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    write_delta(pair[0], pair[1], ours, version="000001", base_version="000000")
    inspect = cw(
        "import sys; from cwtrain.cli import main; sys.argv = ['cwtrain', 'hotload', 'inspect', sys.argv[1], "
        "'--previous-identity', 'step-1']; sys.exit(main())",
        str(ours),
    )
    assert inspect.returncode == 0, inspect.stderr
    assert "INCREMENTAL" in inspect.stdout
    mirror = cw(
        "import sys, json; from cwtrain.hotload import WeightMirror;"
        "m = WeightMirror.create(sys.argv[1], sys.argv[2]); r = m.apply_delta(sys.argv[3]);"
        "print(json.dumps({'changed': r.tensors_changed, 'checksums': m.checksums}))",
        str(pair[0]),
        str(tmp_path / "mirror"),
        str(ours),
    )
    assert mirror.returncode == 0, mirror.stderr
    answer = json.loads(mirror.stdout.strip().splitlines()[-1])
    assert answer["checksums"] == checkpoint_checksums(pair[1])
    mirrored = HostWeights.load(tmp_path / "mirror")
    assert raw_bytes(mirrored) == raw_bytes(HostWeights.load(pair[1]))


def test_full_snapshots_are_interchangeable(cw, pair: tuple[Path, Path], tmp_path: Path) -> None:
    ours = write_full_snapshot(pair[0], tmp_path / "ours")
    inspect = cw(
        "import sys; from cwtrain.cli import main; sys.argv = ['cwtrain', 'hotload', 'inspect', sys.argv[1]]; "
        "sys.exit(main())",
        str(ours),
    )
    assert inspect.returncode == 0, inspect.stderr
    theirs = cw(
        "import sys; from cwtrain.hotload.delta import write_full_snapshot as w; w(sys.argv[1], sys.argv[2])",
        str(pair[0]),
        str(tmp_path / "theirs"),
    )
    assert theirs.returncode == 0, theirs.stderr
    loaded = HostWeights.load(tmp_path / "theirs")  # verifies cwtrain's recorded checksums
    assert inspect_snapshot(tmp_path / "theirs").checksummed_tensors == len(loaded)
    assert loaded.checksums() == checkpoint_checksums(pair[0])
