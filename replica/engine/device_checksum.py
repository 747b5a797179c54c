"""Adler-32 computed where a tensor lives, with torch reductions: equal to ``zlib.adler32`` of the
tensor's raw row-major bytes, so a GPU engine proves a parameter without copying it to the host.

Each ``BLOCK`` of ``L`` bytes moves the running ``(A, B)`` to ``(A + S, B + L*A + W)`` with
``S = sum b_i`` and ``W = L*S - sum i*b_i``, reduced in int64 on the device (no overflow within a
block), then folded mod 65521; two integers per block come back to the host. On CPU tensors
`tensors.adler32_hex` (zlib) is faster and used instead; this one is tested against zlib.
"""

from __future__ import annotations

import torch

MOD = 65521
BLOCK = 1 << 24  # bytes reduced at once: 16 MiB (a 128 MiB int64 scratch on the device)

_RAMPS: dict[tuple[str, int], torch.Tensor] = {}


def _ramp(device: torch.device, n: int) -> torch.Tensor:
    """0, 1, ..., n-1 as int64 on ``device`` (kept per device for the block size)."""
    key = (str(device), n)
    ramp = _RAMPS.get(key)
    if ramp is None:
        if len(_RAMPS) > 8:
            _RAMPS.clear()
        ramp = _RAMPS[key] = torch.arange(n, dtype=torch.int64, device=device)
    return ramp


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, row-major, as a flat uint8 tensor on its own device (a copy only when ``t``
    is not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def adler32_device(t: torch.Tensor, block: int = BLOCK) -> int:
    """Adler-32 of ``t``'s raw bytes, computed on ``t``'s device (module docstring)."""
    data = raw_bytes(t)
    a, b = 1, 0
    total = data.numel()
    for start in range(0, total, block):
        chunk = data[start : start + block]
        n = chunk.numel()
        wide = chunk.to(torch.int64)
        sums = torch.stack((wide.sum(), (wide * _ramp(chunk.device, block)[:n]).sum()))
        s, weighted = (int(v) for v in sums.tolist())  # one transfer of two integers
        w = (n * s - weighted) % MOD
        b = (b + n * a + w) % MOD
        a = (a + s) % MOD
    return (b << 16) | a


def adler32_device_hex(t: torch.Tensor) -> str:
    """:func:`adler32_device` as 8 lowercase hex digits (the snapshot format's)."""
    return "%08x" % adler32_device(t)
