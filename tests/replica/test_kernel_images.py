"""A layer's image for its kernel copies (replica/engine/kernel_copies.py ``_images``): the
experts' tensors written in blocks (one index copy per fused parameter) give exactly the image
and the coverage of vLLM's landing-by-landing copy, for a whole layer and for part of one; what
is not a set of distinct equal blocks is left to that copy. No vLLM (tests/helpers/expert_models.py)."""

from __future__ import annotations

import pytest
import torch

from replica.engine import kernel_copies
from tests.helpers.expert_models import Experts, expert_checkpoint, loaded


def images(wmap, landed):
    targets = {"w13": wmap.target("w13"), "w2": wmap.target("w2")}
    return kernel_copies._images(wmap, "", targets, landed)


@pytest.mark.parametrize("which", ["every expert", "experts 3 and 5"])
def test_blocks_give_the_landing_by_landing_image(which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    wmap = loaded(Experts(), expert_checkpoint(0))
    new = expert_checkpoint(1)
    landed = [(n, t) for n, t in sorted(new.items()) if n != "norm.weight"]
    if which != "every expert":
        landed = [(n, t) for n, t in landed if n.split(".")[1] in ("3", "5")]
    used = []
    real = kernel_copies._copy_blocks
    monkeypatch.setattr(kernel_copies, "_copy_blocks", lambda *a: used.append(real(*a)) or used[-1])
    blocks = images(wmap, landed)
    assert used == [True, True]  # both fused parameters went in blocks
    monkeypatch.setattr(kernel_copies, "_copy_blocks", lambda *a: False)
    one_by_one = images(wmap, landed)
    assert blocks is not None and one_by_one is not None
    for attr in ("w13", "w2"):
        assert torch.equal(blocks[0][attr].view(torch.int16), one_by_one[0][attr].view(torch.int16))
    assert [t.data_ptr() for t, _ in blocks[1]] == [t.data_ptr() for t, _ in one_by_one[1]]
    # A whole layer covers both parameters; part of one leaves both to be compared.
    assert len(blocks[1]) == (0 if which == "every expert" else 2)
    # And the image is the update: expert 5's up rows of w13 hold the new tensor.
    inter = Experts.INTER
    assert torch.equal(blocks[0]["w13"][5, inter:].float(), new["experts.5.up_proj.weight"].float())


def test_what_is_not_distinct_equal_blocks_is_left_to_the_landing_copy() -> None:
    wmap = loaded(Experts(), expert_checkpoint(0))
    new = expert_checkpoint(1)
    image = wmap.target("w13").clone()
    covered = torch.zeros(image.shape, dtype=torch.bool)
    gate = "experts.2.gate_proj.weight"
    ld = wmap.entry(gate).landings[0]
    twice = [(gate, new[gate], ld), (gate, new[gate], ld)]  # two tensors in one region
    assert not kernel_copies._copy_blocks(wmap, image, covered, twice)
    other = [(gate, new[gate], ld), ("experts.2.down_proj.weight", new["experts.2.down_proj.weight"], ld)]
    assert not kernel_copies._copy_blocks(wmap, image, covered, other)  # not its own landing
    assert torch.equal(image.view(torch.int16), wmap.target("w13").view(torch.int16)) and not covered.any()
