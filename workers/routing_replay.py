"""Routing replay for the demo's Mixture-of-Experts trainer (`workers.grpo.Policy`).

Replaying the sampler's ``nvext.routed_experts`` sends each token to the experts that produced
the sample, so the trainer's log-probs and gradients belong to the computation the sampler ran.
``routers(model)`` lists transformers' ``*TopKRouter`` modules in layer order (none: replay
refuses). ``Replay(model, routes)`` (``routes``: ``[B, T, layers, top_k]``, ``-1`` where the
model routes itself) makes each router's indices the given ones and its scores the softmax
probabilities there (so the router still learns); ``agreed`` / ``compared`` count the rows where
the model's own top-k was the sampler's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def routers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class Replay:
    def __init__(self, model: nn.Module, routes: torch.Tensor) -> None:
        self.layers = routers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no MoE router to replay routes through")
        if routes.ndim != 4 or routes.shape[2] != len(self.layers) or routes.shape[3] != self.layers[0].top_k:
            raise ValueError(
                f"routes of shape {list(routes.shape)} do not fit {len(self.layers)} MoE layers "
                f"of top-{self.layers[0].top_k}: expected [batch, tokens, layers, top_k]"
            )
        self.routes = routes
        self.agreed = 0
        self.compared = 0
        self._hooks: list[Any] = []

    def __enter__(self) -> Replay:
        for layer, router in enumerate(self.layers):
            self._hooks.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _hook(self, layer: int):
        def replace(router: nn.Module, inputs: tuple, output: tuple) -> tuple:
            logits, _, own = output
            given = self.routes[:, :, layer, :].reshape(-1, own.shape[-1])
            if given.shape[0] != own.shape[0]:
                raise ValueError(f"routes cover {given.shape[0]} tokens, the batch has {own.shape[0]}")
            known = (given >= 0).all(-1)
            with torch.no_grad():
                same = (own.sort(-1).values == given.sort(-1).values).all(-1)
                self.agreed += int((same & known).sum())
                self.compared += int(known.sum())
            indices = torch.where(known[:, None], given, own)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            scores = probs.gather(-1, indices)
            if getattr(router, "norm_topk_prob", False):
                scores = scores / scores.sum(dim=-1, keepdim=True)
            return logits, scores.to(logits.dtype), indices

        return replace
