"""A stand-in trainer for tests: one Adam-like step on some tensors of a checkpoint, written
as a new full checkpoint in the same layout (what a trainer would publish or diff)."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.base_model import copy_side_files, load_checkpoint, write_tensors


def train_step(prev_dir: Path, out_dir: Path, *, seed: int, lr: float = 2e-3, tensors: int = 4) -> Path:
    """`prev_dir` + a sign-of-gradient step on `tensors` tensors (a few % of elements move in BF16)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_checkpoint(Path(prev_dir))
    gen = torch.Generator().manual_seed(seed)
    names = sorted(state)
    picked = [names[int(i)] for i in torch.randperm(len(names), generator=gen)[:tensors]]
    for name in picked:
        master = state[name].float()
        grad = torch.randn(master.shape, generator=gen)
        state[name] = (master - lr * torch.sign(grad) * master.abs().clamp_min(1e-3)).to(state[name].dtype)
    write_tensors(out_dir, state)
    copy_side_files(Path(prev_dir), out_dir)
    return out_dir
