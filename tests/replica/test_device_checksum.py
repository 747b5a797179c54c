"""The proof's Adler-32 computed with torch reductions where a parameter lives
(replica/engine/device_checksum.py) equals zlib's over the same bytes: every dtype the engine
holds, sizes around zlib's own 5552-byte fold and the reduction's block edges, and views that are
not contiguous. On CPU tensors in ``make test``; on a CUDA device in ``make test-gpu``."""

from __future__ import annotations

import zlib

import pytest
import torch

from replica.engine.device_checksum import adler32_device, adler32_device_hex
from replica.engine.tensors import adler32_hex
from tests.helpers.devices import DEVICES

SIZES = [0, 1, 2, 3, 7, 5551, 5552, 5553, 65536, 100_003]
DTYPES = [
    torch.uint8,
    torch.int8,
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.int32,
    torch.int64,
    torch.float64,
]


def zlib_of(t: torch.Tensor) -> int:
    return zlib.adler32(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def random_tensor(n: int, dtype: torch.dtype, device: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + n)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_equals_zlib_for_every_dtype_and_size(device: str, dtype: torch.dtype) -> None:
    for n in SIZES:
        t = random_tensor(n, dtype, device)
        assert adler32_device(t) == zlib_of(t), (n, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_equals_zlib_across_block_edges_and_at_the_largest_sums(device: str) -> None:
    block = 4096
    for n in (block - 1, block, block + 1, 3 * block + 17):
        t = random_tensor(n, torch.uint8, device, seed=1)
        assert adler32_device(t, block=block) == zlib_of(t), n
    # Every byte 0xff: the largest sums a block can reach, over several blocks of the default size.
    ones = torch.full(((1 << 24) + 3,), 255, dtype=torch.uint8, device=device)
    assert adler32_device(ones) == zlib_of(ones)


@pytest.mark.parametrize("device", DEVICES)
def test_a_view_is_summed_in_its_own_row_major_order(device: str) -> None:
    base = random_tensor(64 * 48, torch.bfloat16, device, seed=2).reshape(64, 48)
    for view in (base.t(), base[:, 8:24], base[::2]):
        assert not view.is_contiguous()
        assert adler32_device_hex(view) == adler32_hex(view.cpu())
