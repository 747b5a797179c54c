"""The CPU kernels' copies a stage derives before the pause (replica/engine/kernel_copies.py),
on vLLM's Qwen3-MoE model class built and loaded in a process of its own as an engine does
(tests/helpers/kernel_copies_model.py): the pause puts them in place and the proof takes them
only when they are what vLLM makes of what the engine holds.

Covers: a stage writing every tensor derives every MoE layer's prepack and every linear layer's
kernel, and after its swap the packed experts are vLLM's prepack of the loader copies and every
kernel computes what one built from the engine's weight computes; a stale pack put in the stage
(the pack of the values served now) is refused by the proof, naming that layer's tensors, and
rolled back exactly (parameters, loader copies, kernels' outputs); an update writing part of one
layer has the rest of its image compared and is proven; a budget of one layer derives that one
and re-derives the others in the pause, a budget of 0 none; and oneDNN's kernel keeps computing
with the weight it was built from once that tensor is overwritten and freed (the premise of
building it at staging). Marked ``engine``: it builds vLLM's model class (~30 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.engine_cache import vllm_process_env
from workers.base_model import write_base_model

pytestmark = pytest.mark.engine

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("kernel-copies")
    write_base_model(root / "base")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.helpers.kernel_copies_model", str(root), str(root / "base"), "qwen3_moe"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env=vllm_process_env(root / "vllm-cache"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_stage_derives_every_layer_s_kernel_copies_and_the_swap_computes_with_them(report):
    assert report["moe_layers"] == 2
    assert report["derived"]["moe"] == 2 and report["derived"]["linear"] > 0
    assert report["derived"]["partial"] == 0  # every tensor written: every image covered whole
    assert report["every_tensor"] == {
        "unpacked": [],
        "kernels_not_of_what_is_held": [],
        "result": ["checksums", "verified", "verify_s"],
        "kernels_kept_after_proof": False,
    }


def test_a_stale_pack_in_the_stage_is_refused_and_rolled_back_exactly(report):
    assert report["stale_pack"] == {
        "read_back_failed_is_the_layer": True,
        "rolled_back": True,
        "differs_from_before": [],
    }


def test_an_update_writing_part_of_a_layer_is_proven_with_the_rest_of_its_image(report):
    assert report["part_of_a_layer"] == {"written": 2, "partial_images": 2, "verified": 2, "unpacked": []}


def test_past_the_budget_layers_are_re_derived_in_the_pause(report):
    assert report["budget_of_one_layer"] == {
        "derived": 1,
        "verified": True,
        "unpacked": [],
        "kernels_not_of_what_is_held": [],
    }
    assert report["budget_of_zero"] == {
        "derived": 0,
        "verified": True,
        "unpacked": [],
        "kernels_not_of_what_is_held": [],
    }


def test_onednn_s_kernel_outlives_the_weight_it_was_built_from(report):
    assert report["onednn_outlives_its_weight"] is True
