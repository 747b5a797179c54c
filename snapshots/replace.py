"""Replacing a checkpoint directory whole: `out` always holds a complete checkpoint.

:func:`replacing_directory` hands out a fresh temporary sibling of ``out`` to write into. When
the block ends normally, the new directory and ``out`` are swapped in one atomic step
(``renameat2(RENAME_EXCHANGE)``; where the file system lacks it, two renames with the old one
first moved aside), so at every instant ``out`` is either the old checkpoint or the new one,
even across a crash, and an in-place apply (``out`` is its own base) never loses its base. The
replaced files, now at the temporary name, are then handed to ``discard``: removed at once by
default, or by :func:`remove_in_background` (a detached ``rm``) for a command that should
return as soon as the new checkpoint is in place. When the block raises, the temporary
directory is removed and ``out`` is untouched.

With ``fsync`` the swap is made durable (the block must have synced what it wrote).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc = ctypes.CDLL(None, use_errno=True)


def exchange(a: Path, b: Path) -> None:
    """Swap two existing paths atomically; where the file system cannot, ``b`` is moved aside,
    ``a`` renamed to ``b`` and the old ``b`` to ``a``."""
    renameat2 = getattr(_libc, "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise OSError(err, os.strerror(err), str(a), None, str(b))
    aside = b.with_name(f"{b.name}.aside-{os.getpid()}")
    b.rename(aside)
    a.rename(b)
    aside.rename(a)


def remove_in_background(path: Path) -> None:
    """Remove ``path`` in a detached process: the caller returns at once, and the removal
    (which frees the old files' pages and blocks, a few hundred ms per GiB) goes on after it."""
    subprocess.Popen(
        ["rm", "-rf", "--", str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextmanager
def replacing_directory(
    out: Path, *, fsync: bool = False, discard: Callable[[Path], None] = shutil.rmtree
) -> Iterator[Path]:
    """A fresh temporary sibling of ``out`` that replaces ``out`` when the block ends normally
    (the module doc); ``discard`` then removes the replaced files."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            exchange(tmp, out)
        else:
            tmp.rename(out)
            tmp = None  # type: ignore[assignment]
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if fsync:
        fsync_path(out.parent)
    if tmp is not None:
        discard(tmp)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
