"""Adler-32 computed where a tensor lives, with torch reductions: equal to ``zlib.adler32`` of
the tensor's raw row-major bytes, so a GPU engine proves a parameter against the snapshot's
checksum without copying it to the host.

Adler-32 over bytes ``b_0 .. b_{n-1}`` from ``(A, B) = (1, 0)`` is ``A = 1 + sum b_i`` and
``B = n + sum (n - i) b_i``, both mod 65521. A block of ``L`` bytes moves a running ``(A, B)`` to
``(A + S, B + L*A + W)`` with ``S = sum b_i`` and ``W = sum (L - i) b_i = L*S - sum i*b_i``.
Each block (``BLOCK`` bytes) is reduced in int64 on the tensor's device (``i*b_i`` < 2^32, a
block's sum of them < 2^56), then folded mod 65521 into the running pair. One small tensor
comes back to the host per block (two integers), nothing else.

On a CPU tensor zlib's (or zlib-ng's SIMD) Adler-32 is faster: `tensors.adler32_hex` is used
there; this one is for parameters on an accelerator, and is tested against zlib on CPU tensors.
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
