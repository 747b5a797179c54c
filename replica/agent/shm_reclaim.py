"""Reclaim the shared memory that dead engines and replicas left behind.

A killed vLLM engine never unlinks its ``/dev/shm/psm_*`` message queues (hundreds of MB each),
so a replica agent calls :func:`reclaim_dead_segments` as it starts, before its engine. A file
is removed only when all hold: it sits directly in ``/dev/shm`` or the stage arenas' directory;
its name matches :data:`PATTERNS` (``psm_*``, ``rollouts-stage-*``); it is a regular file of
this user, mode ``0600``; and no readable process maps or holds it open (matched by device and
inode, files listed before processes, so one being opened during the scan is seen in use).
A process whose ``/proc`` cannot be read keeps working on a removed segment (the memory lives
until its last mapping). What was removed is logged and returned.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from replica.stage_arena import shm_dir

log = logging.getLogger("rollouts.shm_reclaim")

PATTERNS: tuple[str, ...] = ("psm_*", "rollouts-stage-*")
DEV_SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Segment:
    path: Path
    bytes: int  # memory it held (allocated blocks)


def default_directories() -> list[Path]:
    dirs = [DEV_SHM, shm_dir()]
    out: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def _candidates(directory: Path, patterns: Sequence[str], uid: int) -> dict[tuple[int, int], Segment]:
    found: dict[tuple[int, int], Segment] = {}
    try:
        entries = list(os.scandir(directory))
    except OSError as exc:
        log.warning("shared-memory reclaim cannot list %s: %s", directory, exc)
        return found
    for entry in entries:
        if not any(fnmatch.fnmatchcase(entry.name, p) for p in patterns):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            continue
        found[(st.st_dev, st.st_ino)] = Segment(Path(entry.path), st.st_blocks * 512)
    return found


def _process_files(pid: str, prefixes: tuple[str, ...]) -> set[tuple[int, int]]:
    """(device, inode) of the files under ``prefixes`` that process ``pid`` holds open, then of
    those it maps. Raises PermissionError, or FileNotFoundError when it exited."""
    held: set[tuple[int, int]] = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith(prefixes):
                st = os.stat(f"{fd_dir}/{fd}")
                held.add((st.st_dev, st.st_ino))
        except FileNotFoundError:  # closed meanwhile
            continue
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith(prefixes):
                continue
            major, minor = (int(x, 16) for x in parts[3].split(":"))
            held.add((os.makedev(major, minor), int(parts[4])))
    return held


def files_in_use(directories: Iterable[Path]) -> tuple[set[tuple[int, int]], list[int]]:
    """(device, inode) of every file in ``directories`` that a readable process maps or holds
    open, and the pids that could not be read."""
    prefixes = tuple(str(d.resolve()).rstrip("/") + "/" for d in directories)
    in_use: set[tuple[int, int]] = set()
    unreadable: list[int] = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            in_use |= _process_files(pid, prefixes)
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited
        except OSError:  # PermissionError, mostly
            unreadable.append(int(pid))
    return in_use, unreadable


def reclaim_dead_segments(
    directories: Sequence[Path] | None = None, patterns: Sequence[str] = PATTERNS
) -> list[Segment]:
    """Remove the segments that the module docstring's rule allows; returns them. Raises
    nothing for what it cannot read or remove (it logs that): a replica starts regardless."""
    dirs = list(directories) if directories is not None else default_directories()
    uid = os.getuid()
    candidates: dict[tuple[int, int], Segment] = {}
    for d in dirs:
        candidates.update(_candidates(d, patterns, uid))
    if not candidates:
        return []
    in_use, unreadable = files_in_use(dirs)
    if unreadable:
        log.debug("shared-memory reclaim could not read processes %s", unreadable)
    removed: list[Segment] = []
    for key, seg in candidates.items():
        if key in in_use:
            continue
        try:
            seg.path.unlink()
        except FileNotFoundError:
            continue  # someone else reclaimed it
        except OSError as exc:
            log.warning("could not remove %s: %s", seg.path, exc)
            continue
        removed.append(seg)
    if removed:
        log.info(
            "reclaimed %d shared-memory segment(s) of dead processes, %.1f MB: %s",
            len(removed),
            sum(s.bytes for s in removed) / 1e6,
            ", ".join(s.path.name for s in removed),
        )
    return removed
