"""Splitting requests among deployments by ``traffic.weight``, deterministically.

Contract: ``WeightedSplit.pick(key, members)`` takes ``members`` as ``(name, weight)`` pairs with
positive weights (the deployments that share a model name and may take traffic, in a fixed
order) and returns one name. It is smooth weighted round-robin (nginx's scheme): each pick adds
every member's weight to its credit, takes the member with the most credit (ties: the earlier
in ``members``) and charges it the sum of the weights. While a group (``key``) keeps the same
members, every run of ``sum(weights)`` consecutive picks takes each member exactly ``weight``
times, spread out (90/10: exactly 90 of every 100, never two picks of the 10 in a row). A member
that leaves the group loses its credit; one that joins starts from none. No randomness and no
clock: the same sequence of calls gives the same picks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class WeightedSplit:
    def __init__(self) -> None:
        self._credit: dict[Hashable, dict[str, int]] = {}

    def pick(self, key: Hashable, members: Sequence[tuple[str, int]]) -> str:
        if not members:
            raise ValueError("no member to pick from")
        if any(weight <= 0 for _, weight in members):
            raise ValueError(f"weights must be positive: {list(members)}")
        credit = self._credit.setdefault(key, {})
        names = {name for name, _ in members}
        for gone in [name for name in credit if name not in names]:
            del credit[gone]
        for name, weight in members:
            credit[name] = credit.get(name, 0) + weight
        chosen = max(members, key=lambda m: credit[m[0]])[0]  # max keeps the first of equals
        credit[chosen] -= sum(weight for _, weight in members)
        return chosen
