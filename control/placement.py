"""Placement: which node runs each replica (pure; the node registry, control/nodes.py, calls it).

A replica with `gpus` > 0 takes that many distinct devices of one node (lowest free first), one
without takes a CPU slot, within each node's `max_replicas`; candidates are the live nodes of
the deployment's zone (all of them when it is empty); replicas spread (fewest of the deployment,
then most free capacity, then name), so placement is deterministic. `place` is all or nothing:
a placement for every replica, or `PlacementError` saying per node what is missing.
"""

from __future__ import annotations

from contracts.nodes import NodeRecord, placement_key
from contracts.records import Placement


class PlacementError(ValueError):
    """Not enough capacity (or no node at all) for a placement request; the message says what."""


def _used(record: NodeRecord) -> tuple[set[int], int]:
    devices: set[int] = set()
    slots = 0
    for p in record.placements.values():
        if p.devices:
            devices.update(p.devices)
        else:
            slots += 1
    return devices, slots


def describe_nodes(nodes: dict[str, NodeRecord], zone: str) -> str:
    """One phrase per node: what it has, what is used, or why it cannot take replicas."""
    if not nodes:
        return "no node agent has registered (start `rollouts node` on the hosts)"
    parts = []
    for name in sorted(nodes):
        rec = nodes[name]
        hb = rec.heartbeat
        devices, slots = _used(rec)
        if rec.lost:
            parts.append(f"{name}: lost (no heartbeat since {rec.last_seen})")
        elif zone and hb.zone != zone:
            parts.append(f"{name}: zone {hb.zone}")
        else:
            cap = f", {len(rec.placements)}/{hb.max_replicas} replica(s) at most" if hb.max_replicas else ""
            parts.append(f"{name}: {len(devices)}/{hb.gpus} GPU(s), {slots}/{hb.slots} slot(s) used{cap}")
    return "; ".join(parts)


def place(
    nodes: dict[str, NodeRecord], deployment_workflow_id: str, replicas: list[str], gpus: int, zone: str
) -> dict[str, Placement]:
    """A placement for each of `replicas` (those already placed on a live node keep theirs)."""
    if gpus < 0:
        raise PlacementError(f"resources.gpuCount must be >= 0, got {gpus}")
    live = {n: r for n, r in nodes.items() if not r.lost and (not zone or r.heartbeat.zone == zone)}
    result: dict[str, Placement] = {}
    # What each candidate has free, updated as this request takes capacity.
    free_devices: dict[str, list[int]] = {}
    free_slots: dict[str, int] = {}
    # Replicas a node may still take under its max_replicas (None: no such limit).
    free_count: dict[str, int | None] = {}
    mine: dict[str, int] = {}
    for name, rec in live.items():
        used, slots = _used(rec)
        free_devices[name] = [d for d in range(rec.heartbeat.gpus) if d not in used]
        free_slots[name] = rec.heartbeat.slots - slots
        free_count[name] = rec.heartbeat.max_replicas - len(rec.placements) if rec.heartbeat.max_replicas else None
        mine[name] = sum(1 for k in rec.placements if k.startswith(deployment_workflow_id + "/"))
    for replica in replicas:
        key = placement_key(deployment_workflow_id, replica)
        held = next((rec.placements[key] for n, rec in live.items() if key in rec.placements), None)
        if held is not None:
            result[replica] = held
    held_names = set(result)
    if gpus and live and gpus > max(r.heartbeat.gpus for r in live.values()):
        most = max(live.values(), key=lambda r: r.heartbeat.gpus)
        raise PlacementError(
            f"each replica asks for {gpus} GPU(s) (resources.gpuCount) but the most any live node"
            f"{' in zone ' + zone if zone else ''} has is {most.heartbeat.gpus} ({most.heartbeat.name})"
        )
    for replica in replicas:
        if replica in result:
            continue
        if gpus:
            fits = [n for n in live if len(free_devices[n]) >= gpus]
            room = {n: len(free_devices[n]) // gpus for n in fits}
        else:
            fits = [n for n in live if free_slots[n] >= 1]
            room = {n: free_slots[n] for n in fits}
        fits = [n for n in fits if (left := free_count[n]) is None or left >= 1]
        room = {n: room[n] if (left := free_count[n]) is None else min(room[n], left) for n in fits}
        if not fits:
            need = f"{gpus} GPU(s)" if gpus else "1 CPU slot"
            asked = len([r for r in replicas if r not in held_names])
            missing = len([r for r in replicas if r not in result])
            raise PlacementError(
                f"not enough capacity{' in zone ' + zone if zone else ''}: {asked} replica(s) "
                f"each need {need}, {missing} of them do not fit (none was placed); nodes: "
                f"{describe_nodes(nodes, zone)}"
            )
        node = min(fits, key=lambda n: (mine[n], -room[n], n))
        if gpus:
            devices, free_devices[node] = free_devices[node][:gpus], free_devices[node][gpus:]
        else:
            devices = []
            free_slots[node] -= 1
        mine[node] += 1
        if (left := free_count[node]) is not None:
            free_count[node] = left - 1
        result[replica] = Placement(node=node, address=live[node].heartbeat.address, devices=devices)
    return result
