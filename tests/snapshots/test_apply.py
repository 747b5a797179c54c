"""Delta apply: byte-exact round trips, chains, and every bad delta leaving the target untouched."""

from __future__ import annotations

import resource
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard

from snapshots import (
    ChecksumError,
    DeltaMismatchError,
    HostWeights,
    SnapshotError,
    apply_delta,
    codec,
    inspect_snapshot,
    materialize_chain,
    materialize_chain_report,
    storage,
    write_delta,
)
from snapshots.inspect import read_delta_plan
from tests.helpers.snapshot_helpers import adler, copy_tree, mutate_checkpoint, raw_bytes, write_delta_dir, xor_frame

SHARD = "model-00000-of-00001.safetensors"
BOMB_BYTES = 256 * 2**20


def zero_bomb(declare_size: bool) -> bytes:
    """A ~10 KiB zstd frame of 256 MiB of zeros, built in 1 MiB pieces (never held whole)."""
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=declare_size)
    obj = cctx.compressobj(size=BOMB_BYTES if declare_size else -1)
    chunk = bytes(2**20)
    parts = [obj.compress(chunk) for _ in range(BOMB_BYTES // len(chunk))]
    return b"".join(parts) + obj.flush()


def test_apply_round_trip_is_byte_exact(pair: tuple[Path, Path], delta: Path) -> None:
    weights = HostWeights.load(pair[0])
    before = raw_bytes(weights)
    changed = weights.apply_delta(delta)
    target = HostWeights.load(pair[1])
    assert raw_bytes(weights) == raw_bytes(target)
    assert set(changed) == {n for n in weights.names() if before[n] != weights.raw(n).tobytes()}
    assert weights.checksums() == target.checksums()
    t = weights.tensor("lm_head.weight")
    assert str(t.dtype) == "torch.bfloat16" and tuple(t.shape) == weights.info("lm_head.weight").shape
    assert t.equal(target.tensor("lm_head.weight"))


def test_mmap_load_applies_without_touching_the_files(pair: tuple[Path, Path], delta: Path, base_copy: Path) -> None:
    before = {p.name: p.read_bytes() for p in base_copy.iterdir()}
    weights = HostWeights.load(base_copy, mmap=True)
    weights.apply_delta(delta)
    assert weights.checksums() == HostWeights.load(pair[1]).checksums()
    assert {p.name: p.read_bytes() for p in base_copy.iterdir()} == before


def test_apply_to_plain_buffers(pair: tuple[Path, Path], delta: Path) -> None:
    base = HostWeights.load(pair[0])
    buffers = {n: bytearray(base.raw(n).tobytes()) for n in base.names()}
    new = apply_delta(buffers, delta)
    target = raw_bytes(HostWeights.load(pair[1]))
    assert {n: bytes(b) for n, b in buffers.items()} == target
    assert all(new[n].tobytes() == target[n] for n in new)
    # And from a directory: the directory is left alone, the new bytes come back.
    from_dir = apply_delta(pair[0], delta)
    assert {n: v.tobytes() for n, v in from_dir.items()} == {n: target[n] for n in from_dir}


def test_chain_materializes_byte_identical(pair: tuple[Path, Path], delta: Path, tmp_path: Path) -> None:
    step2 = mutate_checkpoint(pair[1], tmp_path / "step2", seed=7)
    write_delta(pair[1], step2, tmp_path / "d2", version="000002", base_version="000001")
    out = materialize_chain(pair[0], [delta, tmp_path / "d2"], tmp_path / "out")
    assert raw_bytes(HostWeights.load(out)) == raw_bytes(HostWeights.load(step2))
    # The materialized checkpoint records verified checksums, and keeps config and shard names.
    assert (out / "config.json").read_bytes() == (pair[0] / "config.json").read_bytes()
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in pair[0].glob("*.safetensors"))

    info = inspect_snapshot(out)
    assert info.checksummed_tensors == info.tensors and info.metadata["checksum_format"] == "adler32"


def test_failed_chain_link_does_not_create_output(pair: tuple[Path, Path], delta: Path, tmp_path: Path) -> None:
    with pytest.raises(ChecksumError):
        # The same delta twice: the second application does not reproduce its checksums.
        materialize_chain(pair[0], [delta, delta], tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ bad deltas


@pytest.fixture
def weights(pair: tuple[Path, Path]) -> HostWeights:
    return HostWeights.load(pair[0])


def _two_tensors(weights: HostWeights, pair: tuple[Path, Path]) -> tuple[str, str, HostWeights]:
    new = HostWeights.load(pair[1])
    changed = [n for n in weights.names() if weights.raw(n).tobytes() != new.raw(n).tobytes()]
    return changed[0], changed[1], new


def _tree(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir()}


def _assert_fails_untouched(weights: HostWeights, delta_dir: Path, error: type[Exception], pattern: str) -> None:
    """The delta fails the same way in memory (HostWeights) and streamed in place into a copy of
    the base directory, and neither target changes."""
    before = raw_bytes(weights)
    with pytest.raises(error, match=pattern) as info:
        weights.apply_delta(delta_dir)
    assert isinstance(info.value, SnapshotError) and isinstance(info.value, ValueError)
    assert raw_bytes(weights) == before
    target = copy_tree(Path(weights.source_uri), delta_dir.parent / "in-place-target")
    files = _tree(target)
    with pytest.raises(error, match=pattern):
        # Small chunks, so a frame's faults show up mid-tensor too.
        materialize_chain_report(target, [delta_dir], target, chunk_bytes=4096)
    assert _tree(target) == files
    assert [p.name for p in delta_dir.parent.iterdir() if p.name.startswith(".")] == []  # no temp left


def test_wrong_checksum_rolls_back_every_tensor(weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b, new = _two_tensors(weights, pair)
    frames = {a: xor_frame(weights.raw(a), new.raw(a)), b: xor_frame(weights.raw(b), new.raw(b))}
    d = write_delta_dir(tmp_path / "d", frames, {a: adler(new.raw(a)), b: "deadbeef"})
    _assert_fails_untouched(
        weights, d, ChecksumError, rf"{SHARD}: tensor '{b}': checksum mismatch: the writer recorded deadbeef"
    )


def test_checksum_missing(weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b, new = _two_tensors(weights, pair)
    frames = {a: xor_frame(weights.raw(a), new.raw(a)), b: xor_frame(weights.raw(b), new.raw(b))}
    d = write_delta_dir(tmp_path / "d", frames, {a: adler(new.raw(a)), b: None})
    _assert_fails_untouched(weights, d, ChecksumError, rf"{SHARD}: tensor '{b}': no Adler-32 checksum")


def test_frame_of_wrong_size(weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b, new = _two_tensors(weights, pair)
    short = zstandard.ZstdCompressor(level=1).compress(bytes(weights.info(b).nbytes - 2))
    frames = {a: xor_frame(weights.raw(a), new.raw(a)), b: short}
    d = write_delta_dir(tmp_path / "d", frames, {a: adler(new.raw(a)), b: adler(new.raw(b))})
    _assert_fails_untouched(
        weights,
        d,
        DeltaMismatchError,
        rf"{SHARD}: tensor '{b}': frame decompresses to {weights.info(b).nbytes - 2} bytes",
    )


def test_frame_of_wrong_size_without_declared_size(
    weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _, new = _two_tensors(weights, pair)
    short = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(weights.info(a).nbytes - 2))
    d = write_delta_dir(tmp_path / "d", {a: short}, {a: adler(new.raw(a))})
    _assert_fails_untouched(weights, d, DeltaMismatchError, rf"tensor '{a}': frame decompresses to")


def _largest(weights: HostWeights) -> str:
    return max(weights.names(), key=lambda n: weights.info(n).nbytes)


def test_zstd_bomb_declared_size_is_refused_before_decompressing(weights: HostWeights, tmp_path: Path) -> None:
    a = _largest(weights)
    bomb = zero_bomb(declare_size=True)
    assert len(bomb) < 64 * 2**10 and zstandard.frame_content_size(bomb) == BOMB_BYTES
    d = write_delta_dir(tmp_path / "d", {a: bomb}, {a: "00000001"})
    _assert_fails_untouched(
        weights,
        d,
        DeltaMismatchError,
        rf"tensor '{a}': frame decompresses to 268435456 bytes .*refused without decompressing",
    )


def test_zstd_bomb_without_declared_size_stops_at_the_tensor_size(weights: HostWeights, tmp_path: Path) -> None:
    a = _largest(weights)
    bomb = zero_bomb(declare_size=False)
    assert len(bomb) < 64 * 2**10 and zstandard.frame_content_size(bomb) == -1
    d = write_delta_dir(tmp_path / "d", {a: bomb}, {a: "00000001"})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _assert_fails_untouched(weights, d, DeltaMismatchError, rf"tensor '{a}': frame inflates past the base tensor's")
    # Nothing near 256 MiB was allocated for it (ru_maxrss is in KiB on Linux).
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024


def test_corrupt_frame(weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, _, new = _two_tensors(weights, pair)
    frame = bytearray(xor_frame(weights.raw(a), new.raw(a)))
    frame[len(frame) // 2 :] = bytes(len(frame) - len(frame) // 2)
    d = write_delta_dir(tmp_path / "d", {a: bytes(frame)}, {a: adler(new.raw(a))})
    _assert_fails_untouched(weights, d, SnapshotError, rf"tensor '{a}': ")


def test_trailing_bytes_after_the_frame(weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, b, new = _two_tensors(weights, pair)
    frames = {a: xor_frame(weights.raw(a), new.raw(a)), b: xor_frame(weights.raw(b), new.raw(b)) + b"\x00" * 7}
    d = write_delta_dir(tmp_path / "d", frames, {a: adler(new.raw(a)), b: adler(new.raw(b))})
    _assert_fails_untouched(
        weights, d, DeltaMismatchError, rf"{SHARD}: tensor '{b}': 7 trailing bytes after the zstd frame"
    )


@pytest.mark.parametrize("tasks_per_worker", [4, 1])
def test_a_bad_tensor_after_a_good_one_in_the_same_decode_task_leaves_both_untouched(
    weights: HostWeights,
    pair: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tasks_per_worker: int,
) -> None:
    """Tensors are decoded several per task (one task per tensor costs more than the decode at
    tens of thousands of tensors): the first decoded in place is undone when the next fails."""
    monkeypatch.setattr(codec, "TASKS_PER_WORKER", tasks_per_worker)
    a, b, new = _two_tensors(weights, pair)
    frames = {a: xor_frame(weights.raw(a), new.raw(a)), b: xor_frame(weights.raw(b), new.raw(b))}
    d = write_delta_dir(tmp_path / "d", frames, {a: adler(new.raw(a)), b: "00000001"})
    sizes = [weights.info(n).nbytes for n in read_delta_plan(d).tensors]
    assert len(codec.task_batches(sizes, 1)) == (1 if tasks_per_worker == 1 else 2)
    monkeypatch.setattr(weights, "workers", 1)
    _assert_fails_untouched(weights, d, ChecksumError, rf"tensor '{b}': checksum mismatch")


def test_a_delta_decode_opens_each_file_once(
    weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode reads every frame of a local file through one open of it (an open per tensor
    costs more than decoding a small tensor, at tens of thousands of tensors)."""
    new = HostWeights.load(pair[1])
    changed = [n for n in weights.names() if weights.raw(n).tobytes() != new.raw(n).tobytes()]
    frames = {n: xor_frame(weights.raw(n), new.raw(n)) for n in changed}
    d = write_delta_dir(tmp_path / "d", frames, {n: adler(new.raw(n)) for n in changed})
    opened: list[str] = []
    real_open = storage.os.open
    monkeypatch.setattr(storage.os, "open", lambda path, *a: opened.append(str(path)) or real_open(path, *a))
    weights.apply_delta(d)
    assert len(changed) > 2 and opened == [str(d / SHARD)]
    assert raw_bytes(weights) == raw_bytes(new)


def test_small_tensors_are_worked_on_one_thread() -> None:
    assert codec.threads_for([], 4) == 1
    assert codec.threads_for([4096] * 18_867, 4) == 1  # an MoE's experts at tiny widths
    assert codec.threads_for([3 << 20] * 100, 4) == 4 and codec.threads_for([3 << 20], 4) == 1


def test_tasks_take_several_small_tensors_and_a_big_one_alone() -> None:
    assert codec.task_batches([], 2) == []
    assert [list(r) for r in codec.task_batches([10] * 16, 1)] == [list(range(i, i + 4)) for i in range(0, 16, 4)]
    assert [list(r) for r in codec.task_batches([1000, 1, 1, 1, 1, 1, 1, 1], 1)] == [[0], [1, 2], [3, 4], [5, 6], [7]]
    assert sum(len(r) for r in codec.task_batches([7] * 10_000, 2)) == 10_000


def test_second_frame_after_the_frame(weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, _, new = _two_tensors(weights, pair)
    frame = xor_frame(weights.raw(a), new.raw(a))
    empty = zstandard.ZstdCompressor().compress(b"")
    d = write_delta_dir(tmp_path / "d", {a: frame + empty}, {a: adler(new.raw(a))})
    _assert_fails_untouched(
        weights, d, DeltaMismatchError, rf"tensor '{a}': {len(empty)} trailing bytes after the zstd frame"
    )


def test_frame_cut_short(weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, _, new = _two_tensors(weights, pair)
    frame = xor_frame(weights.raw(a), new.raw(a), write_checksum=True)
    d = write_delta_dir(tmp_path / "d", {a: frame[:-2]}, {a: adler(new.raw(a))})
    _assert_fails_untouched(weights, d, DeltaMismatchError, rf"{SHARD}: tensor '{a}': zstd frame is cut short")


def test_frame_longer_than_any_frame_of_the_tensor(weights: HostWeights, tmp_path: Path) -> None:
    a = weights.names()[1]
    nbytes = weights.info(a).nbytes
    # Incompressible content in raw blocks of the right size, padded past zstd's bound.
    oversize = zstandard.ZstdCompressor(level=1).compress(np.random.default_rng(0).bytes(nbytes)) + bytes(4096)
    d = write_delta_dir(tmp_path / "d", {a: oversize}, {a: "00000001"})
    _assert_fails_untouched(
        weights,
        d,
        DeltaMismatchError,
        rf"{SHARD}: tensor '{a}': frame is {len(oversize)} bytes, more than any zstd frame of the base tensor's "
        rf"{nbytes} bytes can be",
    )


def test_not_a_zstd_frame(weights: HostWeights, tmp_path: Path) -> None:
    a = weights.names()[1]
    d = write_delta_dir(tmp_path / "d", {a: b"not zstd at all"}, {a: "00000001"})
    _assert_fails_untouched(weights, d, DeltaMismatchError, rf"{SHARD}: tensor '{a}': not a zstd frame")


def test_tensor_in_delta_but_not_in_base(weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, _, new = _two_tensors(weights, pair)
    frames = {a: xor_frame(weights.raw(a), new.raw(a)), "model.ghost.weight": zstandard.compress(bytes(4))}
    d = write_delta_dir(tmp_path / "d", frames, {a: adler(new.raw(a)), "model.ghost.weight": adler(bytes(4))})
    _assert_fails_untouched(
        weights, d, DeltaMismatchError, rf"{SHARD}: tensor 'model.ghost.weight': is in the delta but not in the base"
    )


def test_truncated_delta_shard(weights: HostWeights, delta: Path, tmp_path: Path) -> None:
    d = shutil.copytree(delta, tmp_path / "d")
    shard = next(d.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-100])
    _assert_fails_untouched(weights, d, SnapshotError, rf"{shard.name}: tensor '.*': data ends at .*truncated")


def test_unsupported_encoding_on_apply(weights: HostWeights, tmp_path: Path) -> None:
    a = weights.names()[1]
    meta = {
        "version": "1",
        "base_version": "0",
        "delta_encoding": "overwrite",
        "compression_format": "zstd",
        "checksum_format": "adler32",
    }
    d = write_delta_dir(tmp_path / "d", {a: zstandard.compress(bytes(4))}, {a: "00000001"}, metadata=meta)
    _assert_fails_untouched(weights, d, SnapshotError, "delta_encoding 'overwrite' is not supported")


@pytest.mark.parametrize("threads", ["one thread", "every worker"])
def test_failure_among_many_tensors_rolls_back_all(
    weights: HostWeights, pair: tuple[Path, Path], tmp_path: Path, threads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if threads == "every worker":  # however small the tensors
        monkeypatch.setattr(codec, "THREADED_MEAN_BYTES", 0)
        monkeypatch.setattr(weights, "workers", 3)
    new = HostWeights.load(pair[1])
    names = [n for n in weights.names() if weights.raw(n).tobytes() != new.raw(n).tobytes()]
    frames = {n: xor_frame(weights.raw(n), new.raw(n)) for n in names}
    sums = {n: adler(new.raw(n)) for n in names}
    sums[names[-1]] = "00000000"  # the last one, so most others are applied before it fails
    d = write_delta_dir(tmp_path / "d", frames, sums)
    _assert_fails_untouched(weights, d, ChecksumError, rf"tensor '{names[-1]}': checksum mismatch")
    # And the weights still take a good delta afterwards.
    sums[names[-1]] = adler(new.raw(names[-1]))
    good = write_delta_dir(tmp_path / "good", frames, sums)
    weights.apply_delta(good)
    assert raw_bytes(weights) == raw_bytes(new)


def test_buffer_sizes_and_writability(tmp_path: Path) -> None:
    old = np.zeros(16, np.uint8)
    new = np.arange(16, dtype=np.uint8)
    d = write_delta_dir(tmp_path / "d", {"w": xor_frame(old, new)}, {"w": adler(new)})
    with pytest.raises(DeltaMismatchError, match="frame decompresses to 16 bytes but the base tensor has 8"):
        apply_delta({"w": bytearray(8)}, d)
    with pytest.raises(SnapshotError, match="read-only"):
        apply_delta({"w": bytes(16)}, d)
    buf = bytearray(16)
    apply_delta({"w": buf}, d)
    assert bytes(buf) == new.tobytes()
