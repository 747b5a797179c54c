"""Strict safetensors header validation and tensor reads."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from snapshots import HeaderError, list_tensors, read_header, read_tensor_bytes
from snapshots.safetensors_io import TensorSpec, write_safetensors


def _raw_file(path: Path, header: dict, data: bytes) -> Path:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def test_round_trip(tmp_path: Path) -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.arange(5, dtype=np.int16)
    write_safetensors(
        tmp_path / "x.safetensors",
        [TensorSpec("a", "F32", (3, 4), a), TensorSpec("b", "I16", (5,), b), TensorSpec("e", "F16", (0, 3), b"")],
        {"k": "v"},
    )
    header = read_header(tmp_path / "x.safetensors")
    assert header.metadata == {"k": "v"}
    assert [(t.name, t.dtype, t.shape) for t in list_tensors(tmp_path / "x.safetensors")] == [
        ("a", "F32", (3, 4)),
        ("b", "I16", (5,)),
        ("e", "F16", (0, 3)),
    ]
    assert read_tensor_bytes(tmp_path / "x.safetensors", header.tensors["a"]).tobytes() == a.tobytes()
    assert header.data_start % 8 == 0
    # The reference implementation reads what we write.

    assert np.array_equal(load_file(tmp_path / "x.safetensors")["b"], b)


def test_header_length_past_eof(tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(HeaderError, match=r"bad.safetensors: header length 10000 runs past the end"):
        read_header(path)


def test_tiny_file(tmp_path: Path) -> None:
    (tmp_path / "t.safetensors").write_bytes(b"abc")
    with pytest.raises(HeaderError, match="t.safetensors: truncated"):
        read_header(tmp_path / "t.safetensors")


def test_truncated_shard_names_file_and_tensor(tmp_path: Path) -> None:
    path = tmp_path / "trunc.safetensors"
    write_safetensors(path, [TensorSpec("w", "F32", (64,), np.zeros(64, np.float32))])
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(HeaderError, match=r"trunc.safetensors: tensor 'w': data ends at .*truncated"):
        read_header(path)


def test_overlapping_offsets(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
    }
    path = _raw_file(tmp_path / "ov.safetensors", header, bytes(12))
    with pytest.raises(HeaderError, match=r"ov.safetensors: tensor 'b': data overlaps tensor 'a'"):
        read_header(path)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "Q9", "shape": [4], "data_offsets": [0, 4]}, "unknown dtype 'Q9'"),
        ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, "data_offsets span 8 bytes but F32\\[4\\] needs 16"),
        ({"dtype": "U8", "shape": [-1], "data_offsets": [0, 4]}, "shape \\[-1\\] is not a list of non-negative"),
        ({"dtype": "U8", "shape": [4], "data_offsets": [4, 0]}, "data_offsets \\[4, 0\\] are not"),
    ],
)
def test_inconsistent_entries(tmp_path: Path, entry: dict, message: str) -> None:
    path = _raw_file(tmp_path / "e.safetensors", {"t": entry}, bytes(16))
    with pytest.raises(HeaderError, match=rf"e.safetensors: tensor 't': {message}"):
        read_header(path)


def test_header_not_json(tmp_path: Path) -> None:
    path = tmp_path / "j.safetensors"
    path.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(HeaderError, match="j.safetensors: header is not valid JSON"):
        read_header(path)
