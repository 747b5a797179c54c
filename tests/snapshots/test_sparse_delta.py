"""Sparse deltas (snapshots/sparse.py: each changed tensor's changed elements as NAME.indices and
NAME.values, its Adler-32 in __metadata__): admitted like any delta, applied in memory (the
replica's host copy, in place and out of place) and streamed (a materialized chain mixing sparse
and XOR links), byte for byte what the XOR delta of the same step gives; every malformed one is
refused naming its file and tensor, with nothing changed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from snapshots import HostWeights, materialize_chain_report, read_delta_plan, write_delta
from snapshots.errors import ChecksumError, DeltaMismatchError, HeaderError, LayoutError, UnsupportedFormatError
from snapshots.inspect import check_required_files, inspect_snapshot
from snapshots.safetensors_io import TensorSpec, read_header, write_safetensors
from snapshots.sparse_writer import SHARD, write_sparse_delta
from tests.helpers.snapshot_helpers import copy_tree, mutate_checkpoint, raw_bytes


@pytest.fixture(scope="module")
def sparse_chain(pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory):
    """``pair``'s base, a sparse delta to its new checkpoint, an XOR delta on to a third."""
    root = tmp_path_factory.mktemp("sparse")
    stats = write_sparse_delta(pair[0], pair[1], root / "s1", version="000001", base_version="000000")
    assert stats.changed > 0 and stats.wire_bytes < stats.bytes_changed
    step2 = mutate_checkpoint(pair[1], root / "step2", seed=21)
    write_delta(pair[1], step2, root / "x2", version="000002", base_version="000001")
    return pair[0], root / "s1", root / "x2", pair[1], step2


def test_admitted_and_described_like_any_delta(sparse_chain) -> None:
    base, s1, *_ = sparse_chain
    assert check_required_files(s1, "delta") == []
    info = inspect_snapshot(s1, previous_identity="step-0")
    plan = read_delta_plan(s1)
    assert info.type == "delta" and info.changed_tensors == sorted(plan.tensors) and info.tensors == len(plan.tensors)
    assert all(item.sparse is not None and item.wire_bytes > 0 for item in plan.tensors.values())


def test_applied_in_memory_in_place_and_out_of_place(sparse_chain) -> None:
    base, s1, _, new, _ = sparse_chain
    weights = HostWeights.load(base)
    changed = weights.apply_delta(s1)
    assert raw_bytes(weights) == raw_bytes(HostWeights.load(new))
    assert set(changed) == set(read_delta_plan(s1).tensors)
    # Out of place, as a replica decodes into its stage arena: the host copy is only read.
    host = HostWeights.load(base)
    before = raw_bytes(host)
    plan = read_delta_plan(s1)
    out = {n: np.empty(host.info(n).nbytes, dtype=np.uint8) for n in plan.tensors}
    host.decode_delta_into(plan, out, set())
    assert raw_bytes(host) == before
    assert {n: out[n].tobytes() for n in out} == {n: raw_bytes(HostWeights.load(new))[n] for n in out}


@pytest.mark.parametrize("chunk_bytes", [4096, 2**20])
def test_streamed_in_a_chain_with_an_xor_link(sparse_chain, tmp_path: Path, chunk_bytes: int) -> None:
    base, s1, x2, _, step2 = sparse_chain
    report = materialize_chain_report(base, [s1, x2], tmp_path / "out", chunk_bytes=chunk_bytes, workers=3)
    assert raw_bytes(HostWeights.load(tmp_path / "out")) == raw_bytes(HostWeights.load(step2))
    assert report.deltas[0].checksums == {n: read_delta_plan(s1).tensors[n].checksum for n in report.deltas[0].changed}
    with pytest.raises(ValueError, match="multiple of 8"):
        materialize_chain_report(base, [s1], tmp_path / "odd", chunk_bytes=4095)


