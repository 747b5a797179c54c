"""Small torch models whose ``load_weights`` does what vLLM's fused-expert loaders do, and the
weight map built over them: shared by the weight-map and scatter tests (no vLLM)."""

from __future__ import annotations

import torch

from replica.engine.weight_map import WeightMap

BF16 = torch.bfloat16


def loaded(model: torch.nn.Module, tensors: dict[str, torch.Tensor], quantization: str | None = None) -> WeightMap:
    model.load_weights(list(tensors.items()))
    return WeightMap.build(
        model, [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()], tensors.__getitem__, quantization
    )


class Experts(torch.nn.Module):
    """A MoE layer as vLLM fuses it: each expert's gate and up rows in one ``w13`` parameter, its
    down projection in ``w2``; a norm beside them."""

    E, INTER, H = 8, 4, 6

    def __init__(self) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(torch.zeros(self.E, 2 * self.INTER, self.H, dtype=BF16), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.zeros(self.E, self.H, self.INTER, dtype=BF16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(self.H, dtype=BF16), requires_grad=False)

    def load_weights(self, weights) -> None:
        for name, t in weights:
            if name == "norm.weight":
                self.norm.data.copy_(t)
                continue
            _, e, proj, _ = name.split(".")
            e = int(e)
            if proj == "down_proj":
                self.w2.data[e].copy_(t)
            else:
                self.w13.data[e].narrow(0, 0 if proj == "gate_proj" else self.INTER, self.INTER).copy_(t)


def expert_checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    E, inter, H = Experts.E, Experts.INTER, Experts.H
    out = {"norm.weight": torch.randn(H, generator=gen).to(BF16)}
    for e in range(E):
        out[f"experts.{e}.gate_proj.weight"] = torch.randn(inter, H, generator=gen).to(BF16)
        out[f"experts.{e}.up_proj.weight"] = torch.randn(inter, H, generator=gen).to(BF16)
        out[f"experts.{e}.down_proj.weight"] = torch.randn(H, inter, generator=gen).to(BF16)
    return out
