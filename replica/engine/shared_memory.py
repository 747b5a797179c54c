"""The agent's shared memory as the engine sees it: mapped files and tensor views of them.

The agent decodes an update into a stage arena and keeps its host copy in another
(`replica.stage_arena`); the engine maps each by path (``/proc/<agent pid>/fd/<n>``) and stages
zero-copy views of their bytes. A mapping is kept for the next stage while the path names the
same file (device, inode, size) and forgotten once the agent let that file go.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from replica.engine.tensors import nbytes, row_major_strides

SHARED_MAPS: dict[str, tuple[tuple[int, int, int], Any, torch.Tensor]] = {}


def map_shared(path: str) -> torch.Tensor:
    """The file at ``path`` mapped shared, as a flat uint8 tensor."""
    st = os.stat(path)
    key = (st.st_dev, st.st_ino, st.st_size)
    cached = SHARED_MAPS.get(path)
    if cached is not None and cached[0] == key:
        return cached[2]
    # Forget mappings of files the agent has let go (a replaced host copy, a grown arena): kept,
    # they would pin that shared memory for the engine's lifetime. Tensors still viewing one
    # (a stage's) keep it alive until they go.
    for other, (other_key, _, _) in list(SHARED_MAPS.items()):
        try:
            now = os.stat(other)
            gone = (now.st_dev, now.st_ino, now.st_size) != other_key
        except OSError:
            gone = True
        if gone or other == path:
            del SHARED_MAPS[other]
    with open(path, "r+b") as f:
        mapped = mmap.mmap(f.fileno(), st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    memory = torch.frombuffer(mapped, dtype=torch.uint8)
    SHARED_MAPS[path] = (key, mapped, memory)
    return memory


def view_at(
    memory: torch.Tensor, name: str, offset: int, dtype: torch.dtype, shape: tuple[int, ...], where: str
) -> torch.Tensor:
    """``name``'s bytes at ``offset`` of a mapped file (``where``: what it holds) as a tensor;
    ValueError naming the tensor if they do not lie inside it."""
    size = nbytes(dtype, shape)
    if offset < 0 or offset + size > memory.numel():
        raise ValueError(f"{name}: bytes {offset}..{offset + size} lie outside the {memory.numel()}-byte {where}")
    return memory[offset : offset + size].view(dtype).reshape(shape)


class Views:
    """:func:`view_at` for many tensors of one mapped file: one ``as_strided`` per tensor on a
    view of the whole file in the tensor's dtype (made once per dtype), where the offset is a
    multiple of the dtype's size; else :func:`view_at`. A shape's size and strides are worked
    out once per shape (a stage's tens of thousands of experts share a few)."""

    def __init__(self, memory: torch.Tensor, where: str) -> None:
        self.memory, self.where = memory, where
        self.typed: dict[torch.dtype, torch.Tensor] = {}
        self.shapes: dict[tuple[torch.dtype, tuple[int, ...]], tuple[int, tuple[int, ...]]] = {}

    def at(self, name: str, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        known = self.shapes.get((dtype, shape))
        if known is None:
            known = self.shapes[(dtype, shape)] = (nbytes(dtype, shape), row_major_strides(shape))
        size, strides = known
        item = dtype.itemsize
        if offset % item or offset < 0 or offset + size > self.memory.numel():
            return view_at(self.memory, name, offset, dtype, shape, self.where)  # (it names a bad offset)
        typed = self.typed.get(dtype)
        if typed is None:
            whole = self.memory[: self.memory.numel() - self.memory.numel() % item]
            typed = self.typed[dtype] = whole.view(dtype)
        return typed.as_strided(shape, strides, offset // item)
