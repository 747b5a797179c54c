"""The rules that make a tensor-parallel engine's ranks one engine (contracts/engine_ranks.py,
snapshots/regions.py, the stage held until every rank proved, replica/engine/stage.py), without
an engine: a swap is all-or-nothing across ranks, and what the ranks serve is checked shard by
shard against the same regions of the checkpoint's tensors."""

from __future__ import annotations

import pytest
import torch

from contracts.engine_ranks import combine_map, combine_swap, swap_bytes
from replica.agent.process import cpu_binding
from replica.engine.stage import StageSlot, take
from replica.engine.tensors import adler32_hex
from snapshots.regions import ServedWeights, region_checksum
from tests.helpers.tiny_model import Tiny, new_values, weights


def test_a_swap_is_verified_only_when_every_rank_proved_its_shard():
    ok = {"verified": 2, "copy_s": 0.001, "verify_s": 0.002, "checksums": {"a": "1"}}
    assert combine_swap([ok]) == ok
    both = combine_swap([ok, {**ok, "copy_s": 0.004}])
    assert both == {"verified": 2, "ranks": 2, "copy_s": 0.004, "verify_s": 0.002, "checksums": {"a": "1"}}
    failed = combine_swap([ok, {"read_back_failed": ["b"], "rolled_back": True}])
    assert failed == {"read_back_failed": ["b"], "rolled_back": True, "ranks": 2}
    with pytest.raises(ValueError, match="different numbers of tensors"):
        combine_swap([ok, {**ok, "verified": 1}])
    # Each rank moved its own shard's bytes: the engine's are their sum.
    moved = {"pause_bytes": 10, "staged_bytes": 30, "changed_bytes": 4, "device_staged_bytes": 10}
    summed = combine_swap([{**ok, **moved}, {**ok, **moved, "pause_bytes": 12}])
    assert swap_bytes(summed) == {"pause_bytes": 22, "staged_bytes": 60, "changed_bytes": 8, "device_staged_bytes": 20}
    maps = combine_map(
        [
            {"tensors": 3, "held": 3, "refused": {}, "refused_count": 0, "build_s": 0.1},
            {"tensors": 3, "held": 2, "refused": {"x": "why"}, "refused_count": 1, "build_s": 0.2},
        ]
    )
    assert maps == {
        "tensors": 3,
        "held": 2,
        "refused": {"x": "why"},
        "refused_count": 1,
        "build_s": 0.2,
        "ranks": 2,
        "orphans": [],
    }


def test_a_tensor_every_rank_finds_elsewhere_is_an_orphan_for_every_rank_to_refuse():
    """Expert parallelism: each rank leaves the experts another rank owns "elsewhere"; one that
    every rank leaves is held by none, so the agent has every rank refuse it before any stage."""
    rank = {"tensors": 4, "held": 2, "refused": {}, "refused_count": 0, "build_s": 0.1}
    owned = combine_map([{**rank, "elsewhere": ["e2", "e3"]}, {**rank, "elsewhere": ["e0", "e1"]}])
    assert owned["orphans"] == []
    lost = combine_map([{**rank, "elsewhere": ["e1", "e2", "e3"]}, {**rank, "elsewhere": ["e0", "e1"]}])
    assert lost["orphans"] == ["e1"]
    # One rank that finds a tensor elsewhere holds it nowhere.
    assert combine_map([{**rank, "elsewhere": ["e1"]}])["orphans"] == ["e1"]


def test_a_rank_that_failed_makes_the_others_roll_back_their_proven_stage():
    """Two ranks' slots: rank 0 proves and holds, rank 1's read-back fails (rolled back there);
    the caller's discard then rolls rank 0 back too. With every rank proven, release commits."""
    ranks = [Tiny(), Tiny()]
    slots = [StageSlot(), StageSlot()]
    before = [weights(r) for r in ranks]
    tensors = new_values(11)
    expected = {n: adler32_hex(t) for n, t in tensors}
    for wmap, slot in zip(ranks, slots):
        # Each rank is a process of its own, with its own roll-back pool: here, explicit copies.
        backup = {n: wmap.held(n).clone() for n, _ in tensors}
        slot.put(take(wmap, "v1", tensors, backup, expected_adler32=expected))
    ranks[1].corrupt = "up.weight"
    results = [slot.swap_and_commit(wmap, "v1", hold=True) for wmap, slot in zip(ranks, slots)]
    assert combine_swap(results)["read_back_failed"] == ["up.weight"]
    assert weights(ranks[0]) == expected and weights(ranks[1]) == before[1]  # rank 0 holds the new weights...
    assert [slot.discard(wmap)["rolled_back"] for wmap, slot in zip(ranks, slots)] == [True, False]
    assert [weights(r) for r in ranks] == before  # ...until the discard: every rank on its weights

    for wmap, slot in zip(ranks, slots):
        slot.put(take(wmap, "v2", tensors, expected_adler32=expected))
        assert slot.swap_and_commit(wmap, "v2", hold=True)["verified"] == 2
    with pytest.raises(RuntimeError, match="swapped in: commit or discard it first"):
        slots[0].begin()  # a held stage blocks the next one until released
    assert [slot.release("v2") for slot in slots] == [{"released": "v2"}] * 2
    assert [weights(r) for r in ranks] == [expected, expected] and slots[0].stage is None


def test_served_shards_are_checked_against_the_same_regions_of_the_checkpoint():
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4).to(torch.bfloat16)
    rows = [((4, 4), (4, 1), 0), ((4, 4), (4, 1), 16)]  # a column-parallel split: rows 0-3, 4-7
    cols = [((8, 2), (4, 1), 0), ((8, 2), (4, 1), 2)]  # a row-parallel split: columns 0-1, 2-3
    answers = [
        {
            "checksums": {"norm": "aa"},
            "regions": {
                "w": [[*rows[r], region_checksum(full, rows[r])]],
                "o": [[*cols[r], region_checksum(full, cols[r])]],
            },
        }
        for r in (0, 1)
    ]
    served = ServedWeights.combine(answers)
    tensors = {"w": full, "o": full}
    assert served.differing(["w", "o", "norm"], {"norm": "aa"}, tensors.__getitem__) == []
    other = full.clone()
    other[6, 3] += 1  # rows 4-7 of w, columns 2-3 of o
    assert served.differing(["w", "o"], {}, {"w": other, "o": other}.__getitem__) == ["w", "o"]
    # A shard no rank reported: the tensor is not shown to be served whole.
    partial = ServedWeights.combine(answers[:1])
    assert partial.differing(["w"], {}, tensors.__getitem__) == ["w"]
    with pytest.raises(ValueError, match="norm: the engine's ranks hold different bytes"):
        ServedWeights.combine([{"checksums": {"norm": "aa"}}, {"checksums": {"norm": "bb"}}])


def test_each_rank_gets_its_share_of_the_cores():
    assert cpu_binding(2, 2) == "0|1"
    assert cpu_binding(2, 4) == "0-1|2-3"
    assert cpu_binding(4, 2) == "0|1|0|1"
