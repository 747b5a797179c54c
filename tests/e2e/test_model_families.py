"""Hot-loads of every model family vLLM's CPU backend serves here, through the whole service, at
tensor-parallel size 1 and 2 (``runtime.engineConfig`` ``tensor-parallel-size``: two ranks, one
core each on this 2-core machine, each staging, swapping and proving its own shard inside the
one pause). The chain and what it checks: tests/helpers/family_chain.py.

Cases at TP 1: Llama; Qwen2 (q/k/v biases the engine holds in float32); Qwen3 (tied
embeddings: vLLM's CPU backend packs the one weight for the embedding and for ``lm_head``,
each rebuilt after a write, replica/engine/cpu_gemm.py); Gemma 2; Phi-3 (q/k/v and gate/up
shipped fused); Qwen3-MoE (8 experts, top 2; its experts prepacked by vLLM's CPU kernel and
rebuilt after a write, replica/engine/cpu_moe.py);
Mixtral; a DeepSeek-V3-style MoE (multi-head latent attention, a shared expert, grouped top-k
with a score-correction bias), on each of vLLM's CPU MLA backends (``--attention-backend``:
``CPU_MLA``, and ``AMX_MLA``, which packs ``kv_b_proj`` after loading, only on a CPU with AMX);
Nemotron-H (Mamba-2, attention and ReLU² MLP layers: vLLM computes
``A = -exp(A_log)`` and packs ``conv1d`` after loading, replayed after a write,
replica/engine/post_load.py). At TP 2: Qwen2 (dense) and Qwen3-MoE (experts and attention
split across the ranks). Qwen3-MoE at TP 1 returns routed experts (``enable-return-routed-experts``):
cwtrain's rollout integration reads them in the guide's shape, other after the FULL, and after
the last delta the same as the fresh engine's, and the same from a stream's finishing chunk.

Each case starts one engine, its deployment's, and in one process of its own builds vLLM's engine
fresh on each checkpoint a hot-load reaches, for the answers the deployment must give after it
(tests/helpers/fresh_answers.py: vLLM imported once for all of them). Each case is a scheduling unit of its own
(``unit_per_test``), so the cases spread over both workers. Every family's map, at TP 1 and 2,
without an engine: tests/replica/test_landings.py; a rank whose proof fails rolls every rank
back: tests/replica/test_engine_ranks.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.family_chain import run_family_chain

AMX = "amx_bf16" in Path("/proc/cpuinfo").read_text().split()
# (family, tensor-parallel size, attention backend or None: vLLM's choice)
CASES = [
    ("llama", 1, None),
    ("qwen2", 1, None),
    ("qwen3", 1, None),
    ("gemma2", 1, None),
    ("phi3", 1, None),
    ("qwen3_moe", 1, None),
    ("mixtral", 1, None),
    ("deepseek_v3", 1, "CPU_MLA"),
    pytest.param(
        "deepseek_v3",
        1,
        "AMX_MLA",
        marks=pytest.mark.skipif(
            not AMX, reason="AMX_MLA needs a CPU with AMX (no amx_bf16 in /proc/cpuinfo; vLLM would run CPU_MLA)"
        ),
    ),
    ("nemotron_h", 1, None),
    ("qwen2", 2, None),
    ("qwen3_moe", 2, None),
]
pytestmark = [pytest.mark.stack, pytest.mark.unit_per_test]


def case_id(case) -> str:
    family, tp, backend = case.values if hasattr(case, "values") else case
    return f"{family}-tp{tp}" + (f"-{backend}" if backend else "")


@pytest.mark.parametrize(("family", "tp", "backend"), CASES, ids=[case_id(c) for c in CASES])
def test_a_family_takes_a_full_and_cwtrain_deltas_and_answers_as_a_fresh_engine(
    stack, family, tp, backend, tmp_path, record_property
):
    # Each hot-load's seconds, pause and proof count: in the JUnit XML (``--junitxml``) and in
    # the test's temporary directory (hot_loads.json, kept by pytest for the last runs).
    # One case also takes a sparse delta (changed elements only): Qwen2, whose biases the engine
    # widens to float32 as it scatters them.
    # Qwen3-MoE at TP 1 also returns routed experts (vLLM's Model Runner V2; on this CPU build
    # its Triton kernels run in Triton's interpreter: replica/engine/triton_interpreter).
    figures = json.dumps(
        run_family_chain(
            stack,
            family,
            tp,
            tmp_path,
            sparse=(family, tp) == ("qwen2", 1),
            routes=(family, tp) == ("qwen3_moe", 1),
            engine_config={"attention-backend": backend} if backend else None,
        )
    )
    (tmp_path / "hot_loads.json").write_text(figures)
    record_property("hot_loads", figures)
