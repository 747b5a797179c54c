"""Shared memory between a replica's agent and its engine: where an update is decoded once.

The agent decodes a delta into the arena (``new = old XOR diff``, Adler-32 checked) without
touching the host copy; the engine stages zero-copy views of it; after the engine's commit the
host copy takes the bytes. Invariants: the backing file (in ``ROLLOUTS_SHM_DIR``) is unlinked on
creation, so a killed agent leaks nothing; the engine opens it via ``/proc/<agent pid>/fd/<fd>``
(:attr:`path`); :meth:`reserve` hands out the whole arena, so one update at a time (an
uncommitted stage is abandoned first); the arena is reused and only grows; one host decode at a
time per host (:func:`host_decode_slot`). The host copy has an arena of its own
(:meth:`allocate`) which the engine maps for its roll-back views. docs/design.md, "The hot-load walk".
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np

from common import envs

ALIGN = 64  # cache-line aligned tensors: any dtype view is aligned


def shm_dir() -> Path:
    configured = envs.ROLLOUTS_SHM_DIR.get()
    if configured:
        return configured
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class StageArena:
    """A growable shared-memory buffer (module docstring)."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or shm_dir()
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self.size = 0

    @property
    def path(self) -> str:
        """Where another process of the same user opens this arena."""
        if self._fd is None:
            raise RuntimeError("the arena holds nothing yet: reserve() first")
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    def reserve(self, sizes: list[tuple[str, int]]) -> dict[str, tuple[int, int]]:
        """Lay ``(name, nbytes)`` out back to back (aligned); returns name -> (offset, nbytes).
        Everything handed out before is void from here on."""
        layout: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, nbytes in sizes:
            layout[name] = (offset, int(nbytes))
            offset += -(-int(nbytes) // ALIGN) * ALIGN
        if offset > self.size:
            self._replace(max(offset, ALIGN))
        return layout

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A writable flat ``uint8`` view of the arena."""
        assert self._array is not None
        return self._array[offset : offset + nbytes]

    def allocate(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        """Buffers of the given sizes, by name, all in this arena (for a host copy of the
        weights that the engine may read: ``HostWeights.load(allocate=...)``)."""
        layout = self.reserve(list(sizes.items()))
        return {name: self.view(offset, nbytes) for name, (offset, nbytes) in layout.items()}

    def offset_of(self, array: np.ndarray) -> int:
        """Where ``array`` (a view of this arena) starts in it; ValueError for any other array."""
        if self._array is None:
            raise ValueError("the arena holds nothing")
        base = self._array.__array_interface__["data"][0]
        start = array.__array_interface__["data"][0] - base
        if not (0 <= start and start + array.nbytes <= self.size):
            raise ValueError("the array does not lie in this arena")
        return start

    def _replace(self, size: int) -> None:
        self.close()
        try:
            fd = self._allocate(self.directory, size)
        except OSError as exc:
            # A small /dev/shm (a container's default 64 MB): a disk-backed file in the temp
            # directory still shares pages through the page cache.
            fallback = Path(tempfile.gettempdir())
            if fallback == self.directory:
                raise
            try:
                fd = self._allocate(fallback, size)
            except OSError as again:
                raise OSError(
                    f"no room for a {size}-byte stage arena in {self.directory} ({exc}) "
                    f"or {fallback} ({again}); set ROLLOUTS_SHM_DIR"
                ) from None
            self.directory = fallback
        try:
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._map, self.size = fd, mapped, size
        self._array = np.frombuffer(mapped, dtype=np.uint8)

    @staticmethod
    def _allocate(directory: Path, size: int) -> int:
        """An unlinked file of ``size`` bytes, its space reserved now: writing into a mapping
        of a sparse file past a full tmpfs would kill the process with SIGBUS later."""
        fd, name = tempfile.mkstemp(prefix="rollouts-stage-", dir=directory)
        try:
            os.unlink(name)  # nothing to clean up after a crash; the fd keeps it alive
            os.posix_fallocate(fd, 0, size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def __del__(self) -> None:
        # An arena dropped without close() (a replaced host copy, a failed stage) must not keep
        # its file, and so its shared memory, open for the agent's lifetime.
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        """Drop this process's mapping (views handed out keep their pages alive)."""
        self._array = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass  # views still exported: the mapping goes when they do
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.size = 0


def decode_turn_marker(directory: Path, queue: str, position: int) -> Path:
    """Announce early (before the bytes arrive) that this process will want the decode slot as
    ``position`` of ``queue`` (a broadcast: its port; the receiver's rank): a process of a later
    position on this host then waits for it (:func:`host_decode_slot`). Remove it when done."""
    marker = directory / f"rollouts-turn-{queue}-{position:06d}-{os.getpid()}"
    marker.touch()
    return marker


def _earlier_turns(directory: Path, queue: str, position: int) -> bool:
    for marker in directory.glob(f"rollouts-turn-{queue}-*"):
        try:
            _, _, _, pos, pid = marker.name.split("-")[-5:]
            if int(pos) < position:
                os.kill(int(pid), 0)  # a dead process's marker does not hold anyone up
                return True
        except (ValueError, ProcessLookupError):
            continue
        except PermissionError:
            return True
    return False


@contextlib.asynccontextmanager
async def host_decode_slot(directory: Path | None = None, turn: tuple[str, int] | None = None) -> AsyncIterator[None]:
    """Hold this host's decode slot (an flock on ``rollouts-decode.lock`` in :func:`shm_dir`;
    the kernel drops it if the holder dies). With ``turn`` = (queue, position), first wait while
    a live process on this host announced an earlier position of the same queue
    (:func:`decode_turn_marker`): the first receiver of a broadcast is the first to commit, so it
    decodes first. Polled, not blocking, so a canceled waiter leaves no thread behind that would
    take the slot later and never give it back."""
    directory = directory or shm_dir()
    fd = os.open(directory / "rollouts-decode.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        while True:
            if turn is None or not _earlier_turns(directory, *turn):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pass
            await asyncio.sleep(0.005)
        yield
    finally:
        os.close(fd)  # releases the lock
