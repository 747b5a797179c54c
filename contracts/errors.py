"""Every error code and failure type of rollouts, in one place.

**API errors** (what the REST API and the gateway answer): one class per code, answered as
`{"code", "message", "details"}` with its HTTP status. The codes and statuses are the ones
cwtrain maps (docs/wire.md): invalid_argument 400, unauthenticated 401, permission_denied 403,
not_found 404, already_exists 409, failed_precondition 412, unimplemented 501, unavailable 503,
internal 500; and payload_too_large 413 (a request body over the API's or the gateway's cap;
HTTP's own status for it, which cwtrain, like any HTTP client, does not retry).
`code_for_status` names the code of an HTTP status the web framework raised itself.

**Workflow errors**: an `ApplicationError` whose `type` is one of the API's codes
(`failed_precondition`, `invalid_argument`, `not_found`, `already_exists`, ...: `rejected`)
reaches the API through an Update failure and is answered with that code and message,
unchanged (`from_code`).

**Activity failure types** the control plane reads (`NON_RETRYABLE_SNAPSHOT`,
`READ_BACK_FAILED`, `INJECTED_FAULT`): the `type` of an activity's `ApplicationError`, which
decides whether the walk retries it.
"""

from __future__ import annotations

from typing import Any

from temporalio.exceptions import ApplicationError

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
        InvalidArgument,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        PayloadTooLarge,
        Unavailable,
        Unimplemented,
        Internal,
    )
}


def from_code(code: str, message: str) -> ApiError:
    return BY_CODE.get(code, Internal)(message)


def code_for_status(status: int) -> str:
    """The code of an HTTP error the web framework raised itself (no route, wrong method, body
    too large); any other 4xx is invalid_argument."""
    return {404: NotFound.code, 405: "method_not_allowed", 413: PayloadTooLarge.code}.get(status, InvalidArgument.code)


# -- workflow errors and activity failure types --------------------------------------------------

FAILED_PRECONDITION = FailedPrecondition.code
INVALID_ARGUMENT = InvalidArgument.code
NOT_FOUND = NotFound.code
ALREADY_EXISTS = AlreadyExists.code
UNAVAILABLE = Unavailable.code

# Activity errors that retrying cannot heal (checksum mismatch, missing file, bad format).
NON_RETRYABLE_SNAPSHOT = "SnapshotError"


# A swap whose in-pause read-back found the engine's bytes differ from the snapshot's checksums:
# the engine was rolled back; the same snapshot would fail the same way, so it is not retried.
READ_BACK_FAILED = "ReadBackFailed"
# An error injected by a fault point (replica/faults.py), in tests of the walk's failure branches.
INJECTED_FAULT = "InjectedFault"
# A replica that declined a peer's offer (nothing to pass on yet, or the offer does not match):
# an answer, not a failure; never retried.
PEER_OFFER_REFUSED = "PeerOfferRefused"


def rejected(code: str, message: str) -> ApplicationError:
    return ApplicationError(message, type=code, non_retryable=True)
