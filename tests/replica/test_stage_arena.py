"""StageArena: shared memory another process reads through /proc/<pid>/fd/<n>."""

from __future__ import annotations

import asyncio
import errno
import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from replica.engine import shared_memory
from replica.stage_arena import ALIGN, StageArena, decode_turn_marker, host_decode_slot


def test_layout_is_aligned_and_the_arena_grows(tmp_path: Path) -> None:
    arena = StageArena(tmp_path)
    layout = arena.reserve([("a", 3), ("b", 100), ("c", 0)])
    assert layout == {"a": (0, 3), "b": (ALIGN, 100), "c": (3 * ALIGN, 0)}
    assert arena.size >= 3 * ALIGN
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing to leak
    small_path = arena.path
    arena.reserve([("big", 10 * 2**20)])
    assert arena.size >= 10 * 2**20 and arena.view(0, 10 * 2**20).nbytes == 10 * 2**20
    arena.reserve([("a", 16)])  # smaller requests reuse the same memory
    assert arena.size >= 10 * 2**20
    assert small_path.startswith(f"/proc/{os.getpid()}/fd/")
    arena.close()


def test_another_process_sees_the_bytes(tmp_path: Path) -> None:
    arena = StageArena(tmp_path)
    ((offset, nbytes),) = arena.reserve([("t", 4096)]).values()
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    arena.view(offset, nbytes)[:] = data
    code = (
        "import sys, mmap\n"
        "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0)\n"
        "sys.stdout.write(m[int(sys.argv[2]):int(sys.argv[2]) + int(sys.argv[3])].hex())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, arena.path, str(offset), str(nbytes)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    assert bytes.fromhex(out) == data.tobytes()
    arena.close()


async def test_decode_slot_is_held_by_one_at_a_time_and_a_canceled_waiter_leaves_it(tmp_path: Path) -> None:
    inside: list[str] = []
    log: list[str] = []

    async def holder(name: str) -> None:
        async with host_decode_slot(tmp_path):
            inside.append(name)
            assert len(inside) == 1, inside
            log.append(name)
            await asyncio.sleep(0.1)
            inside.remove(name)

    async with host_decode_slot(tmp_path):
        waiter = asyncio.ensure_future(holder("canceled"))
        await asyncio.sleep(0.05)
        waiter.cancel()
    await asyncio.gather(holder("a"), holder("b"), holder("c"))
    assert sorted(log) == ["a", "b", "c"]


def test_a_full_shm_dir_falls_back_to_the_temp_dir(tmp_path: Path, monkeypatch) -> None:
    """A tmpfs too small for the arena must not become a SIGBUS at the first write."""
    full = tmp_path / "shm"
    full.mkdir()
    spare = tmp_path / "tmp"
    spare.mkdir()
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, length: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(full)):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    monkeypatch.setattr("tempfile.tempdir", str(spare))
    arena = StageArena(full)
    arena.reserve([("t", 1 << 20)])
    assert arena.directory == spare and arena.size >= 1 << 20
    arena.view(0, 1 << 20)[:] = 7
    arena.close()


async def test_decode_turns_go_in_position_order_and_dead_markers_are_ignored(tmp_path: Path) -> None:
    order: list[int] = []
    # A marker left by a process that no longer exists holds nobody up.
    (tmp_path / "rollouts-turn-7-000000-999999999").touch()
    markers = {pos: decode_turn_marker(tmp_path, "7", pos) for pos in (3, 2, 1)}

    async def receiver(pos: int, delay: float) -> None:
        await asyncio.sleep(delay)  # the later positions ask first
        async with host_decode_slot(tmp_path, ("7", pos)):
            order.append(pos)
            await asyncio.sleep(0.02)
        markers[pos].unlink()

    await asyncio.gather(receiver(3, 0.0), receiver(2, 0.01), receiver(1, 0.05))
    assert order == [1, 2, 3]


def test_a_host_copy_allocated_in_an_arena_is_found_by_offset(tmp_path: Path) -> None:
    arena = StageArena(tmp_path)
    buffers = arena.allocate({"a.safetensors": 100, "b.safetensors": 1000})
    assert {n: b.nbytes for n, b in buffers.items()} == {"a.safetensors": 100, "b.safetensors": 1000}
    buffers["b.safetensors"][:] = 7
    assert arena.offset_of(buffers["a.safetensors"]) == 0
    b_at = arena.offset_of(buffers["b.safetensors"])
    assert b_at % 64 == 0 and b_at >= 100
    assert arena.offset_of(buffers["b.safetensors"][10:20]) == b_at + 10
    assert bytes(arena.view(b_at, 3)) == b"\x07\x07\x07"
    with pytest.raises(ValueError, match="does not lie in this arena"):
        arena.offset_of(np.zeros(10, dtype=np.uint8))
    arena.close()


def _file_key(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size


def test_an_arena_let_go_closes_its_file_and_the_engine_forgets_its_mapping(tmp_path: Path) -> None:
    """A replaced host copy's arena must not pin its shared memory: dropping the arena closes
    its file, and the engine's next mapping forgets mappings of files that are gone."""
    kept, dropped = StageArena(tmp_path), StageArena(tmp_path)
    kept.reserve([("a", 128)])
    dropped.reserve([("a", 128)])
    kept_path, dropped_path = kept.path, dropped.path
    shared_memory.map_shared(kept_path)
    shared_memory.map_shared(dropped_path)
    dropped_key = shared_memory.SHARED_MAPS[dropped_path][0]
    del dropped
    gc.collect()
    # The agent's fd is closed: its number names no file, or (reused by another thread of this
    # process meanwhile) another one.
    assert not os.path.exists(dropped_path) or _file_key(dropped_path) != dropped_key
    # The next arena may or may not get the dropped one's fd number (its path): either way the
    # engine must map the new file, not hand back the old mapping, and forget the old one.
    newer = StageArena(tmp_path)
    newer.reserve([("a", 64)])
    memory = shared_memory.map_shared(newer.path)
    assert memory.numel() == os.stat(newer.path).st_size
    kept_key = shared_memory.SHARED_MAPS[kept_path][0]
    keys = {key for key, _, _ in shared_memory.SHARED_MAPS.values()}
    assert dropped_key not in keys
    assert set(shared_memory.SHARED_MAPS) == {kept_path, newer.path} and len(keys) == 2 and kept_key in keys
    for arena in (kept, newer):
        arena.close()
    shared_memory.SHARED_MAPS.clear()


def test_views_of_many_tensors_are_view_at_s() -> None:
    memory = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    views = shared_memory.Views(memory, "arena")
    for name, offset, dtype, shape in (
        ("a", 64, torch.bfloat16, (4, 8)),
        ("b", 128, torch.float32, (3, 5)),
        ("d", 1001, torch.uint8, (7,)),
    ):
        got, want = views.at(name, offset, dtype, shape), shared_memory.view_at(memory, name, offset, dtype, shape, "")
        assert got.shape == want.shape and got.dtype == want.dtype and got.data_ptr() == want.data_ptr()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and got.is_contiguous()
    with pytest.raises(ValueError, match="e: bytes 16380..16388 lie outside the 16384-byte arena"):
        views.at("e", 16380, torch.float32, (2,))
    with pytest.raises(RuntimeError, match="divisible by 2"):  # as view_at: not at a multiple of the dtype's size
        views.at("c", 3, torch.bfloat16, (2, 2))
