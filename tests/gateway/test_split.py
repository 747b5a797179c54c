"""The deterministic weighted split (``gateway/split.py``): exact proportions over every
``sum(weights)`` picks, spread out, stable under a membership change."""

from __future__ import annotations

import pytest

from gateway.split import WeightedSplit


def picks(split: WeightedSplit, members: list[tuple[str, int]], count: int, key: str = "k") -> list[str]:
    return [split.pick(key, members) for _ in range(count)]


def test_ninety_ten_is_exact_in_every_hundred_and_spread_out():
    seq = picks(WeightedSplit(), [("a", 90), ("b", 10)], 1000)
    for start in range(0, 1000, 100):
        window = seq[start : start + 100]
        assert window.count("a") == 90 and window.count("b") == 10
    assert "bb" not in "".join(seq)  # never two of the small share in a row
    assert seq[:10].count("b") == 1  # the first ten requests already hold one


def test_three_ways_and_a_sliding_window():
    members = [("a", 5), ("b", 3), ("c", 2)]
    seq = picks(WeightedSplit(), members, 200)
    for start in range(0, 200 - 10):  # any 10 consecutive picks, not only aligned ones, within one
        window = seq[start : start + 10]
        assert abs(window.count("a") - 5) <= 1 and abs(window.count("b") - 3) <= 1 and abs(window.count("c") - 2) <= 1
    assert [seq[i : i + 10].count(n) for i in range(0, 200, 10) for n in "abc"] == [5, 3, 2] * 20


def test_groups_are_independent_and_membership_changes():
    split = WeightedSplit()
    assert picks(split, [("a", 1)], 3, key="m1") == ["a"] * 3
    assert picks(split, [("x", 1), ("y", 1)], 4, key="m2") == ["x", "y", "x", "y"]  # ties: the earlier first
    # "a" leaves m1 and two others join: the group starts from their credits alone.
    seq = picks(split, [("b", 1), ("c", 3)], 8, key="m1")
    assert seq.count("c") == 6 and seq.count("b") == 2


@pytest.mark.parametrize("members", [[], [("a", 0)], [("a", 3), ("b", -1)]])
def test_bad_members_are_refused(members):
    with pytest.raises(ValueError):
        WeightedSplit().pick("k", members)
