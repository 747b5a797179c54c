"""Hot-loads of Mixture-of-Experts and other model families through the whole service, at
tensor-parallel size 1 and 2 (``runtime.engineConfig`` ``tensor-parallel-size``: two ranks, one
core each on this 2-core machine, each staging, swapping and proving its own shard inside the
one pause). The chain and what it checks: tests/helpers/family_chain.py.

Cases: Qwen3-MoE (8 experts, top 2; its experts prepacked by vLLM's CPU kernel and rebuilt after
a write, replica/engine/cpu_moe.py) at TP 1 and TP 2 (experts and attention split across the
ranks), Phi-3 (q/k/v and gate/up shipped fused) at TP 1 and Qwen2 (q/k/v biases the engine holds
in float32) at TP 2. They run in ``make test-families`` (``ROLLOUTS_TEST_ALL_FAMILIES=1``), not in
``make test``: each costs a deployment's engine start and a reference engine's (65-155 s each on
2 cores), and ``make test`` already runs close to its 25 minutes on CI. Every family's map, at TP 1 and 2, without an engine:
tests/replica/test_landings.py; a rank whose proof fails rolls every rank back:
tests/replica/test_engine_ranks.py.
"""

from __future__ import annotations

import os

import pytest

from tests.helpers.family_chain import run_family_chain

CASES = [("qwen3_moe", 1), ("qwen3_moe", 2), ("phi3", 1), ("qwen2", 2)]
pytestmark = [pytest.mark.stack, pytest.mark.skipif(not os.environ.get("ROLLOUTS_TEST_ALL_FAMILIES"),
                                                    reason="make test-families runs the model families end to end")]


@pytest.mark.parametrize(("family", "tp"), CASES, ids=[f"{f}-tp{t}" for f, t in CASES])
def test_a_family_takes_a_full_and_cwtrain_deltas_and_serves_what_a_fresh_engine_serves(stack, family, tp, tmp_path):
    run_family_chain(stack, family, tp, tmp_path)
