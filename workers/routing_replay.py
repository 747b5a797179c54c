"""Routing replay for the demo's Mixture-of-Experts trainer (`workers.grpo.Policy`).

Replaying the sampler's ``nvext.routed_experts`` sends each token to the experts that produced
the sample, so the trainer's log-probs and gradients belong to the computation the sampler ran.
``routers(model)`` lists transformers' ``*TopKRouter`` modules with their decoder layer's index
(none: replay refuses). ``Replay(model, routes)`` (``routes``: ``[B, T, layers, top_k]`` over
every decoder layer, as vLLM captures them: a layer without an MoE block, a hybrid's attention
or Mamba layer or DeepSeek's dense first layers, has zeros there and is not read; ``-1`` where
the model routes itself) makes each router's indices the given ones and its scores the softmax
probabilities there (so the router still learns); ``agreed`` / ``compared`` count the rows where
the model's own top-k was the sampler's.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

_DECODER_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """Each MoE router of ``model`` with the index of the decoder layer it routes, in layer order."""
    found = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            at = _DECODER_LAYER.search(name)
            if at is None:
                raise ValueError(f"MoE router {name!r} is not inside a decoder layer ('layers.N.')")
            found.append((int(at.group(1)), module))
    return sorted(found, key=lambda pair: pair[0])


def decoder_layers(model: nn.Module) -> int:
    """How many decoder layers ``model`` has: the layer axis of the routes vLLM captures."""
    config: Any = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return int(config.num_hidden_layers)


class Replay:
    def __init__(self, model: nn.Module, routes: torch.Tensor) -> None:
        self.layers = routers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no MoE router to replay routes through")
        layers, top_k = decoder_layers(model), self.layers[0][1].top_k
        if routes.ndim != 4 or routes.shape[2] != layers or routes.shape[3] != top_k:
            raise ValueError(
                f"routes of shape {list(routes.shape)} do not fit {layers} decoder layers (MoE routers at "
                f"{[i for i, _ in self.layers]}) of top-{top_k}: expected [batch, tokens, layers, top_k]"
            )
        self.routes = routes
        self.agreed = 0
        self.compared = 0
        self._hooks: list[Any] = []

    def __enter__(self) -> Replay:
        for layer, router in self.layers:
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
