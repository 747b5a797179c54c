"""A local process that speaks Dynamo's request plane to a deployment's workers directly, as any
process on the machine that can read the discovery directory could: no gateway, no frontend, no
certificate. Run by tests/gateway/test_dynamo_stack.py in a process of its own (Dynamo's runtime
stays out of the test process):

    python -m tests.helpers.request_plane_caller DISCOVERY_DIR NAMESPACE [ANNOTATION ...]

sends one preprocessed request (token ids, 4 tokens) to every ``generate`` instance of
``NAMESPACE`` with the given annotations and prints one JSON line per instance:
``{"instance": id, "tokens": [...]}`` when it answered with tokens, ``{"instance": id, "error": text}``
when it did not.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

from common.dynamo_planes import plane_env

PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 4
WAIT_S = 30.0


async def call(namespace: str, annotations: list[str]) -> list[dict]:
    from dynamo.runtime import DistributedRuntime  # noqa: PLC0415 - only in this process

    runtime = DistributedRuntime(asyncio.get_running_loop(), "file", "tcp", event_plane="zmq")
    client = await runtime.endpoint(f"{namespace}.backend.generate").client()
    await asyncio.wait_for(client.wait_for_instances(), WAIT_S)
    results = []
    for instance in sorted(client.instance_ids()):
        request = {
            "token_ids": PROMPT,
            "stop_conditions": {"max_tokens": MAX_TOKENS, "ignore_eos": True},
            "sampling_options": {"temperature": 0.0},
            "output_options": {},
            "eos_token_ids": [],
            "annotations": annotations,
        }
        tokens: list[int] = []
        try:
            stream = await asyncio.wait_for(client.direct(request, instance), WAIT_S)
            async for out in stream:
                data = out.data() if hasattr(out, "data") else out
                tokens += (data or {}).get("token_ids") or []
            results.append({"instance": instance, "tokens": tokens})
        except Exception as exc:  # noqa: BLE001 - what the caller got is the result
            results.append({"instance": instance, "error": f"{type(exc).__name__}: {exc}", "tokens": tokens})
    runtime.shutdown()
    return results


def main() -> None:
    discovery, namespace, *annotations = sys.argv[1:]
    os.environ.update(plane_env("file", Path(discovery), {}))
    for result in asyncio.run(call(namespace, annotations)):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
