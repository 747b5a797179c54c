"""Streamed materialization: byte-identical to the in-memory path, per-link verification,
in-place apply, and memory bounded by a few tensors rather than the model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from snapshots import (
    ChecksumError,
    HostWeights,
    materialize_chain,
    materialize_chain_report,
    read_header,
    stream_checksums,
    write_delta,
    write_full_snapshot,
)
from snapshots.safetensors_io import TensorSpec, write_safetensors
from tests.helpers.snapshot_helpers import REPO, adler, copy_tree, raw_bytes, write_delta_dir, xor_frame


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("chunk_bytes", [4096, 2**20])
def test_streamed_chain_matches_the_in_memory_materialize_byte_for_byte(
    chain, tmp_path: Path, chunk_bytes: int
) -> None:
    base, deltas, step2 = chain
    report = materialize_chain_report(base, deltas, tmp_path / "streamed", chunk_bytes=chunk_bytes, workers=3)
    weights = HostWeights.load(base)
    for d in deltas:
        weights.apply_delta(d)
    weights.materialize(tmp_path / "in-memory")
    assert _files(tmp_path / "streamed") == _files(tmp_path / "in-memory")
    assert raw_bytes(HostWeights.load(tmp_path / "streamed")) == raw_bytes(HostWeights.load(step2))
    assert report.checksums == weights.checksums() and report.tensors == len(weights)
    assert [len(r.changed) for r in report.deltas] == [
        len(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]) for d in deltas
    ]
    assert report.deltas[1].checksums == {n: weights.checksums()[n] for n in report.deltas[1].changed}


def test_in_place_apply_replaces_the_base_directory(chain, tmp_path: Path) -> None:
    base, deltas, step2 = chain
    target = copy_tree(base, tmp_path / "mirror")
    for d in deltas:  # one link at a time, like a mirror following a trainer
        assert materialize_chain(target, [d], target) == target
    assert raw_bytes(HostWeights.load(target)) == raw_bytes(HostWeights.load(step2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mirror"]  # no temporary left behind


def test_every_link_is_verified_not_just_the_last(chain, pair: tuple[Path, Path], tmp_path: Path) -> None:
    """d1 records a wrong checksum for a tensor d2 changes again: the end result would be right,
    but the chain is refused, naming d1's file and the tensor."""
    base = HostWeights.load(pair[0])
    mid, end = HostWeights.load(pair[1]), HostWeights.load(chain[2])
    name = next(
        n for n in base.names() if len({base.raw(n).tobytes(), mid.raw(n).tobytes(), end.raw(n).tobytes()}) == 3
    )
    d1 = write_delta_dir(tmp_path / "d1", {name: xor_frame(base.raw(name), mid.raw(name))}, {name: "0badc0de"})
    d2 = write_delta_dir(tmp_path / "d2", {name: xor_frame(mid.raw(name), end.raw(name))}, {name: adler(end.raw(name))})
    with pytest.raises(
        ChecksumError,
        match=rf"d1/model-00000-of-00001.safetensors: tensor '{name}': checksum mismatch: the writer recorded 0badc0de",
    ):
        materialize_chain(pair[0], [d1, d2], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    d1 = write_delta_dir(
        tmp_path / "d1ok", {name: xor_frame(base.raw(name), mid.raw(name))}, {name: adler(mid.raw(name))}
    )
    out = materialize_chain(pair[0], [d1, d2], tmp_path / "out")
    assert HostWeights.load(out).raw(name).tobytes() == end.raw(name).tobytes()


def test_unchanged_tensor_is_checked_against_the_checksum_the_base_records(
    pair: tuple[Path, Path], delta: Path, tmp_path: Path
) -> None:
    base = write_full_snapshot(pair[0], tmp_path / "base")
    changed = set(json.loads((delta / "model.safetensors.index.json").read_text())["weight_map"])
    shard = sorted(base.glob("*.safetensors"))[0]
    victim = next(e for e in read_header(shard).tensors.values() if e.name not in changed and e.nbytes)
    data = bytearray(shard.read_bytes())
    data[victim.begin] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(
        ChecksumError, match=rf"{shard}: tensor '{victim.name}': checksum mismatch: __metadata__ records"
    ):
        materialize_chain(base, [delta], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_stream_checksums_and_cli_verify_agree_with_the_host_copy(chain) -> None:
    base, deltas, step2 = chain
    assert stream_checksums(base, deltas) == HostWeights.load(step2).checksums()
    assert stream_checksums(step2) == HostWeights.load(step2).checksums()


MEMORY_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from snapshots import materialize_chain
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
materialize_chain(sys.argv[2], [sys.argv[3]], sys.argv[4], workers=2)
print(json.dumps({"before": before, "after": hwm()}))
"""


def test_memory_is_bounded_by_a_few_tensors_not_the_model(tmp_path: Path) -> None:
    """A 96 MiB checkpoint of 4 MiB tensors is materialized with a peak RSS growth of a few
    tensors, in a fresh process (VmHWM: the peak resident set, mapped file pages included)."""
    tensor_bytes, count = 4 * 2**20, 24
    for name, flip in (("base", False), ("new", True)):
        (tmp_path / name).mkdir()
        specs, weight_map = [], {}
        for i in range(count):
            rng = np.random.default_rng(i)
            data = np.frombuffer(rng.bytes(tensor_bytes), dtype=np.uint8).copy()
            if flip:  # 2 % of the bytes change, as in an RL step
                data[rng.integers(0, tensor_bytes, tensor_bytes // 50)] ^= 1
            specs.append(TensorSpec(f"w{i}", "BF16", (tensor_bytes // 2,), data))
            weight_map[f"w{i}"] = "model-00001-of-00001.safetensors"
        write_safetensors(tmp_path / name / "model-00001-of-00001.safetensors", specs, {"format": "pt"})
        (tmp_path / name / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
        (tmp_path / name / "config.json").write_text("{}")
    write_delta(tmp_path / "base", tmp_path / "new", tmp_path / "delta", version="1", base_version="0")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            MEMORY_PROBE,
            str(REPO),
            str(tmp_path / "base"),
            str(tmp_path / "delta"),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr
    peak = json.loads(run.stdout)
    model = tensor_bytes * count
    assert peak["after"] - peak["before"] < model // 4, peak
    assert stream_checksums(tmp_path / "out") == stream_checksums(tmp_path / "new")
