"""The gateway's side of its upstream requests (to vLLM replicas and to Dynamo's frontend).

- ``upstream_client(verify)``: the ``httpx.AsyncClient`` for them: connect 5 s, read 600 s, write
  and pool 60 s, and no overall timeout (a request queued behind a paused replica waits: docs/design.md
  "The gateway"); at most 1024 connections, 256 kept alive, each for 4 s (pooled
  connections expire before vLLM's server drops idle ones, 5 s by default: reusing one it just
  closed would look like a replica failure). ``verify`` as httpx takes it (the Dynamo client's
  is the stack's mutual-TLS context, ``common/dynamo_tls.py``).
- ``upstream_error(status, content, content_type)``: a replica's (or Dynamo's) error answer
  for the client: a 400 whose body names a message (OpenAI's ``error.message`` or a top-level
  ``message``; Dynamo's ``details`` spelled out by ``gateway.dynamo.explain``) becomes our
  ``invalid_argument`` with that message (``gateway/errors.py``); anything else passes through
  as the upstream wrote it (status, body, content type).
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
