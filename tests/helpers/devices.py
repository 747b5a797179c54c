"""Where the engine-side tensor tests run: on the CPU in ``make test``, and on a CUDA device in
``make test-gpu`` (``-m gpu``), skipped where there is none (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

# Parametrize a test over these: the same code path on CPU tensors and on the accelerator.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def cuda_available() -> bool:
    return torch.cuda.is_available()
