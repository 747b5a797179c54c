"""Run inside a host (``python -m tests.multihost.http_probe ...``): one HTTP request from THIS
host, so a test sees what another host reaches. It imports no torch (a probe starts in a fraction
of a second; the engine's served weights: tests/multihost/engine_probe.py).

    METHOD URL SECRET [BODY] [--tls=DIR]
        -> JSON [status, body text] (status 0: no answer, the text says why); the secret as
           vLLM's header; BODY: JSON sent as is; with --tls, the stack's Dynamo client
           certificate from DIR, for its frontend
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from common import dynamo_tls
from common.settings import ENGINE_SECRET_HEADER


def main(argv: list[str]) -> int:
    tls = next((a.removeprefix("--tls=") for a in argv if a.startswith("--tls=")), None)
    argv = [a for a in argv if not a.startswith("--tls=")]
    method, url, secret = argv[:3]
    body = json.loads(argv[3]) if len(argv) > 3 else None
    verify = dynamo_tls.load(Path(tls)).ssl_context() if tls else True
    try:
        r = httpx.request(
            method, url, headers={ENGINE_SECRET_HEADER: secret}, timeout=30, trust_env=False, json=body, verify=verify
        )
        print(json.dumps([r.status_code, r.text[:4000]]))
    except httpx.HTTPError as exc:
        print(json.dumps([0, f"{type(exc).__name__}: {exc}"]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
