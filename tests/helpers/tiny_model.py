"""A two-layer torch model with vLLM's ``load_weights`` interface and its engine weight map, for
the tests of the engine's update lifecycle without vLLM (tests/replica/test_stage_lifecycle.py,
test_engine_ranks.py)."""

from __future__ import annotations

import torch

from replica.engine.tensors import adler32_hex
from replica.engine.weight_map import WeightMap


class TinyModel(torch.nn.Module):
    """Two layers, and vLLM's interface: ``load_weights`` takes (checkpoint name, tensor) pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=False, dtype=torch.bfloat16)
        self.down = torch.nn.Linear(16, 8, bias=False, dtype=torch.bfloat16)

    def load_weights(self, weights) -> None:
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name].data.copy_(t)


class Tiny(WeightMap):
    """The map of a TinyModel, built as in an engine; ``corrupt`` names a tensor whose next write
    leaves other bytes (a fault between the write and the read-back)."""

    def __init__(self) -> None:
        model = TinyModel()
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
        built = WeightMap.build(model, [(n, tuple(t.shape), t.dtype) for n, t in loaded.items()], loaded.__getitem__)
        super().__init__(model, built.entries)
        self.corrupt: str | None = None

    def write(self, tensors) -> None:
        super().write(tensors)
        if self.corrupt in dict(tensors):
            self.params[self.corrupt].data.view(-1)[0] += 1
            self.corrupt = None


def weights(model: Tiny) -> dict[str, str]:
    return {n: adler32_hex(p) for n, p in model.model.named_parameters()}


def new_values(seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        ("up.weight", torch.randn(16, 8, generator=gen).to(torch.bfloat16)),
        ("down.weight", torch.randn(8, 16, generator=gen).to(torch.bfloat16)),
    ]
