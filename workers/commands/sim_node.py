"""`rollouts sim-node`: a SIMULATED node agent running many simulated replicas in one process
(replica/simulated/; a stand-in for scale runs such as bench/scale.py, never for serving)."""

from __future__ import annotations

import argparse
import asyncio
import signal

from common.settings import Settings, temporal_client
from replica.simulated.node import SimulatedNode
from replica.simulated.replica import Behaviour
from workers.commands import service_logging, settings_of


async def _run(settings: Settings, args: argparse.Namespace) -> int:
    client = await temporal_client(settings)
    behaviour = Behaviour(
        state_bytes=args.state_bytes,
        transfer_ms=args.transfer_ms,
        pause_ms=args.pause_ms,
        faults_home=settings.home_path,
    )
    node = SimulatedNode(
        client,
        name=args.name,
        address=settings.host,
        zone=args.zone or settings.zone,
        slots=args.slots,
        gpus=args.gpus,
        behaviour=behaviour,
        s3=settings.s3_client(),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await node.run(stop)
    return 0


def main(args: argparse.Namespace) -> int:
    if args.slots <= 0 and args.gpus <= 0:
        raise SystemExit("rollouts sim-node: give --slots or --gpus (how many simulated replicas it takes)")
    service_logging()
    return asyncio.run(_run(settings_of(args), args))
