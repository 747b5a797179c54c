"""HostWeights.decode_delta_into: a chain decoded into other buffers, the host copy untouched."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from snapshots import ChecksumError, HostWeights, SnapshotError
from snapshots.inspect import read_delta_plan
from tests.helpers.snapshot_helpers import adler, raw_bytes, write_delta_dir, xor_frame


def _buffers(weights: HostWeights, names: list[str]) -> dict[str, np.ndarray]:
    # Garbage first: an out-of-place decode must not depend on what the buffers held.
    return {n: np.full(weights.info(n).nbytes, 0xA5, dtype=np.uint8) for n in names}


def test_chain_decoded_into_buffers_equals_the_reconstructed_checkpoint(
    chain: tuple[Path, list[Path], Path],
) -> None:
    base, deltas, expected_dir = chain
    weights = HostWeights.load(base)
    before = raw_bytes(weights)
    plans = [read_delta_plan(d) for d in deltas]
    names = sorted({n for p in plans for n in p.tensors})
    out = _buffers(weights, names)
    decoded: set[str] = set()
    checksums: dict[str, str] = {}
    for plan in plans:
        report = weights.decode_delta_into(plan, out, decoded)
        decoded.update(report.changed)
        checksums.update(report.checksums)
    assert raw_bytes(weights) == before  # the host copy did not move
    want = HostWeights.load(expected_dir)
    assert decoded == set(names) and names
    for n in names:
        assert out[n].tobytes() == want.raw(n).tobytes(), n
        assert checksums[n] == adler(want.raw(n))
    # Adopting the decoded bytes gives exactly the chain's result.
    weights.restore(out, checksums=checksums)
    assert raw_bytes(weights) == raw_bytes(want)
    assert weights.checksums() == want.checksums()


def test_bad_checksum_names_the_tensor_and_leaves_the_host_copy(pair: tuple[Path, Path], tmp_path: Path) -> None:
    weights = HostWeights.load(pair[0])
    new = HostWeights.load(pair[1])
    a = weights.names()[1]
    d = write_delta_dir(tmp_path / "d", {a: xor_frame(weights.raw(a), new.raw(a))}, {a: "00000001"})
    before = raw_bytes(weights)
    with pytest.raises(ChecksumError, match=rf"tensor '{a}': checksum mismatch"):
        weights.decode_delta_into(read_delta_plan(d), _buffers(weights, [a]), set())
    assert raw_bytes(weights) == before


def test_tensor_without_a_buffer_is_refused(pair: tuple[Path, Path], tmp_path: Path) -> None:
    weights = HostWeights.load(pair[0])
    frame = xor_frame(np.zeros(8, np.uint8), np.ones(8, np.uint8))
    d = write_delta_dir(tmp_path / "d", {"model.not_there.weight": frame}, {"model.not_there.weight": "00000001"})
    with pytest.raises(SnapshotError, match="model.not_there.weight.*in the delta but not in the base"):
        weights.decode_delta_into(read_delta_plan(d), {}, set())


def test_load_into_given_buffers(pair: tuple[Path, Path]) -> None:
    """`allocate` places every shard in the caller's buffers (shared memory, for the agent);
    a buffer of the wrong size is refused."""
    arena: dict[str, np.ndarray] = {}

    def allocate(sizes: dict[str, int]) -> dict[str, np.ndarray]:
        arena.update({shard: np.zeros(size, dtype=np.uint8) for shard, size in sizes.items()})
        return arena

    weights = HostWeights.load(pair[0], allocate=allocate)
    plain = HostWeights.load(pair[0])
    assert raw_bytes(weights) == raw_bytes(plain) and arena
    name = weights.names()[0]
    assert any(np.shares_memory(weights.raw(name), buf) for buf in arena.values())
    with pytest.raises(ValueError, match="allocate"):
        HostWeights.load(pair[0], allocate=lambda sizes: {s: np.zeros(n + 1, dtype=np.uint8) for s, n in sizes.items()})
