"""The pauses of one host's engines, so that a stage gives way to them.

A replica's pause is what its users wait on; another replica's stage on the same host is
background work that shares its cores (and memory bandwidth) when the two overlap: on 2 cores,
the first replica's pause ran while the second staged, and took up to 1.5x longer. While an
engine is inside its pause (:func:`pausing`: a marker file named by its process in
``<ROLLOUTS_SHM_DIR>/rollouts-pauses``), a stage on the host waits at its next step
(:func:`give_way`, called between a stage's chunks and layers). Invariants: a marker is removed
when its pause ends, and one whose process is gone is removed by the next reader; a stage never
waits longer than ``WAIT_LIMIT_S`` in all, so a stuck marker slows it, never stops it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from replica.stage_arena import shm_dir

#: The most a stage waits for other engines' pauses in all (a pause takes ~0.1 s; a hot-load's
#: walk pauses one replica at a time).
WAIT_LIMIT_S = 2.0
_POLL_S = 0.001

_waited = threading.local()  # seconds this thread's current stage has waited


def _directory() -> Path:
    return shm_dir() / "rollouts-pauses"


@contextlib.contextmanager
def pausing() -> Iterator[None]:
    """Within: this engine is inside its pause (module docstring)."""
    directory = _directory()
    path = directory / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    marker: Path | None = path
    try:
        directory.mkdir(exist_ok=True)
        path.touch()
    except OSError:
        marker = None  # no marker: the host's stages do not give way, nothing else changes
    try:
        yield
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)


def begin_stage() -> None:
    """A stage starts on this thread: its waits count from zero (`WAIT_LIMIT_S`)."""
    _waited.s = 0.0


def give_way() -> None:
    """Wait while another engine of this host is inside its pause, within what is left of
    ``WAIT_LIMIT_S`` for this stage."""
    left = WAIT_LIMIT_S - getattr(_waited, "s", 0.0)
    if left <= 0:
        return
    t0 = time.monotonic()
    while _someone_pausing() and time.monotonic() - t0 < left:
        time.sleep(_POLL_S)
    _waited.s = WAIT_LIMIT_S - left + time.monotonic() - t0


def _someone_pausing() -> bool:
    """Whether a live process's pause marker is in the directory (a dead one's is removed)."""
    try:
        entries = os.scandir(_directory())
    except OSError:
        return False
    with entries:
        for entry in entries:
            pid = entry.name.partition("-")[0]
            if not pid.isdigit():
                continue
            if Path("/proc", pid).exists():
                return True
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    return False
