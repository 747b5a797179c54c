"""Snapshot inspection: required files, index structure, delta metadata; local and S3."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from snapshots import (
    HostWeights,
    LayoutError,
    SnapshotError,
    UnsupportedFormatError,
    check_required_files,
    inspect_snapshot,
    write_full_snapshot,
)
from snapshots.errors import ChecksumError, HeaderError, IdentityError
from snapshots.inspect import verify_required_files
from tests.helpers.snapshot_helpers import INDEX, FakeS3, write_delta_dir


def test_inspect_full_and_delta(pair: tuple[Path, Path], delta: Path) -> None:
    full = inspect_snapshot(pair[0])
    assert full.type == "full" and full.tensors > 10 and full.changed_tensors == []
    assert "config.json" in full.files and full.total_bytes == sum(full.files.values())
    info = inspect_snapshot(delta, previous_identity="step-1")
    assert info.type == "delta" and info.previous_identity == "step-1"
    assert info.changed_tensors and info.metadata["delta_encoding"] == "xor"
    assert info.tensors == len(info.changed_tensors) == info.checksummed_tensors


def test_previous_identity_is_validated(delta: Path, pair: tuple[Path, Path]) -> None:
    with pytest.raises(IdentityError, match="previousSnapshotIdentity"):
        inspect_snapshot(delta, previous_identity="a/b")
    with pytest.raises(SnapshotError, match="full snapshot has no previous identity"):
        inspect_snapshot(pair[0], previous_identity="x")


def test_check_required_files(pair: tuple[Path, Path], delta: Path, tmp_path: Path) -> None:
    assert check_required_files(pair[0], "full") == []
    assert check_required_files(delta, "SNAPSHOT_TYPE_INCREMENTAL") == []
    broken = shutil.copytree(pair[0], tmp_path / "b")
    (broken / "config.json").unlink()
    next(broken.glob("model-00002-*.safetensors")).unlink()
    assert check_required_files(broken, "full") == ["config.json", "model-00002-of-00002.safetensors"]
    with pytest.raises(LayoutError, match="this is a full snapshot, not a delta"):
        check_required_files(pair[0], "delta")
    with pytest.raises(LayoutError, match="describes a delta"):
        check_required_files(delta, "full")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert check_required_files(empty, "full") == ["config.json", INDEX]


def test_missing_shard_is_named(pair: tuple[Path, Path], tmp_path: Path) -> None:
    broken = shutil.copytree(pair[0], tmp_path / "b")
    next(broken.glob("model-00001-*.safetensors")).unlink()
    with pytest.raises(LayoutError, match="missing model-00001-of-00002.safetensors"):
        inspect_snapshot(broken)


@pytest.mark.parametrize("shard", ["sub/model.safetensors", "../x.safetensors", "model.bin"])
def test_weight_map_must_name_immediate_children(tmp_path: Path, shard: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(LayoutError, match=r"tensor 'w': weight_map points at"):
        inspect_snapshot(tmp_path)


def test_full_index_must_not_be_empty(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {}}))
    with pytest.raises(LayoutError, match="empty weight_map"):
        inspect_snapshot(tmp_path)


def test_single_file_checkpoint_is_accepted(pair: tuple[Path, Path], tmp_path: Path) -> None:
    weights = HostWeights.load(pair[0])

    write_full_snapshot(
        {n: weights.tensor(n) for n in weights.names()}, tmp_path / "s", pair[0] / "config.json", shard_bytes=1 << 40
    )
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(tmp_path / "s" / "model-00001-of-00001.safetensors", single / "model.safetensors")
    shutil.copy(pair[0] / "config.json", single)
    info = inspect_snapshot(single)
    assert info.index_generated and info.tensors == len(weights)
    assert HostWeights.load(single).checksums() == weights.checksums()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("delta_encoding", "overwrite", "delta_encoding 'overwrite' is not supported"),
        ("compression_format", "lz4", "compression_format 'lz4' is not supported"),
        ("checksum_format", "xxh3-128", "checksum_format 'xxh3-128' is not supported"),
        ("checksum_format", None, "checksum_format None is not supported"),
    ],
)
def test_unsupported_delta_formats_are_refused_by_name(
    tmp_path: Path, key: str, value: str | None, message: str
) -> None:
    meta = {
        "version": "1",
        "base_version": "0",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "adler32",
    }
    if value is None:
        del meta[key]
    else:
        meta[key] = value
    write_delta_dir(tmp_path / "d", {"w": b"\x28\xb5\x2f\xfd"}, {"w": "00000001"}, metadata=meta)
    with pytest.raises(UnsupportedFormatError, match=message):
        inspect_snapshot(tmp_path / "d")


def test_delta_tensors_must_be_u8(tmp_path: Path) -> None:
    write_delta_dir(tmp_path / "d", {"w": bytes(8)}, {"w": "00000001"}, dtype="F16")
    with pytest.raises(
        HeaderError, match=r"model-00000-of-00001.safetensors: tensor 'w': delta tensors must be 1-D U8"
    ):
        inspect_snapshot(tmp_path / "d")


def test_delta_checksum_missing(tmp_path: Path) -> None:
    write_delta_dir(tmp_path / "d", {"a": bytes(8), "w": bytes(8)}, {"a": "00000001", "w": None})
    with pytest.raises(ChecksumError, match=r"model-00000-of-00001.safetensors: tensor 'w': no Adler-32 checksum"):
        inspect_snapshot(tmp_path / "d")


def test_delta_checksum_malformed(tmp_path: Path) -> None:
    write_delta_dir(tmp_path / "d", {"w": bytes(8)}, {"w": "xyz"})
    with pytest.raises(ChecksumError, match=r"tensor 'w': checksum 'xyz' is not 8 hex digits"):
        inspect_snapshot(tmp_path / "d")


def test_weight_map_tensor_absent_from_shard(tmp_path: Path) -> None:
    d = write_delta_dir(tmp_path / "d", {"w": bytes(8)}, {"w": "00000001"})
    index = json.loads((d / INDEX).read_text())
    index["weight_map"]["ghost"] = index["weight_map"]["w"]
    (d / INDEX).write_text(json.dumps(index))
    with pytest.raises(
        LayoutError, match=r"tensor 'ghost': weight_map names this tensor but the shard does not hold it"
    ):
        inspect_snapshot(d)


def test_empty_delta_is_reported(tmp_path: Path) -> None:
    (tmp_path / INDEX).write_text(
        json.dumps({"metadata": {"delta_encoding": "xor", "checksum_format": "adler32"}, "weight_map": {}})
    )
    assert inspect_snapshot(tmp_path).empty_delta


# ------------------------------------------------------------------------------ S3


def _upload(local: Path, fake: FakeS3, key_prefix: str) -> str:
    dest = fake.root / "bucket" / key_prefix
    shutil.copytree(local, dest)
    return f"s3://bucket/{key_prefix}/"


def test_inspect_on_s3_uses_ranged_reads(pair: tuple[Path, Path], delta: Path, fake_s3: FakeS3) -> None:
    base_uri = _upload(pair[0], fake_s3, "prefix/base")
    delta_uri = _upload(delta, fake_s3, "prefix/d1")
    # A nested object must not count as part of the snapshot.
    (fake_s3.root / "bucket" / "prefix" / "d1" / "nested").mkdir()
    (fake_s3.root / "bucket" / "prefix" / "d1" / "nested" / "x.safetensors").write_bytes(b"junk")
    assert inspect_snapshot(base_uri, s3=fake_s3).to_json()["tensors"] == inspect_snapshot(pair[0]).tensors
    info = inspect_snapshot(delta_uri, s3=fake_s3)
    assert info.type == "delta" and set(info.files) == {p.name for p in delta.iterdir()}
    shard_reads = [c for name, c in fake_s3.calls if name == "get_object" and c["Key"].endswith(".safetensors")]
    assert shard_reads and all(c["Range"] for c in shard_reads)
    assert check_required_files(base_uri, "full", s3=fake_s3) == []
    (fake_s3.root / "bucket" / "prefix" / "base" / "config.json").unlink()
    assert check_required_files(base_uri, "full", s3=fake_s3) == ["config.json"]


def test_the_fingerprint_tells_a_rewritten_or_removed_required_file(
    delta: Path, fake_s3: FakeS3, tmp_path: Path
) -> None:
    """What admission keeps of a snapshot it verified: the same files give the same fingerprint
    (a file that is not required changes nothing); a required file rewritten (on S3 its ETag, a
    local file's mtime) or removed gives another."""
    uri = _upload(delta, fake_s3, "p/d1")
    first = verify_required_files(uri, "delta", s3=fake_s3)
    assert first.missing == [] and verify_required_files(uri, "delta", s3=fake_s3) == first
    objects = fake_s3.root / "bucket" / "p" / "d1"
    (objects / "notes.txt").write_text("not part of the snapshot")
    assert verify_required_files(uri, "delta", s3=fake_s3) == first
    shard = next(objects.glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the same size, other bytes: another ETag
    assert verify_required_files(uri, "delta", s3=fake_s3).fingerprint != first.fingerprint
    shard.write_bytes(data)  # the same bytes again: the same ETag
    assert verify_required_files(uri, "delta", s3=fake_s3) == first
    shard.unlink()
    gone = verify_required_files(uri, "delta", s3=fake_s3)
    assert gone.missing == [shard.name] and gone.fingerprint != first.fingerprint

    local = shutil.copytree(delta, tmp_path / "d1")
    first = verify_required_files(local, "delta")
    shard = next(local.glob("*.safetensors"))
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a local file rewritten
    assert verify_required_files(local, "delta").fingerprint != first.fingerprint


def test_apply_from_s3(pair: tuple[Path, Path], delta: Path, fake_s3: FakeS3) -> None:
    base_uri = _upload(pair[0], fake_s3, "p/base")
    delta_uri = _upload(delta, fake_s3, "p/d1")
    weights = HostWeights.load(base_uri, s3=fake_s3)
    changed = weights.apply_delta(delta_uri, s3=fake_s3)
    assert changed
    assert weights.checksums() == HostWeights.load(pair[1]).checksums()


def test_s3_missing_location_and_bad_uri(fake_s3: FakeS3) -> None:
    assert check_required_files("s3://bucket/nothing/here/", "delta", s3=fake_s3) == [INDEX]
    with pytest.raises(LayoutError, match="missing model.safetensors.index.json"):
        inspect_snapshot("s3://bucket/nothing/here/", s3=fake_s3)
    with pytest.raises(LayoutError, match="'..' segment"):
        inspect_snapshot("s3://bucket/a/../b/", s3=fake_s3)
    with pytest.raises(SnapshotError, match="S3 client"):
        inspect_snapshot("s3://bucket/a/")
