"""Hot-loads at tensor-parallel size 2 through the whole service (``runtime.engineConfig``
``tensor-parallel-size``: two ranks, one core each on this 2-core machine): every rank stages,
swaps and proves its own shard inside the one pause, and what the ranks serve is read back shard
by shard against the same regions of the trainer's tensors. An MoE (Qwen3-MoE: experts and
attention split across ranks) and a dense model with q/k/v biases the engine holds in float32
(Qwen2). The chain and what it checks: tests/helpers/family_chain.py; a rank whose proof fails
rolls every rank back: tests/replica/test_engine_ranks.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.family_chain import run_family_chain

pytestmark = pytest.mark.stack


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2"])
def test_a_tp2_deployment_takes_a_full_and_cwtrain_deltas_and_serves_what_a_fresh_tp2_engine_serves(
        stack, family, tmp_path):
    run_family_chain(stack, family, 2, tmp_path)
