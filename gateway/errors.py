"""The gateway's own error answers.

Contract: ``error_response(exc)`` answers an ``contracts.errors.ApiError`` with its HTTP status and a
body that carries the API's shape and OpenAI's envelope at once, so both kinds of client read
it::

    {"code": "invalid_argument", "message": "...", "details": [],
     "error": {"message": "...", "type": "invalid_argument", "code": "invalid_argument"}}

``code`` is one of ``contracts.errors.HTTP_STATUS``'s codes (``invalid_argument`` 400,
``unauthenticated`` 401, ``permission_denied`` 403, ``not_found`` 404, ``payload_too_large``
413, ``unavailable`` 503,
``internal`` 500). vLLM's own error answers are relayed as vLLM wrote them, not through here.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from contracts.errors import ApiError


def error_response(exc: ApiError) -> JSONResponse:
    body = exc.body()
    body["error"] = {"message": exc.message, "type": exc.code, "code": exc.code}
    return JSONResponse(body, status_code=exc.http_status)
