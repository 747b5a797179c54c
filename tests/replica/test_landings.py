"""Where each checkpoint tensor lands, from vLLM's own loaders, and the engine's weight map built
from it (replica/engine/landings.py, weight_map.py), on the real model classes of ten families
at tensor-parallel size 1 (small random checkpoints written by ``transformers``;
tests/helpers/family_models.py builds each model in a process of its own, as an engine does, and
loads the checkpoint).

Covers: every tensor of every family lands, the engine holds each where its loader wrote it (so
the map refuses none), and observing writes nothing into the model; the fused shapes land where
vLLM's mappings put them (q/k/v rows of ``qkv_proj``, biases included; per-expert tensors into
``w13_weight``/``w2_weight``; a tied embedding in the embedding). The MoE families' experts land
in the loader-layout copies ``cpu_moe`` keeps (vLLM's CPU kernel prepacks its own after loading).
Then a second checkpoint of each family written through the map leaves every parameter, the
prepacked experts included, bit for bit what vLLM's loader makes of that checkpoint in a fresh
model (Llama, Qwen2 with q/k/v biases, Qwen3 with tied embeddings, Phi-3 shipping q/k/v and
gate/up already fused, Gemma 2, Qwen3-MoE, Mixtral, and a DeepSeek-V3-style MoE: multi-head latent
attention, a shared expert beside the routed ones, a score-correction bias), and Nemotron-H, dense
and MoE (Mamba-2, attention and ReLU² layers; the MoE's non-gated experts are built as on a GPU,
since vLLM's CPU build refuses them: what is and is not exercised is in
tests/helpers/family_models.py). In Nemotron-H's MoE, one expert written in place changes only
its slots of the fused expert parameters, as vLLM's own load of it does. vLLM's routed-experts
capturer on each MoE family counts every decoder layer, with zeros where a layer has no MoE block
(Nemotron-H's Mamba and attention layers, DeepSeek-V3's dense first layer).

At tensor-parallel size 2 (Qwen2 and Qwen3-MoE, two rank processes over gloo as vLLM's CPU
backend runs them): each rank's landings read its own slice of the checkpoint (column-parallel
rows, row-parallel columns, vocabulary rows; a KV head replicated to both), and the same update
written per rank equals a fresh rank's shard. With expert parallelism (Qwen3-MoE, two ranks): each
rank's map holds its own experts whole, leaves the other rank's "elsewhere" (not refused), and
what it holds, written per rank, equals a fresh rank's parameters.

Not an engine process, but vLLM's model classes in subprocesses: marked ``engine`` (it costs
what an engine start costs, ~40 s in all, and make test-fast leaves it out).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.engine_cache import vllm_process_env
from workers.base_model import write_base_model
from workers.families import FAMILIES, MOE

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]
DENSE = ("llama", "qwen2", "qwen3", "phi3", "gemma2")
HYBRID = ("nemotron_h",)  # Mamba-2, attention and MLP layers: tensors vLLM computes on after loading
# An update swapped in through the map (and rolled back once before): what it leaves.
CLEAN = {
    "not_held": [],
    "unpacked": [],
    "params_differ_from_fresh": [],
    "derived_differ_from_fresh": [],
    "kernels_differ_from_fresh": [],
    "rolled_back_differ": [],
    "read_back_failed": [],
}


@pytest.fixture(scope="module")
def families_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the checkpoints are written (and the base model whose tokenizer they take)."""
    root = tmp_path_factory.mktemp("families")
    write_base_model(root / "base")
    return root


