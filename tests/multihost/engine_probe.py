"""Run inside a host (``python -m tests.multihost.engine_probe PORT SECRET KIND``): what an
engine on THIS host serves, read over its loopback (engine control answers only its own host),
as JSON ``[{tensor: adler32}, weight-version label]``. ``KIND``: ``dynamo`` (a Dynamo worker,
driven through its system server's control routes) or ``vllm``. One request from a host:
tests/multihost/http_probe.py.
"""

from __future__ import annotations

import asyncio
import json
import sys

from replica.agent.dynamo import DynamoEngineProcess
from replica.agent.engine_process import EngineProcess


async def _served(port: str, secret: str, kind: str) -> tuple[dict[str, str], str | None]:
    cls = DynamoEngineProcess if kind == "dynamo" else EngineProcess
    engine = cls.attach(f"http://127.0.0.1:{port}", secret=secret)
    try:
        return await engine.checksums(), await engine.weight_version()
    finally:
        await engine.aclose()


def main(argv: list[str]) -> int:
    port, secret, kind = argv
    print(json.dumps(asyncio.run(_served(port, secret, kind))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
