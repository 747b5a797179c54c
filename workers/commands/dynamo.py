"""`rollouts dynamo-frontend`: NVIDIA Dynamo's frontend for a cluster install (the embedded stack
starts its own: `rollouts up`). It replaces itself with ``python -m dynamo.frontend`` configured
from the settings (gateway/dynamo_frontend.py): HTTP on ``ROLLOUTS_HOST`` and ``--port`` (default
the settings' Dynamo port), Dynamo's discovery backend (``ROLLOUTS_DYNAMO_DISCOVERY``: ``file`` in
``ROLLOUTS_DYNAMO_DISCOVERY_DIR``, or ``kubernetes``), the router mode
(``ROLLOUTS_DYNAMO_ROUTER_MODE``), and ``--address``, where workers send their answers back, and mutual TLS with the
certificates in ``ROLLOUTS_DYNAMO_TLS_DIR`` when it holds them (common/dynamo_tls.py), and Dynamo's event plane
through ``ROLLOUTS_DYNAMO_EVENT_BROKER`` when set (else Dynamo's direct mode). It reads the home's
stack.json when there is one, else the environment alone, and needs no keys."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys

from common.dynamo_planes import discovery_problem
from common.settings import Settings
from gateway.dynamo_frontend import DynamoFrontend
from workers.commands import settings_of


def main(args: argparse.Namespace) -> int:
    # It needs no keys: the home's stack.json when there is one, else the environment alone (a
    # cluster install gives this pod no S3 or engine key).
    settings = settings_of(args) if (args.home / "stack.json").exists() else Settings.create(args.home).with_env()
    address = args.address or settings.host
    if ipaddress.ip_address(address).is_unspecified:
        print(
            f"rollouts dynamo-frontend: --address {address} is not one workers can reach: give this "
            "host's own address (on Kubernetes the pod's IP)",
            file=sys.stderr,
        )
        return 2
    frontend = DynamoFrontend(
        settings.dynamo_discovery_dir,
        log_path=os.devnull,
        host=settings.host,
        port=args.port or settings.ports["dynamo"],
        router_mode=settings.dynamo_router_mode,
        discovery_backend=settings.dynamo_discovery_backend,
        address=address,
        tls=settings.dynamo_tls(),
        event_broker=settings.dynamo_event_broker,
    )
    if problem := discovery_problem(frontend.discovery_backend, frontend.discovery_dir):
        print(f"rollouts dynamo-frontend: {problem}", file=sys.stderr)
        return 2
    command = frontend.command()
    sys.stdout.flush()
    os.execve(command[0], command, frontend.environment())
    return 0  # not reached