def run_family_models(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """tests/helpers/family_models.py on the checkpoints under ``root`` (its own process, as an
    engine's)."""
    return subprocess.run(
        [sys.executable, "-m", "tests.helpers.family_models", str(root), str(root / "base"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=vllm_process_env(root / "vllm-cache"),
    )


def family_models(root: Path, *args: str) -> dict:
    """:func:`run_family_models`'s JSON report."""
    proc = run_family_models(root, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report(families_root: Path) -> dict[str, dict]:
    return family_models(families_root, *FAMILIES)


def test_every_tensor_of_every_family_lands_where_the_engine_holds_it(report):
    assert set(report) == set(FAMILIES)
    for family, r in report.items():
        assert r["tensors"] == len(r["landings"]) > 0, family
        assert r["refused"] == {}, (family, r["refused"])
        assert all(r["landings"][n] for n in r["landings"]), (family, [n for n, ls in r["landings"].items() if not ls])
        assert r["params_changed_by_observe"] == [], family
    # The experts' landings are in the loader-layout copies of each MoE layer (both layers; the
    # DeepSeek-style model's first layer is dense).
    # Nemotron-H's MoE runs vLLM's Triton experts (what an H100 engine picks for its non-gated
    # experts; no CPU prepack), so none.
    assert [report[f]["moe_layers_with_loader_copies"] for f in MOE] == [2, 2, 1, 0]
    assert [report[f]["moe_layers_with_loader_copies"] for f in DENSE + HYBRID] == [0] * len(DENSE + HYBRID)


@pytest.mark.parametrize("family", DENSE + MOE + HYBRID)
def test_an_update_written_through_the_map_is_what_vllm_loads_from_it(report, family):
    update = report[family]["update"]
    assert update["written"] == report[family]["tensors"]
    assert update == {"written": update["written"], **CLEAN}


def test_tensors_vllm_computes_after_loading_land_in_shadows_and_are_replayed(report):
    """Nemotron-H: ``A_log`` lands whole in a checkpoint-layout shadow (vLLM's loader computes
    ``A = -exp(A_log)`` in float32) and ``conv1d.weight`` in the loader tensor vLLM's CPU
    post-load step released (it packs the weight); the update above, written through them and
    replayed, left every parameter and derived tensor as a fresh load of the twin."""
    landings = report["nemotron_h"]["landings"]
    assert landings["backbone.layers.0.mixer.A_log"] == [
        ["model.layers.0.mixer.<ckpt:backbone/layers/0/mixer/A_log>", [4], 0, [4], 0]
    ]
    conv = landings["backbone.layers.0.mixer.conv1d.weight"]
    # x, B and C rows of the merged conv1d, each in the loader's [rows, 1, 4] layout.
    assert [(ld[0], ld[1], ld[2]) for ld in conv] == [
        ("model.layers.0.mixer.conv1d.weight", rows, offset)
        for rows, offset in (([256, 1, 4], 0), ([32, 1, 4], 1024), ([32, 1, 4], 1152))
    ]


@pytest.fixture(scope="module")
def no_replay(families_root: Path) -> dict[str, dict]:
    """Nemotron-H's update written without replaying vLLM's loading and post-load processing."""
    return family_models(families_root, "--no-replay", "nemotron_h")


def test_without_the_replay_the_engine_computes_with_stale_tensors_and_the_proof_says_so(no_replay):
    update = no_replay["nemotron_h"]["update"]
    # The premise: the bytes the loader wrote are in place, what vLLM computes with is not.
    assert update["not_held"] == []
    # (A CPU with AVX-512 BF16 also packs conv1d's weight: stale too, then.)
    assert "model.layers.0.mixer.A" in update["params_differ_from_fresh"]
    # The swap's proof (derived tensors against vLLM's processing of what was written) fails,
    # naming the tensors of the layer it could not prove, and the swap rolls back.
    assert "backbone.layers.0.mixer.A_log" in update["unpacked"]
    assert "backbone.layers.0.mixer.A_log" in update["read_back_failed"]


@pytest.fixture(scope="module")
def stale_lm_head(families_root: Path) -> dict[str, dict]:
    """Qwen3's update written with its tied ``lm_head``'s packed kernel copy left as it was."""
    return family_models(families_root, "--skip-lm-head-rebuild", "qwen3")


def test_a_tied_lm_head_left_packed_from_the_old_embedding_is_caught_by_the_proof(stale_lm_head):
    """Qwen3 ties ``lm_head`` to the embedding: one parameter, two modules, and vLLM's CPU backend
    packs the weight for each (``cpu_linear``). The update above (every kernel as a fresh load's)
    rebuilt both; without the ``lm_head``'s rebuild the logits come from the old embedding."""
    update = stale_lm_head["qwen3"]["update"]
    # The premise: the embedding's bytes are in place, the logits' kernel computes with the old ones.
    assert update["not_held"] == [] and update["params_differ_from_fresh"] == []
    assert update["kernels_differ_from_fresh"] == ["lm_head"]
    # The swap's proof reads the kernel back (`cpu_gemm.stale`), names the tensor and rolls back.
    assert update["unpacked"] == ["model.embed_tokens.weight"]
    assert update["read_back_failed"] == ["model.embed_tokens.weight"]


def test_fused_and_tied_shapes_land_where_vllm_puts_them(report):
    qwen2 = report["qwen2"]["landings"]
    # q (2 heads x 64), k and v (1 head x 64) rows of the fused bias, in order.
    assert [qwen2[f"model.layers.0.self_attn.{x}_proj.bias"] for x in "qkv"] == [
        [["model.layers.0.self_attn.qkv_proj.bias", [128], 0, [128], 0]],
        [["model.layers.0.self_attn.qkv_proj.bias", [64], 128, [64], 0]],
        [["model.layers.0.self_attn.qkv_proj.bias", [64], 192, [64], 0]],
    ]
    # Phi-3 ships qkv_proj fused: vLLM splits it into its q, k and v parts, each landing on itself.
    phi3 = report["phi3"]["landings"]["model.layers.0.self_attn.qkv_proj.weight"]
    assert [(ld[0], ld[2], ld[4]) for ld in phi3] == [
        ("model.layers.0.self_attn.qkv_proj.weight", off, off) for off in (0, 128 * 128, 192 * 128)
    ]
    # Tied: the embedding lands in the one parameter the embedding and lm_head share.
    assert report["qwen3"]["landings"]["model.embed_tokens.weight"] == [
        ["model.embed_tokens.weight", [2048, 128], 0, [2048, 128], 0]
    ]
    # Per-expert tensors: expert 3's gate and up rows of w13, its down_proj in w2.
    moe = report["qwen3_moe"]["landings"]
    w13, w2 = (
        "model.layers.0.mlp.experts.routed_experts.w13_weight",
        "model.layers.0.mlp.experts.routed_experts.w2_weight",
    )
    assert moe["model.layers.0.mlp.experts.3.gate_proj.weight"] == [[w13, [64, 128], 3 * 128 * 128, [64, 128], 0]]
    assert moe["model.layers.0.mlp.experts.3.up_proj.weight"] == [
        [w13, [64, 128], 3 * 128 * 128 + 64 * 128, [64, 128], 0]
    ]
    assert moe["model.layers.0.mlp.experts.3.down_proj.weight"] == [[w2, [128, 64], 3 * 128 * 64, [128, 64], 0]]
    # DeepSeek-style: the shared expert's gate and up in its own fused gate_up_proj; MLA's q and
    # kv down-projections fused into one (q_lora_rank 64 rows, then kv_lora_rank 512 + rope 64).
    ds = report["deepseek_v3"]["landings"]
    shared = "model.layers.1.mlp.shared_experts.gate_up_proj.weight"
    assert [ds[f"model.layers.1.mlp.shared_experts.{x}_proj.weight"] for x in ("gate", "up")] == [
        [[shared, [64, 128], 0, [64, 128], 0]],
        [[shared, [64, 128], 64 * 128, [64, 128], 0]],
    ]
    qkv_a = "model.layers.0.self_attn.fused_qkv_a_proj.weight"
    assert [ds[f"model.layers.0.self_attn.{x}.weight"] for x in ("q_a_proj", "kv_a_proj_with_mqa")] == [
        [[qkv_a, [64, 128], 0, [64, 128], 0]],
        [[qkv_a, [576, 128], 64 * 128, [576, 128], 0]],
    ]


@pytest.fixture(scope="module")
def tp2(families_root: Path) -> dict[str, dict[str, dict]]:
    """Qwen2 (dense) and Qwen3-MoE at tensor-parallel size 2: two rank processes over gloo, each
    building its shard."""
    return family_models(families_root, "--tp", "2", "qwen2", "qwen3_moe")


def test_each_tp_rank_lands_its_shard_from_the_same_slice_of_the_checkpoint(tp2):
    for family in ("qwen2", "qwen3_moe"):
        ranks = tp2[family]
        assert set(ranks) == {"0", "1"}
        for rank, r in ranks.items():
            assert r["refused"] == {} and r["params_changed_by_observe"] == [], (family, rank)
            # The update written per rank is this rank's shard of what vLLM loads from it.
            assert r["update"] == {"written": r["tensors"], **CLEAN}, (family, rank)
        q = "model.layers.0.self_attn.q_proj.weight"
        # Column-parallel: each rank takes its half of q's 128 rows (64 rows x 128 = 8192 elements).
        assert [ranks[r]["landings"][q] for r in "01"] == [
            [["model.layers.0.self_attn.qkv_proj.weight", [64, 128], 0, [64, 128], 0]],
            [["model.layers.0.self_attn.qkv_proj.weight", [64, 128], 0, [64, 128], 8192]],
        ]
        # Row-parallel: o_proj's columns 0-63 on rank 0, 64-127 on rank 1.
        o = "model.layers.0.self_attn.o_proj.weight"
        assert [ranks[r]["landings"][o][0][4] for r in "01"] == [0, 64]
        # One KV head, two ranks: k is replicated, both read all of it.
        k = "model.layers.0.self_attn.k_proj.weight"
        assert [ranks[r]["landings"][k][0][3:] for r in "01"] == [[[64, 128], 0]] * 2
        # The vocabulary is split by rows: 1024 each.
        e = "model.embed_tokens.weight"
        assert [ranks[r]["landings"][e][0][3:] for r in "01"] == [[[1024, 128], 0], [[1024, 128], 1024 * 128]]


@pytest.fixture(scope="module")
def ep2(families_root: Path) -> dict[str, dict[str, dict]]:
    """Qwen3-MoE at tensor-parallel size 2 with expert parallelism (vLLM's
    ``enable_expert_parallel``): two rank processes over gloo, each owning half of the experts."""
    return family_models(families_root, "--tp", "2", "--ep", "qwen3_moe")


def test_each_ep_rank_holds_its_own_experts_whole_and_leaves_the_others_elsewhere(ep2):
    ranks = ep2["qwen3_moe"]

    def experts(names: list[str]) -> set[int]:
        return {int(n.split(".experts.")[1].split(".")[0]) for n in names}

    for rank, r in ranks.items():
        # Another rank's experts are not refused: this rank holds nothing of them ("elsewhere").
        assert r["refused"] == {} and r["params_changed_by_observe"] == [], rank
        assert all(r["landings"][n] == [] for n in r["elsewhere"]), rank
        # What this rank holds, written through its map, is what vLLM's loader makes of the twin
        # on a fresh rank of the same engine.
        assert r["update"] == {"written": r["tensors"] - len(r["elsewhere"]), **CLEAN}, rank
    # Rank 0 owns experts 0-3, rank 1 experts 4-7; each leaves the other's gate, up and down of
    # both layers elsewhere, and every checkpoint tensor lands on some rank.
    assert [experts(ranks[r]["elsewhere"]) for r in "01"] == [{4, 5, 6, 7}, {0, 1, 2, 3}]
    assert [len(ranks[r]["elsewhere"]) for r in "01"] == [24, 24]
    held = [{n for n, ls in ranks[r]["landings"].items() if ls} for r in "01"]
    assert held[0] | held[1] == set(ranks["0"]["landings"]) and len(ranks["0"]["landings"]) == ranks["0"]["tensors"]
    # An expert lands whole in the owner's local slot (expert 5 is rank 1's local expert 1); the
    # attention is still split by tensor parallelism (q's rows).
    w13 = "model.layers.0.mlp.experts.routed_experts.w13_weight"
    assert ranks["1"]["landings"]["model.layers.0.mlp.experts.5.gate_proj.weight"] == [
        [w13, [64, 128], 128 * 128, [64, 128], 0]
    ]
    q = "model.layers.0.self_attn.q_proj.weight"
    assert [ranks[r]["landings"][q][0][4] for r in "01"] == [0, 64 * 128]


def test_nemotron_h_moe_lands_every_tensor_where_vllm_s_non_gated_experts_load_it(report):
    """Nemotron-H's MoE variant (Nemotron 3 Nano's layout; no CPU engine serves it, see
    tests/helpers/family_models.py's ``allow_non_gated_experts_on_cpu``): each expert's
    ``up_proj`` fills its whole slot of ``w13_weight`` (one projection, no gate rows: 64 rows per
    expert), ``down_proj`` its slot of ``w2_weight``; the router's gate and score-correction bias
    (BF16 into vLLM's float32 parameter), the shared expert's up and down projections, the Mamba
    mixer's tensors and the attention's land where vLLM's loader writes them."""
    landings = report["nemotron_h_moe"]["landings"]
    moe = "model.layers.1.mixer"
    w13, w2 = f"{moe}.experts.routed_experts.w13_weight", f"{moe}.experts.routed_experts.w2_weight"
    for e in (0, 3, 7):
        assert landings[f"backbone.layers.1.mixer.experts.{e}.up_proj.weight"] == [
            [w13, [64, 128], e * 64 * 128, [64, 128], 0]
        ]
        assert landings[f"backbone.layers.1.mixer.experts.{e}.down_proj.weight"] == [
            [w2, [128, 64], e * 128 * 64, [128, 64], 0]
        ]
    assert landings["backbone.layers.1.mixer.gate.weight"] == [[f"{moe}.gate.weight", [8, 128], 0, [8, 128], 0]]
    assert landings["backbone.layers.1.mixer.gate.e_score_correction_bias"] == [
        [f"{moe}.gate.e_score_correction_bias", [8], 0, [8], 0]
    ]
    for proj, shape in (("up_proj", [64, 128]), ("down_proj", [128, 64])):
        assert landings[f"backbone.layers.1.mixer.shared_experts.{proj}.weight"] == [
            [f"{moe}.shared_experts.{proj}.weight", shape, 0, shape, 0]
        ]
    # The Mamba mixer: A_log in its checkpoint-layout shadow (vLLM computes A = -exp(A_log)),
    # conv1d in the loader tensor its post-load step released; the attention's q, k, v in qkv_proj.
    assert landings["backbone.layers.0.mixer.A_log"] == [
        ["model.layers.0.mixer.<ckpt:backbone/layers/0/mixer/A_log>", [4], 0, [4], 0]
    ]
    assert [ld[0] for ld in landings["backbone.layers.0.mixer.conv1d.weight"]] == [
        "model.layers.0.mixer.conv1d.weight"
    ] * 3
    for x in ("D", "dt_bias", "norm.weight", "in_proj.weight", "out_proj.weight", "conv1d.bias"):
        assert landings[f"backbone.layers.0.mixer.{x}"], x
    assert [landings[f"backbone.layers.2.mixer.{x}_proj.weight"][0][:3] for x in "qkv"] == [
        ["model.layers.2.mixer.qkv_proj.weight", [128, 128], 0],
        ["model.layers.2.mixer.qkv_proj.weight", [64, 128], 128 * 128],
        ["model.layers.2.mixer.qkv_proj.weight", [64, 128], 192 * 128],
    ]


def test_vllm_s_cpu_build_refuses_nemotron_h_moe_s_experts_unless_its_platform_checks_are_lifted(families_root):
    """The premise of building Nemotron-H's MoE here with two platform checks lifted: vLLM's CPU
    build refuses its non-gated experts (no CPU engine can serve it). If a vLLM release serves them
    on the CPU, this fails: drop ``allow_non_gated_experts_on_cpu`` and test the family end to end."""
    proc = run_family_models(families_root, "--platform-checks", "nemotron_h_moe")
    assert proc.returncode != 0
    assert "is_act_and_mul=False is supported only for CUDA, XPU and ROCm" in proc.stderr


def test_one_expert_written_in_place_changes_that_expert_only_as_vllm_loads_it(report):
    """Expert 3's up and down projections of the first MoE layer, written through the map into
    the engine's model and proven, change its slot of ``w13_weight`` and ``w2_weight`` and nothing
    else, and leave every parameter and derived tensor as vLLM's own ``load_weights`` of the same
    two tensors leaves a model holding the same checkpoint."""
    one = report["nemotron_h_moe"]["one_expert"]
    assert one["names"] == [
        "backbone.layers.1.mixer.experts.3.down_proj.weight",
        "backbone.layers.1.mixer.experts.3.up_proj.weight",
    ]
    assert one["changed"] == {
        "model.layers.1.mixer.experts.routed_experts.w13_weight": [3],
        "model.layers.1.mixer.experts.routed_experts.w2_weight": [3],
    }
    assert one["read_back_failed"] == []
    assert one["params_differ_from_vllm_load"] == one["derived_differ_from_vllm_load"] == []


@pytest.mark.parametrize(
    ("family", "moe_layers", "layers"),
    [("qwen3_moe", [0, 1], 2), ("mixtral", [0, 1], 2), ("deepseek_v3", [1], 2), ("nemotron_h_moe", [1, 3], 4)],
)
def test_routed_experts_count_every_decoder_layer_and_layers_without_moe_are_zeros(report, family, moe_layers, layers):
    """The guide's shape rule for ``routed_experts``: ``[tokens, num_decoder_layers, top_k]``,
    every decoder layer counted, those without an MoE block zeros. From vLLM's own capturer bound
    to each family's model (tests/helpers/family_models.py ``routes``): Nemotron-H's Mamba (0) and
    attention (2) layers and DeepSeek-V3's dense first layer are zeros; each MoE layer holds the
    ids its router picked."""
    routes = report[family]["routes"]
    tokens, top_k = 5, 2
    assert routes["shape"] == [tokens, layers, top_k] and routes["dtype"] == "uint8"
    assert sorted(int(k) for k in routes["routed"]) == moe_layers
    captured = routes["captured"]
    for layer in range(layers):
        rows = [captured[t][layer] for t in range(tokens)]
        if layer in moe_layers:
            assert rows == routes["routed"][str(layer)], (family, layer)
        else:
            assert rows == [[0] * top_k] * tokens, (family, layer)
    # (The premise: the MoE layers' ids are not all zeros, so zeros mark the layers without one.)
    assert any(any(r) for layer in moe_layers for r in routes["routed"][str(layer)])
