"""Placement (control/placement.py), pure: which node runs each replica of a placement request.

Replicas spread across the live nodes of the deployment's zone; a GPU replica takes the lowest
free distinct devices of one node; placements already held are kept and count as used; a
request that does not fit places none and says, node by node, what is missing.
"""

from __future__ import annotations

import pytest

from contracts.nodes import NodeHeartbeat, NodeRecord, placement_key
from contracts.records import Placement
from control.placement import PlacementError, place

DEP = "deployments/org-a/dep-1"
OTHER = "deployments/org-a/dep-2"
SEEN = "2026-01-01T00:00:00.000000Z"


def node(
    name: str,
    *,
    gpus: int = 0,
    slots: int = 0,
    zone: str = "Z1",
    lost: bool = False,
    placements: dict[str, Placement] | None = None,
    max_replicas: int = 0,
) -> NodeRecord:
    hb = NodeHeartbeat(
        name=name, address=f"10.0.0.{len(name)}", zone=zone, gpus=gpus, slots=slots, max_replicas=max_replicas
    )
    return NodeRecord(heartbeat=hb, last_seen=SEEN, lost=lost, placements=placements or {})


def fleet(*records: NodeRecord) -> dict[str, NodeRecord]:
    return {r.heartbeat.name: r for r in records}


def snapshot(nodes: dict[str, NodeRecord]) -> dict:
    return {n: r.model_dump() for n, r in nodes.items()}


