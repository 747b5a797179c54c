"""What the dynamo stack's tests share (tests/dynamo/conftest.py makes the stack and deployment)."""

from __future__ import annotations

import asyncio

from replica.agent.dynamo import DynamoEngineProcess

REPLICAS = 2  # the deployment's replicas: two Dynamo workers
DYNAMO_PREFIX = "dynamo-hl"  # its hot-load path prefix in the bucket


def control(replica: dict, route: str) -> None:
    """Call a worker's control route (``leave`` / ``join`` ...) as its agent does; ``replica``: an
    entry of ``tests.helpers.replicas.engines``."""

    async def run() -> None:
        engine = DynamoEngineProcess.attach(replica["engineUrl"], secret=replica["engineSecret"])
        try:
            await engine.control(route)
        finally:
            await engine.aclose()

    asyncio.run(run())
