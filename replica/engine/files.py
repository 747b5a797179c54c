"""Files the engine reads and writes: safetensors checkpoints, and whole files as byte tensors.

:class:`Checkpoint` is the checkpoint an engine was started on: every tensor's name, shape and
dtype from the headers of its ``*.safetensors`` files, and each tensor read on demand.

Every write goes to a temporary name first and is renamed into place, so a reader never sees a
half-written file.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

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
    """The safetensors files of a checkpoint directory (module docstring); tensors named in
    SKIP_NAMES are left out. ValueError naming the file for a tensor in two files or of a dtype
    the engine does not know."""

    def __init__(self, model_dir: str | os.PathLike[str]) -> None:
        self.files: dict[str, str] = {}  # tensor -> file
        self.specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        for path in sorted(Path(model_dir).glob("*.safetensors")):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key.endswith(SKIP_NAMES):
                        continue
                    if key in self.files:
                        raise ValueError(f"tensor {key} appears in {self.files[key]} and {path}")
                    piece = f.get_slice(key)
                    try:
                        dtype = dtype_from_str(piece.get_dtype())
                    except ValueError as exc:
                        raise ValueError(f"{path}: tensor {key}: {exc}") from None
                    self.files[key] = str(path)
                    self.specs.append((key, tuple(piece.get_shape()), dtype))

    def read(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], framework="pt", device="cpu") as f:
            tensor: torch.Tensor = f.get_tensor(name)
            return tensor


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