def per_node(result: dict[str, Placement]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for replica, p in sorted(result.items()):
        out.setdefault(p.node, []).append(replica)
    return out


def test_three_replicas_on_three_nodes_take_one_each() -> None:
    nodes = fleet(node("a", slots=2), node("b", slots=2), node("c", slots=2))
    result = place(nodes, DEP, ["r0", "r1", "r2"], 0, "")
    assert sorted(p.node for p in result.values()) == ["a", "b", "c"]
    assert all(p.devices == [] for p in result.values())  # CPU slots
    assert result["r0"].address == nodes[result["r0"].node].heartbeat.address


def test_three_replicas_on_two_nodes_of_two_slots_split_two_and_one() -> None:
    nodes = fleet(node("a", slots=2), node("b", slots=2))
    result = place(nodes, DEP, ["r0", "r1", "r2"], 0, "")
    assert sorted(len(v) for v in per_node(result).values()) == [1, 2]
    # Deterministic: the same request places the same way.
    assert place(nodes, DEP, ["r0", "r1", "r2"], 0, "") == result


def test_only_nodes_of_the_deployments_zone_are_candidates() -> None:
    nodes = fleet(node("a", slots=4, zone="Z1"), node("b", slots=4, zone="Z2"), node("c", slots=4, zone="Z2"))
    result = place(nodes, DEP, ["r0", "r1", "r2"], 0, "Z2")
    assert set(per_node(result)) == {"b", "c"}
    # No zone: every live node is a candidate.
    assert set(per_node(place(nodes, DEP, ["r0", "r1", "r2"], 0, ""))) == {"a", "b", "c"}
    with pytest.raises(PlacementError) as err:
        place(nodes, DEP, ["r0"], 0, "Z3")
    msg = str(err.value)
    assert "in zone Z3" in msg and "a: zone Z1" in msg and "b: zone Z2" in msg and "c: zone Z2" in msg, msg


def test_gpu_replicas_take_distinct_lowest_free_devices() -> None:
    nodes = fleet(node("g", gpus=4))
    result = place(nodes, DEP, ["r0", "r1"], 2, "")
    assert sorted(p.devices for p in result.values()) == [[0, 1], [2, 3]]
    assert {p.node for p in result.values()} == {"g"}
    # Devices another replica holds are skipped; the lowest free ones go first.
    busy = fleet(
        node("g", gpus=4, placements={placement_key(OTHER, "x"): Placement(node="g", address="-", devices=[1])})
    )
    result = place(busy, DEP, ["r0", "r1"], 1, "")
    assert sorted(p.devices for p in result.values()) == [[0], [2]]


def test_gpu_replicas_spread_across_gpu_nodes() -> None:
    nodes = fleet(node("g1", gpus=2), node("g2", gpus=2))
    result = place(nodes, DEP, ["r0", "r1"], 2, "")
    assert {p.node for p in result.values()} == {"g1", "g2"}
    assert all(p.devices == [0, 1] for p in result.values())


def test_placements_already_held_are_kept_and_count_as_used() -> None:
    held = Placement(node="b", address="10.0.0.1", devices=[])
    nodes = fleet(
        node("a", slots=1, placements={placement_key(OTHER, "x"): Placement(node="a", address="-")}),
        node("b", slots=2, placements={placement_key(DEP, "r0"): held}),
    )
    before = snapshot(nodes)
    # Asked again (a retry): the same placement, nothing new taken.
    assert place(nodes, DEP, ["r0"], 0, "") == {"r0": held}
    # r1 is new: a's only slot is taken by another deployment, so it goes to b beside r0.
    result = place(nodes, DEP, ["r0", "r1"], 0, "")
    assert result["r0"] == held and result["r1"].node == "b"
    # b is now full in the eyes of the next request (the registry records what `place` returns).
    nodes["b"].placements[placement_key(DEP, "r1")] = result["r1"]
    with pytest.raises(PlacementError, match=r"a: 0/0 GPU\(s\), 1/1 slot\(s\) used; b: 0/0 GPU\(s\), 2/2 slot"):
        place(nodes, DEP, ["r2"], 0, "")
    nodes["b"].placements.pop(placement_key(DEP, "r1"))
    assert snapshot(nodes) == before  # `place` itself records nothing


def test_lost_nodes_are_skipped() -> None:
    nodes = fleet(node("a", slots=4, lost=True), node("b", slots=4))
    result = place(nodes, DEP, ["r0", "r1"], 0, "")
    assert {p.node for p in result.values()} == {"b"}
    # A placement held on a lost node is not kept: the replica is placed again on a live one.
    nodes["a"].placements[placement_key(DEP, "r0")] = Placement(node="a", address="-")
    assert place(nodes, DEP, ["r0"], 0, "")["r0"].node == "b"


def test_not_enough_capacity_names_every_nodes_state_and_places_nothing() -> None:
    nodes = fleet(
        node("a", slots=1),
        node("b", slots=1, placements={placement_key(OTHER, "x"): Placement(node="b", address="-")}),
        node("c", slots=1),
        node("d", slots=8, lost=True),
        node("e", slots=8, zone="Z2"),
    )
    before = snapshot(nodes)
    with pytest.raises(PlacementError) as err:
        place(nodes, DEP, ["r0", "r1", "r2"], 0, "Z1")
    msg = str(err.value)
    assert "not enough capacity in zone Z1" in msg and "1 CPU slot" in msg, msg
    assert "a: 0/0 GPU(s), 0/1 slot(s) used" in msg, msg  # as before the request: nothing taken
    assert "b: 0/0 GPU(s), 1/1 slot(s) used" in msg, msg
    assert "c: 0/0 GPU(s), 0/1 slot(s) used" in msg, msg
    assert f"d: lost (no heartbeat since {SEEN})" in msg, msg
    assert "e: zone Z2" in msg, msg
    assert snapshot(nodes) == before
    # Two fit (a and c), three were asked: all or nothing, so the two that fit were not placed.
    assert len(place(nodes, DEP, ["r0", "r1"], 0, "Z1")) == 2


def test_not_enough_gpus_names_what_each_replica_needs() -> None:
    nodes = fleet(node("g1", gpus=4), node("g2", gpus=2))
    with pytest.raises(PlacementError) as err:
        place(nodes, DEP, ["r0", "r1", "r2", "r3"], 2, "")  # 2 + 1 fit
    msg = str(err.value)
    assert "each need 2 GPU(s)" in msg and "g1: 0/4 GPU(s)" in msg and "g2: 0/2 GPU(s)" in msg, msg
    assert len(place(nodes, DEP, ["r0", "r1", "r2"], 2, "")) == 3


def test_more_gpus_than_any_node_has_names_the_biggest_node() -> None:
    nodes = fleet(node("small", gpus=2), node("big", gpus=4), node("huge", gpus=16, lost=True))
    with pytest.raises(PlacementError) as err:
        place(nodes, DEP, ["r0"], 8, "")
    msg = str(err.value)
    assert "8 GPU(s)" in msg and "resources.gpuCount" in msg and "has is 4 (big)" in msg, msg


def test_no_node_at_all_says_no_node_agent_registered() -> None:
    with pytest.raises(PlacementError, match="no node agent has registered") as err:
        place({}, DEP, ["r0"], 0, "")
    assert "rollouts node" in str(err.value)
    with pytest.raises(PlacementError, match="no node agent has registered"):
        place({}, DEP, ["r0"], 1, "")


def test_negative_gpus_is_refused() -> None:
    with pytest.raises(PlacementError, match=r"resources.gpuCount must be >= 0, got -1"):
        place(fleet(node("a", slots=1)), DEP, ["r0"], -1, "")


def test_a_node_with_max_replicas_takes_no_more_whatever_its_capacity() -> None:
    # A Kubernetes node-agent pod under Dynamo's pod-keyed discovery: one replica per pod.
    nodes = fleet(node("pod-a", gpus=8, max_replicas=1), node("pod-b", gpus=8, max_replicas=1))
    result = place(nodes, DEP, ["r1", "r2"], 1, "Z1")
    assert per_node(result) == {"pod-a": ["r1"], "pod-b": ["r2"]}
    held = fleet(
        node(
            "pod-a",
            slots=4,
            max_replicas=1,
            placements={placement_key(OTHER, "x"): Placement(node="pod-a", address="a")},
        ),
        node("pod-b", slots=4, max_replicas=1),
    )
    assert per_node(place(held, DEP, ["r1"], 0, "Z1")) == {"pod-b": ["r1"]}
    before = snapshot(held)
    with pytest.raises(PlacementError) as err:
        place(held, DEP, ["r1", "r2"], 0, "Z1")
    assert "pod-a: 0/0 GPU(s), 1/4 slot(s) used, 1/1 replica(s) at most" in str(err.value)
    assert snapshot(held) == before
