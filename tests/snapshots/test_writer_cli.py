"""Writers (delta and full snapshot) and the ``rollouts snapshot`` CLI."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from snapshots import (
    ChecksumError,
    DeltaMismatchError,
    HostWeights,
    inspect_snapshot,
    read_header,
    write_delta,
    write_full_snapshot,
)
from snapshots.cli import main
from snapshots.safetensors_io import TensorSpec
from tests.helpers.snapshot_helpers import INDEX, adler, raw_bytes


def test_delta_layout(pair: tuple[Path, Path], tmp_path: Path) -> None:
    stats = write_delta(pair[0], pair[1], tmp_path / "d", version="step-2", base_version="step-1", shard_bytes=20_000)
    assert stats.changed > 0 and 0 < stats.ratio < 0.2 and stats.bytes_changed <= stats.bytes_total
    index = json.loads((tmp_path / "d" / INDEX).read_text())
    assert index["metadata"] == {
        "version": "step-2",
        "base_version": "step-1",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "adler32",
    }
    n = len(stats.shards)
    assert n > 1 and stats.shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(n)]
    assert sorted(index["weight_map"]) == sorted(inspect_snapshot(tmp_path / "d").changed_tensors)
    new = HostWeights.load(pair[1])
    for shard in stats.shards:
        header = read_header(tmp_path / "d" / shard)
        for name, entry in header.tensors.items():
            assert entry.dtype == "U8" and len(entry.shape) == 1
            assert header.metadata[name] == adler(new.raw(name))
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted([*stats.shards, INDEX])


def test_empty_delta_writes_nothing(pair: tuple[Path, Path], tmp_path: Path) -> None:
    stats = write_delta(pair[0], pair[0], tmp_path / "d", version="1", base_version="0")
    assert stats.changed == 0 and stats.is_empty and stats.wire_bytes == 0
    assert not (tmp_path / "d").exists()
    assert not list(tmp_path.iterdir())


def _rewrite(src: Path, dst: Path, change: dict[str, TensorSpec | None]) -> Path:
    weights = HostWeights.load(src)
    tensors = {}
    for name in weights.names():
        info = weights.info(name)
        spec = change.get(name, TensorSpec(name, info.dtype, info.shape, weights.raw(name)))
        if spec is not None:
            tensors[name] = spec
    return write_full_snapshot(tensors, dst, src / "config.json")


def test_delta_refuses_shape_or_dtype_change(pair: tuple[Path, Path], tmp_path: Path) -> None:
    name = "model.norm.weight"
    info = HostWeights.load(pair[0]).info(name)
    reshaped = _rewrite(
        pair[0],
        tmp_path / "reshaped",
        {name: TensorSpec(name, info.dtype, (info.shape[0] // 2, 2), np.zeros(info.nbytes, np.uint8))},
    )
    with pytest.raises(
        DeltaMismatchError, match=rf"tensor '{name}': dtype/shape changed: base BF16\[{info.shape[0]}\]"
    ):
        write_delta(pair[0], reshaped, tmp_path / "d", version="1", base_version="0")
    retyped = _rewrite(
        pair[0], tmp_path / "retyped", {name: TensorSpec(name, "F16", info.shape, np.zeros(info.nbytes, np.uint8))}
    )
    with pytest.raises(DeltaMismatchError, match=rf"tensor '{name}': dtype/shape changed: base BF16.* new F16"):
        write_delta(pair[0], retyped, tmp_path / "d", version="1", base_version="0")
    dropped = _rewrite(pair[0], tmp_path / "dropped", {name: None})
    with pytest.raises(DeltaMismatchError, match=rf"tensor '{name}': is in the base but not in the new checkpoint"):
        write_delta(pair[0], dropped, tmp_path / "d", version="1", base_version="0")
    assert not (tmp_path / "d").exists()


def test_full_snapshot_from_state_dict_round_trips(pair: tuple[Path, Path], tmp_path: Path) -> None:
    weights = HostWeights.load(pair[0])
    state = {n: weights.tensor(n).clone() for n in weights.names()}
    state["extra.f32"] = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    out = write_full_snapshot(state, tmp_path / "full", {"model_type": "llama"}, shard_bytes=300_000)
    info = inspect_snapshot(out)
    assert info.type == "full" and info.checksummed_tensors == info.tensors == len(state)
    assert info.metadata["checksum_format"] == "adler32"
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    loaded = HostWeights.load(out)
    assert loaded.tensor("extra.f32").equal(state["extra.f32"])
    assert {n: loaded.raw(n).tobytes() for n in weights.names()} == raw_bytes(weights)
    # A checkpoint directory is re-written with checksums too.
    again = write_full_snapshot(pair[0], tmp_path / "again")
    assert inspect_snapshot(again).checksummed_tensors == len(weights)


def test_full_snapshot_checksums_are_verified_on_load(pair: tuple[Path, Path], tmp_path: Path) -> None:
    out = write_full_snapshot(pair[0], tmp_path / "full")
    shard = sorted(out.glob("*.safetensors"))[0]
    header = read_header(shard)
    victim = next(iter(header.tensors.values()))
    data = bytearray(shard.read_bytes())
    data[victim.begin] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=rf"{shard.name}: tensor '{victim.name}': checksum mismatch"):
        HostWeights.load(out)


# ------------------------------------------------------------------------------ CLI


def test_cli_delta_inspect_apply_verify(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = tmp_path / "d"
    assert main(["delta", str(pair[0]), str(pair[1]), str(d), "--version", "000001", "--base-version", "000000"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["changed"] > 0 and stats["wire_bytes"] > 0 and "ratio" in stats
    assert main(["inspect", str(d), "--previous-identity", "step-1"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["type"] == "delta" and info["previous_identity"] == "step-1" and info["changed_tensors"]
    out = tmp_path / "out"
    assert main(["apply", str(pair[0]), str(d), "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["verify", str(out), "--against", str(pair[1])]) == 0
    manifest = tmp_path / "m.json"
    manifest.write_text(json.dumps(HostWeights.load(pair[1]).manifest("step-2")))
    assert main(["verify", str(out), "--against", str(manifest)]) == 0
    capsys.readouterr()
    assert main(["verify", str(pair[0]), "--against", str(pair[1])]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "lm_head.weight" in err


def test_cli_errors_are_one_line(pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert main(["apply", str(pair[0]), str(pair[1]), "--out", str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    assert "not a delta" in err[1]
    assert main(["bogus"]) == 2


def test_cli_apply_in_place_swaps_the_new_checkpoint_in(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`apply BASE DELTA --out BASE`: BASE holds the new checkpoint when the command returns; the
    replaced files are removed after it (a detached rm), and nothing else is left beside BASE."""
    d = tmp_path / "d"
    assert main(["delta", str(pair[0]), str(pair[1]), str(d), "--version", "000001", "--base-version", "000000"]) == 0
    work = tmp_path / "work"
    shutil.copytree(pair[0], work)
    assert main(["apply", str(work), str(d), "--out", str(work)]) == 0
    capsys.readouterr()
    assert main(["verify", str(work), "--against", str(pair[1])]) == 0
    deadline = time.monotonic() + 30
    while len(list(tmp_path.iterdir())) > 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "work"]
