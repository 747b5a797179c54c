"""`rollouts node`: a node agent (replica/node/); `rollouts nodes [NAME]`: what the registry knows."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

from common.settings import temporal_client
from contracts import names
from replica.node.activities import NodeIdentity
from replica.node.agent import run_node
from replica.node.capacity import capacity, check_advertised, check_name, is_loopback, resolve_address
from workers.commands import service_logging, settings_of


def main(args: argparse.Namespace) -> int:
    service_logging()
    settings = settings_of(args)
    name = check_name(args.name or socket.gethostname().split(".")[0])
    address = check_advertised(
        resolve_address(
            args.address or settings.host,
            "node address" + (" (--address)" if args.address else " (the stack's host: no --address given)"),
        )
    )
    gpus, slots = capacity(args.gpus, args.slots)
    bind = args.engine_bind or ("127.0.0.1" if is_loopback(address) else "0.0.0.0")
    resolve_address(bind, "engine bind address (--engine-bind)")
    node = NodeIdentity(name=name, address=address, zone=args.zone or settings.zone, engine_bind=bind, home=args.home)
    return asyncio.run(run_node(settings, node, gpus, slots))


async def _memo(settings) -> dict:
    client = await temporal_client(settings)
    desc = await client.get_workflow_handle(names.NODE_REGISTRY_ID).describe()
    return (await desc.memo()).get("nodes", {})


def list_nodes(args: argparse.Namespace) -> int:
    nodes = asyncio.run(_memo(settings_of(args)))
    if args.name:
        if args.name not in nodes:
            known = ", ".join(sorted(nodes)) or "none"
            raise SystemExit(f"rollouts nodes: no node named {args.name!r} (known: {known})")
        print(json.dumps(nodes[args.name], indent=2))
        return 0
    print(f"{'NODE':<16} {'ADDRESS':<16} {'ZONE':<12} {'STATE':<6} {'GPUS':>5} {'SLOTS':>5} {'SHM FREE':>10}  REPLICAS")
    for name, rec in sorted(nodes.items()):
        hb = rec["heartbeat"]
        placed = sorted(rec.get("placements", {}))
        print(
            f"{name:<16} {hb['address']:<16} {hb['zone']:<12} {'lost' if rec.get('lost') else 'up':<6} "
            f"{hb.get('gpus', 0):>5} {hb.get('slots', 0):>5} {hb.get('shmFreeBytes', 0) / 2**30:>8.1f}Gi  "
            f"{', '.join(placed) or '-'}"
        )
    return 0
