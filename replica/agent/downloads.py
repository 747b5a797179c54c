"""Objects of a bucket copied to local files (a model, a delta link's files)."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def download_prefix(s3: Any, bucket: str, prefix: str, dest: Path) -> int:
    """Copy the top-level objects under `prefix/` into `dest`; returns bytes downloaded."""
    dest.mkdir(parents=True, exist_ok=True)
    prefix = prefix.strip("/") + "/"
    total = 0
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) :]
            if not name or "/" in name:
                continue
            target = dest / name
            if not target.exists() or target.stat().st_size != obj["Size"]:
                tmp = target.with_suffix(target.suffix + ".part")
                s3.download_file(bucket, obj["Key"], str(tmp))
                tmp.replace(target)
                total += obj["Size"]
    if not any(dest.iterdir()):
        raise FileNotFoundError(f"no objects under s3://{bucket}/{prefix}")
    return total


def download_shared(s3: Any, bucket: str, prefix: str, dest: Path) -> Path:
    """``dest`` holding the objects under ``prefix/``, downloaded once for every replica of this
    host that asks for the same ``dest``: each downloads into a directory of its own next to it
    and renames it into place; when another replica's rename came first, the copy is dropped and
    its ``dest`` used. Returns ``dest``. (The replicas of a dynamo deployment load their model from
    one path: Dynamo's frontend admits workers of one model only with equal model cards, and a
    card records the model's path.)"""
    if dest.is_dir() and any(dest.iterdir()):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    mine = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        download_prefix(s3, bucket, prefix, mine)
        try:
            mine.rename(dest)
        except OSError:
            if not (dest.is_dir() and any(dest.iterdir())):
                raise
    finally:
        shutil.rmtree(mine, ignore_errors=True)
    return dest


@contextlib.contextmanager
def shared_use(dest: Path) -> Iterator[Path]:
    """Hold the shared directory ``dest`` (``download_shared``) while this replica uses it: a shared
    lock on ``dest``'s lock file beside it. On the way out, the last holder (the one whose lock
    becomes exclusive without waiting) removes ``dest``; a replica that arrives meanwhile waits for
    the removal, then downloads it again."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with (dest.parent / f"{dest.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        try:
            yield dest
        finally:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # another replica of this host still uses it
            else:
                shutil.rmtree(dest, ignore_errors=True)