def rewrite(src: Path, dst: Path, change) -> Path:
    """A copy of sparse delta ``src`` whose one shard's tensors and metadata ``change`` edits
    (``change(tensors: dict[name, (dtype, array)], metadata) -> None``)."""
    copy_tree(src, dst)
    header = read_header(dst / SHARD)
    data = (dst / SHARD).read_bytes()
    tensors = {
        e.name: (e.dtype, np.frombuffer(data[e.begin : e.end], dtype=np.uint8).copy()) for e in header.tensors.values()
    }
    metadata = dict(header.metadata)
    change(tensors, metadata)
    write_safetensors(
        dst / SHARD, [TensorSpec(n, d, (a.nbytes // _size(d),), a) for n, (d, a) in tensors.items()], metadata
    )
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    index["weight_map"] = dict.fromkeys(tensors, SHARD)
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _size(dtype: str) -> int:
    return {"I32": 4, "I64": 8, "BF16": 2, "F32": 4, "U8": 1}[dtype]


def first(tensors) -> str:
    return sorted(n for n in tensors if n.endswith(".indices"))[0].removesuffix(".indices")


def _swap_first_two(tensors) -> None:
    name = first(tensors)
    idx = tensors[name + ".indices"][1].view(np.int32)
    idx[[0, 1]] = idx[[1, 0]]


def _past_the_end(tensors) -> None:
    tensors[first(tensors) + ".indices"][1].view(np.int32)[-1] = 2**30


def _one_value_short(tensors) -> None:
    name = first(tensors)
    tensors[name + ".values"] = ("BF16", tensors[name + ".values"][1][:-2])


def _values_as_f32(tensors) -> None:
    name = first(tensors)
    values = tensors[name + ".values"][1]
    count = values.nbytes // 2
    tensors[name + ".values"] = ("F32", np.zeros(count * 4, dtype=np.uint8))


def _no_values(tensors) -> None:
    del tensors[first(tensors) + ".values"]


def _changed_value(tensors) -> None:
    tensors[first(tensors) + ".values"][1][0] ^= 0x01


BAD = {
    "indices not increasing": (_swap_first_two, DeltaMismatchError, "not strictly increasing"),
    "an index past the end": (_past_the_end, DeltaMismatchError, "outside the tensor"),
    "fewer values than indices": (_one_value_short, HeaderError, "indices but"),
    "values of another dtype": (_values_as_f32, DeltaMismatchError, "values are F32 but the base tensor is BF16"),
    "values missing": (_no_values, LayoutError, "has no"),
    "a value the checksum does not match": (_changed_value, ChecksumError, "checksum mismatch"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_sparse_delta_is_refused_naming_the_tensor_and_changes_nothing(
    sparse_chain, tmp_path: Path, case: str
) -> None:
    base, s1, *_ = sparse_chain
    change, error, message = BAD[case]
    names = {}

    def edit(tensors, metadata) -> None:
        names["victim"] = first(tensors)
        change(tensors)

    bad = rewrite(s1, tmp_path / "bad", edit)
    weights = HostWeights.load(base)
    before = raw_bytes(weights)
    with pytest.raises(error, match=message) as caught:
        weights.apply_delta(bad)
    assert caught.value.tensor in (names["victim"], names["victim"] + ".values", names["victim"] + ".indices")
    assert raw_bytes(weights) == before  # every tensor applied before the failure was put back
    with pytest.raises(error, match=message):
        materialize_chain_report(base, [bad], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_only_sparse_and_xor_encodings_are_admitted(sparse_chain, tmp_path: Path) -> None:
    _, s1, *_ = sparse_chain
    for encoding, compression, message in (
        ("rle", None, "'xor' .* and 'sparse'"),
        ("sparse", "zstd", "not supported for a sparse delta"),
    ):
        bad = copy_tree(s1, tmp_path / encoding)
        index = json.loads((bad / "model.safetensors.index.json").read_text())
        index["metadata"]["delta_encoding"] = encoding
        if compression:
            index["metadata"]["compression_format"] = compression
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(UnsupportedFormatError, match=message):
            check_required_files(bad, "delta")
