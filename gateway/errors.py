"""The gateway's own error answers.

``error_response(exc)`` answers a ``contracts.errors.ApiError`` with its HTTP status and a body
that both the API's clients and OpenAI's read::

    {"code": "invalid_argument", "message": "...", "details": [],
     "error": {"message": "...", "type": "invalid_argument", "code": "invalid_argument"}}

``code`` is one of ``contracts.errors.HTTP_STATUS``'s. vLLM's own error answers are relayed as
vLLM wrote them, not through here.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from contracts.errors import ApiError


def error_response(exc: ApiError) -> JSONResponse:
    body = exc.body()
    body["error"] = {"message": exc.message, "type": exc.code, "code": exc.code}
    return JSONResponse(body, status_code=exc.http_status)
