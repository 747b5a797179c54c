"""Hot-loads of a Mixture-of-Experts model through the whole service at tensor-parallel size 1:
Qwen3-MoE (8 experts, top 2), whose per-expert tensors land in the fused experts that vLLM's CPU
kernel prepacks after loading (replica/engine/cpu_moe.py). The chain and what it checks:
tests/helpers/family_chain.py. The other families are checked on vLLM's model classes without an
engine (tests/replica/test_landings.py); tensor parallel: test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest

from tests.helpers.family_chain import run_family_chain

pytestmark = pytest.mark.stack


def test_qwen3_moe_takes_a_full_and_cwtrain_deltas_and_serves_what_a_fresh_engine_serves(stack, tmp_path):
    run_family_chain(stack, "qwen3_moe", 1, tmp_path)
