"""What a replica's update is made of on the agent's side, before and after the engine's swap.

- :class:`StagedUpdate`: an update staged off the serving path (the host copy unchanged, the
  engine's stage taken); :class:`PeerStage`: one received from a peer's broadcast.
- :class:`EngineUpdateError`: the engine could not take an update and serves exactly its
  previous weights (a read-back that differs is ``replica.agent.engine_rpc.ReadBackFailed``).
- helpers: a one-line error, the Adler-32 of files and host arrays, a safetensors file read as
  the host copy's flat byte arrays.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from contracts.activities import PeerOffer
from replica.stage_arena import StageArena
from snapshots.codec import adler32, adler32_hex


def one_line(exc: BaseException, limit: int = 400) -> str:
    """The first and last lines of an error (an engine's start error carries its log tail)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass
class StagedUpdate:
    """An update prepared off the serving path; nothing the engine sees has changed yet."""

    names: list[str] = field(default_factory=list)
    path: Path | None = None
    links: list[str] = field(default_factory=list)
    bytes_read: int = 0
    new_host: Any = None  # a new HostWeights when the chain starts from another full base
    expected: dict[str, str] = field(default_factory=dict)  # Adler-32 of each staged tensor
    changed_by_link: dict[str, list[str] | None] = field(default_factory=dict)
    # New bytes decoded into the stage arena (the host copy adopts them after the swap).
    decoded: dict[str, np.ndarray] = field(default_factory=dict)
    arena_offsets: dict[str, int] = field(default_factory=dict)
    nothing_to_do: bool = False
    new_host_arena: StageArena | None = None  # the shared memory `new_host` lives in
    identity: str = ""
    link_dirs: dict[str, Path] = field(default_factory=dict)  # local files of each delta link
    copied_from: str = ""  # the arena of another replica's decode it was copied from, if so


@dataclass
class PeerStage:
    """Tensors received from a peer and checked, staged in the engine and held for the host
    copy; nothing the engine serves has changed yet."""

    offer: PeerOffer
    received: dict[str, np.ndarray] | None  # tensors as served (mode "tensors")
    staged: StagedUpdate | None = None  # a delta link staged on the host copy (mode "files")


class EngineUpdateError(RuntimeError):
    """The engine could not take an update; it serves exactly its previous weights."""


def ms_since(t0: float) -> float:
    return round((time.perf_counter() - t0) * 1000, 1)


def fmt(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0f} ms" for k, v in timings.items())


def file_adler32(path: Path) -> str:
    value = 1
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            value = adler32(chunk, value)
    return "%08x" % (value & 0xFFFFFFFF)


def adler_mismatches(arrays: dict[str, np.ndarray], expected: dict[str, str]) -> list[str]:
    return [n for n, a in arrays.items() if adler32_hex(a) != expected.get(n, "").lower()]


def read_raw(path: Path) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file as flat byte arrays (the host copy's representation)."""
    out: dict[str, np.ndarray] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            out[key] = f.get_tensor(key).contiguous().view(-1).view(torch.uint8).numpy().copy()
    return out
