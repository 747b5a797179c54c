"""`rollouts replica ...`: one replica, its engine and agent (started by its node agent)."""

from __future__ import annotations

import argparse
import asyncio
import json

from replica.agent.process import run_replica
from workers.commands import service_logging, settings_of


def main(args: argparse.Namespace) -> int:
    service_logging()
    return asyncio.run(
        run_replica(
            settings_of(args),
            deployment_id=args.deployment,
            name=args.name,
            workflow_id=args.workflow_id,
            zone=args.zone,
            model_bucket=args.model_bucket,
            model_path=args.model_path,
            model_name=args.model_name,
            catch_up=args.catch_up,
            joining=args.joining,
            runtime_engine=args.engine,
            engine_config=json.loads(args.engine_config),
            node=args.node,
            node_address=args.node_address,
            engine_bind=args.engine_bind,
        )
    )
