"""The gateway's side of its upstream requests (to vLLM replicas and to Dynamo's frontend).

``upstream_client(verify)``: connect 5 s, read 600 s, no overall timeout (a request queued
behind a paused replica waits); pooled connections expire after 4 s, before vLLM drops idle ones
(5 s), so a reused connection never looks like a replica failure. ``upstream_error(status,
content, content_type)``: an upstream 400 that names a message becomes our ``invalid_argument``
with that message; anything else passes through as the upstream wrote it.
"""

from __future__ import annotations

import json
import ssl

import httpx
from fastapi.responses import Response

from contracts.errors import InvalidArgument
from gateway import dynamo
from gateway.errors import error_response


def upstream_client(verify: ssl.SSLContext | bool = True) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=5, read=600, write=60, pool=60),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=4.0),
        verify=verify,
    )


def upstream_error(status: int, content: bytes, content_type: str | None) -> Response:
    """A replica's (or Dynamo's) error answer: a 400 in our shape with the engine's message
    (Dynamo's ``details`` spelled out), anything else as is."""
    if status == 400:
        try:
            data = json.loads(content)
            message = data["error"]["message"] if isinstance(data.get("error"), dict) else data["message"]
            if isinstance(data.get("details"), dict):
                message = dynamo.explain(str(message), data["details"])
        except (ValueError, KeyError, TypeError, AttributeError):
            message = None
        if isinstance(message, str) and message:
            return error_response(InvalidArgument(message))
    return Response(content, status_code=status, media_type=content_type)
