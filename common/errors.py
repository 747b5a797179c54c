"""API errors: one class per code, answered as `{"code", "message", "details"}` with its HTTP status.

The codes and statuses are the ones cwtrain maps (docs/wire.md): invalid_argument 400,
unauthenticated 401, permission_denied 403, not_found 404, already_exists 409,
failed_precondition 412, unimplemented 501, unavailable 503, internal 500; and
payload_too_large 413 (a request body over the API's or the gateway's cap; HTTP's own status for
it, which cwtrain, like any HTTP client, does not retry).
"""

from __future__ import annotations

from typing import Any

HTTP_STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "already_exists": 409,
    "failed_precondition": 412,
    "payload_too_large": 413,
    "internal": 500,
    "unimplemented": 501,
    "unavailable": 503,
}


class ApiError(Exception):
    code = "internal"

    def __init__(self, message: str, details: list[Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or []

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def body(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidArgument(ApiError):
    code = "invalid_argument"


class Unauthenticated(ApiError):
    code = "unauthenticated"


class PermissionDenied(ApiError):
    code = "permission_denied"


class NotFound(ApiError):
    code = "not_found"


class AlreadyExists(ApiError):
    code = "already_exists"


class FailedPrecondition(ApiError):
    code = "failed_precondition"


class PayloadTooLarge(ApiError):
    code = "payload_too_large"


class Unavailable(ApiError):
    code = "unavailable"


class Unimplemented(ApiError):
    code = "unimplemented"


class Internal(ApiError):
    code = "internal"


BY_CODE: dict[str, type[ApiError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument, Unauthenticated, PermissionDenied, NotFound, AlreadyExists,
        FailedPrecondition, PayloadTooLarge, Unavailable, Unimplemented, Internal,
    )
}


def from_code(code: str, message: str) -> ApiError:
    return BY_CODE.get(code, Internal)(message)
