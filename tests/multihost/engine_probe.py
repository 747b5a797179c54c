"""Run inside a host (``python -m tests.multihost.engine_probe ...``): what an engine on THIS host
serves, read over its loopback (engine control answers only its own host). ``KIND``: ``dynamo``
(a Dynamo worker, driven through its system server's control routes) or ``vllm``.

    checksums PORT SECRET KIND    -> JSON {tensor: adler32} of the served weights
    label PORT SECRET KIND        -> JSON the engine's weight-version label
    call METHOD URL SECRET [BODY] [--tls=DIR]
                                  -> JSON [status, body text] of one request (any host; the secret
                                     as vLLM's header; BODY: JSON sent as is; with --tls, the
                                     stack's Dynamo client certificate from DIR, for its frontend)
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import httpx

from common import dynamo_tls
from common.settings import ENGINE_SECRET_HEADER
from replica.agent.dynamo import DynamoEngineProcess
from replica.agent.engine_process import EngineProcess


async def _read(port: str, secret: str, what: str, kind: str) -> object:
    cls = DynamoEngineProcess if kind == "dynamo" else EngineProcess
    engine = cls.attach(f"http://127.0.0.1:{port}", secret=secret)
    try:
        return await (engine.checksums() if what == "checksums" else engine.weight_version())
    finally:
        await engine.aclose()


def main(argv: list[str]) -> int:
    what = argv[0]
    if what in ("checksums", "label"):
        print(json.dumps(asyncio.run(_read(argv[1], argv[2], what, argv[3]))))
        return 0
    if what == "call":
        tls = next((a.removeprefix("--tls=") for a in argv if a.startswith("--tls=")), None)
        argv = [a for a in argv if not a.startswith("--tls=")]
        method, url, secret = argv[1:4]
        body = json.loads(argv[4]) if len(argv) > 4 else None
        verify = dynamo_tls.load(Path(tls)).ssl_context() if tls else True
        try:
            r = httpx.request(method, url, headers={ENGINE_SECRET_HEADER: secret}, timeout=30, trust_env=False,
                              json=body, verify=verify)
            print(json.dumps([r.status_code, r.text[:4000]]))
        except httpx.HTTPError as exc:
            print(json.dumps([0, f"{type(exc).__name__}: {exc}"]))
        return 0
    raise SystemExit(f"unknown probe {what!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
