"""The demo trainer's routing replay (workers/routing_replay.py) over a model whose first decoder
layer has no MoE block: the routes' layer axis counts every decoder layer, as vLLM captures them."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from workers.routing_replay import Replay, routers


@pytest.fixture(scope="module")
def dense_first() -> Qwen3MoeForCausalLM:
    """A tiny Qwen3-MoE whose layer 0 is a dense MLP (``mlp_only_layers``), layers 1-2 MoE."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
    )
    return Qwen3MoeForCausalLM(config).eval()


def test_routes_over_every_decoder_layer_replay_through_the_moe_layers_alone(dense_first):
    ids = torch.randint(0, 64, (2, 5))
    assert [i for i, _ in routers(dense_first)] == [1, 2]
    with torch.no_grad():
        out = dense_first(input_ids=ids, output_router_logits=True)
    own = [torch.topk(x.reshape(2, 5, -1), 2, dim=-1).indices for x in out.router_logits]
    # vLLM's shape: every decoder layer, zeros where the layer has no MoE block.
    routes = torch.stack([torch.zeros_like(own[0]), *own], dim=2)
    replay = Replay(dense_first, routes)
    with replay, torch.no_grad():
        replayed = dense_first(input_ids=ids).logits
    assert torch.equal(replayed, out.logits)
    assert replay.agreed == replay.compared == 2 * 5 * 2  # every row of both MoE layers, none of layer 0
    moved = routes.clone()
    moved[:, :, 2] = (moved[:, :, 2] + 3) % 8
    with Replay(dense_first, moved), torch.no_grad():
        assert not torch.allclose(dense_first(input_ids=ids).logits, out.logits)


def test_routes_counting_only_the_moe_layers_are_refused_naming_the_decoder_layers(dense_first):
    with pytest.raises(ValueError, match=r"do not fit 3 decoder layers \(MoE routers at \[1, 2\]\)"):
        Replay(dense_first, torch.zeros(1, 4, 2, 2, dtype=torch.long))
