"""The engine's one update lifecycle, stage -> swap -> commit | discard (replica/engine/stage.py),
as free functions on a small torch model with vLLM's ``load_weights`` interface and its
`WeightMap`: no vLLM, no engine process. The same functions run inside the engine
(tests/replica/test_engine.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from replica.engine.stage import StageSlot, take
from replica.engine.tensors import adler32_hex, check_expected, dtype_from_str, dtype_to_str
from tests.helpers.tiny_model import Tiny, new_values, weights


def test_a_committed_stage_is_served_and_proven_by_its_checksums() -> None:
    model, slot = Tiny(), StageSlot()
    tensors = new_values(1)
    expected = {n: adler32_hex(t) for n, t in tensors}
    before = weights(model)
    slot.begin()
    slot.put(take(model, "v1", tensors, expected_adler32=expected))
    assert weights(model) == before  # staged, not served
    slot.swap(model, "v1")
    assert slot.commit(model, "v1")["checksums"] == expected
    assert weights(model) == expected
    assert slot.stage is None


def test_a_read_back_that_differs_rolls_back_and_names_the_tensor() -> None:
    model, slot = Tiny(), StageSlot()
    before = weights(model)
    tensors = new_values(2)
    slot.put(take(model, "v1", tensors, expected_adler32={n: adler32_hex(t) for n, t in tensors}))
    model.corrupt = "down.weight"
    slot.swap(model, "v1")
    assert slot.commit(model, "v1") == {"read_back_failed": ["down.weight"], "rolled_back": True}
    assert weights(model) == before and slot.stage is None
    # Without expected checksums the read-back compares bit for bit with the bytes staged.
    slot.put(take(model, "v2", new_values(3)))
    model.corrupt = "down.weight"
    slot.swap(model, "v2")
    assert slot.commit(model, "v2")["read_back_failed"] == ["down.weight"]
    assert weights(model) == before


def test_swap_and_commit_in_one_call_proves_or_rolls_back() -> None:
    """The pause's usual path: the swap and its read-back in one call."""
    model, slot = Tiny(), StageSlot()
    tensors = new_values(6)
    expected = {n: adler32_hex(t) for n, t in tensors}
    slot.put(take(model, "v1", tensors, expected_adler32=expected))
    result = slot.swap_and_commit(model, "v1")
    assert result["verified"] == 2 and result["checksums"] == expected and "copy_s" in result
    assert weights(model) == expected and slot.stage is None
    tensors = new_values(7)
    slot.put(take(model, "v2", tensors, expected_adler32={n: adler32_hex(t) for n, t in tensors}))
    model.corrupt = "up.weight"
    result = slot.swap_and_commit(model, "v2", checksums=False)
    assert result["read_back_failed"] == ["up.weight"] and result["rolled_back"]
    assert weights(model) == expected and slot.stage is None
    # The pause's own call asks for the count only: the same proof, no checksum per tensor back.
    model.corrupt = None
    slot.put(take(model, "v2", tensors, expected_adler32={n: adler32_hex(t) for n, t in tensors}))
    result = slot.swap_and_commit(model, "v2", checksums=False)
    assert result["verified"] == 2 and "checksums" not in result and weights(model) != expected


def test_discard_rolls_a_swapped_stage_back_and_a_swapped_stage_blocks_the_next() -> None:
    model, slot = Tiny(), StageSlot()
    before = weights(model)
    slot.put(take(model, "v1", new_values(4)))
    with pytest.raises(RuntimeError, match="not yet swapped in"):
        slot.commit(model, "v1")
    slot.swap(model, "v1")
    assert weights(model) != before
    with pytest.raises(RuntimeError, match="swapped in: commit or discard it first"):
        slot.begin()
    with pytest.raises(RuntimeError, match="already swapped in"):
        slot.swap(model, "v1")
    assert slot.discard(model) == {"discarded": "v1", "rolled_back": True}
    assert weights(model) == before
    assert slot.discard(model) == {"discarded": None, "rolled_back": False}
    with pytest.raises(RuntimeError, match="nothing staged for 'v1'"):
        slot.swap(model, "v1")


def test_what_cannot_load_in_place_is_refused_at_staging() -> None:
    model = Tiny()
    up = new_values(5)[0][1]
    cases = {
        "shape": [("up.weight", torch.zeros(3, 3, dtype=torch.bfloat16))],
        "dtype": [("up.weight", up.view(torch.float16))],
        "name": [("side.weight", up)],
        "twice": [("up.weight", up), ("up.weight", up)],
    }
    for case, tensors in cases.items():
        with pytest.raises(ValueError, match="refusing to load"):
            take(model, case, tensors)
    with pytest.raises(ValueError, match="up.weight: adler32 .* != expected 00000000"):
        check_expected([("up.weight", up)], {"up.weight": "00000000"})


def test_a_tensor_refused_after_staging_is_refused_by_the_swap_and_nothing_changes() -> None:
    """The swap checks its tensors again only if the map refused one since the stage was taken
    (`WeightMap.refusals`): a stage taken before a refusal is refused whole, naming it, before
    anything is written (no write and roll-back)."""
    model, slot = Tiny(), StageSlot()
    before = weights(model)
    tensors = new_values(8)
    slot.put(take(model, "v1", tensors, expected_adler32={n: adler32_hex(t) for n, t in tensors}))
    model.refuse(["down.weight"], "held by no rank")
    written = []
    write = model.write
    model.write = lambda pairs, **kw: (written.append([n for n, _ in pairs]), write(pairs, **kw))[1]
    with pytest.raises(ValueError, match="down.weight: held by no rank"):
        slot.swap(model, "v1")
    assert written == [] and weights(model) == before


def test_the_collector_is_held_off_inside_the_swap_and_proof_and_back_on_after() -> None:
    model, slot = Tiny(), StageSlot()
    tensors = new_values(9)
    slot.put(take(model, "v1", tensors, expected_adler32={n: adler32_hex(t) for n, t in tensors}))
    seen: dict[str, list[bool]] = {"swap": [], "proof": []}
    write, unpacked = model.write, model.unpacked
    model.write = lambda pairs, **kw: (seen["swap"].append(gc.isenabled()), write(pairs, **kw))[1]
    model.unpacked = lambda *a, **kw: (seen["proof"].append(gc.isenabled()), unpacked(*a, **kw))[1]
    assert gc.isenabled()
    slot.swap(model, "v1")
    assert gc.isenabled()
    assert slot.commit(model, "v1")["verified"] == 2 and gc.isenabled()
    assert seen["swap"] and seen["proof"] and not any(seen["swap"] + seen["proof"]), seen
    gc.disable()  # a caller's own choice is left as it was
    try:
        slot.put(take(model, "v2", new_values(10)))
        slot.swap_and_commit(model, "v2")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_one_dtype_table() -> None:
    assert dtype_from_str("bf16") is dtype_from_str("torch.bfloat16") is torch.bfloat16
    assert dtype_to_str(torch.float8_e4m3fn) == "float8_e4m3fn"
    with pytest.raises(ValueError, match="unknown dtype"):
        dtype_from_str("complex32")
