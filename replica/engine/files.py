"""Files the engine reads and writes: safetensors checkpoints, and whole files as byte tensors.

:class:`Checkpoint` is the checkpoint an engine was started on: every tensor's name, shape and
dtype from the headers of its ``*.safetensors`` files, and each tensor read on demand.

Every write goes to a temporary name first and is renamed into place, so a reader never sees a
half-written file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from replica.engine.tensors import dtype_from_str, tensor_bytes

# Buffers some checkpoints carry that vLLM computes itself: skipped when a read takes every
# tensor of a file (names=None).
SKIP_NAMES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def read_safetensors(paths: Sequence[str], names: Sequence[str] | None) -> list[tuple[str, torch.Tensor]]:
    """``names`` (in that order; every tensor but SKIP_NAMES when None) from safetensors files;
    ValueError for a tensor missing or in more than one file."""
    wanted = None if names is None else set(names)
    found: dict[str, torch.Tensor] = {}
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if wanted is not None and key not in wanted:
                    continue
                if wanted is None and key.endswith(SKIP_NAMES):
                    continue
                if key in found:
                    raise ValueError(f"tensor {key} appears in more than one file")
                found[key] = f.get_tensor(key)
    if names is not None and wanted is not None:
        missing = sorted(wanted - found.keys())
        if missing:
            raise ValueError(f"{len(missing)} tensor(s) not found in {list(paths)}: {missing[:8]}")
        return [(n, found[n]) for n in names]  # the caller's order
    return list(found.items())


class Checkpoint:
    """The safetensors files of a checkpoint directory, SKIP_NAMES left out; ValueError naming the
    file for a tensor in two files or of an unknown dtype. Each header is parsed once, ``specs``
    lists tensors in file byte order, and :meth:`read` uses one handle per file (never one open
    per tensor, which is quadratic); use as a context manager or :meth:`close` it.
    """

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        self.files: dict[str, str] = {}  # tensor -> file
        self.specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._handles: dict[str, Any] = {}  # file -> its open safe_open handle
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            for key, shape, dtype in _header_specs(str(path)):
                if key.endswith(SKIP_NAMES):
                    continue
                if key in self.files:
                    raise ValueError(f"tensor {key} appears in {self.files[key]} and {path}")
                self.files[key] = str(path)
                self.specs.append((key, shape, dtype))

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (a copy), through its file's one open handle."""
        path = self.files[name]
        handle = self._handles.get(path)
        if handle is None:
            handle = self._handles[path] = safe_open(path, framework="pt", device="cpu")
        tensor: torch.Tensor = handle.get_tensor(name)
        return tensor

    def close(self) -> None:
        self._handles.clear()  # (a safe_open handle lets its file go when dropped)

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _header_specs(path: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of every tensor of a safetensors file, from one parse of its
    header, in the order of the tensors' bytes in the file. ValueError naming the file and tensor
    for a header that cannot be read or a dtype the engine does not know."""
    with open(path, "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        try:
            if size < 2 or size > os.fstat(f.fileno()).st_size - 8:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
        except ValueError as exc:
            raise ValueError(f"{path}: not a safetensors file ({exc})") from None
    out = []
    for key, info in sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
    ):
        try:
            dtype = dtype_from_str(info["dtype"])
        except ValueError as exc:
            raise ValueError(f"{path}: tensor {key}: {exc}") from None
        out.append((key, tuple(int(s) for s in info["shape"]), dtype))
    return out


def save_tensors(tensors: list[tuple[str, torch.Tensor]], path: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors}, tmp, metadata={"format": "pt"})
    os.replace(tmp, path)


def read_file_tensor(path: str) -> torch.Tensor:
    """A whole file as one uint8 tensor."""
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def plain_file_name(name: str) -> str:
    """``name`` if it names a file directly inside a directory, else ValueError."""
    if os.path.basename(name) != name or name in ("", ".", ".."):
        raise ValueError(f"refusing file name {name!r}: not a plain file name")
    return name


def write_files(files: list[tuple[str, torch.Tensor]], out_dir: str) -> None:
    """Write each ``(plain file name, uint8 tensor)`` into ``out_dir`` (created)."""
    os.makedirs(out_dir, exist_ok=True)
    for name, t in files:
        path = os.path.join(out_dir, plain_file_name(name))
        with open(f"{path}.part", "wb") as f:
            f.write(tensor_bytes(t))
        os.replace(f"{path}.part", path)
