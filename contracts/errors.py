"""Errors the workflows raise, typed by the API error code they map to.

An `ApplicationError` whose `type` is one of the API's codes (`failed_precondition`,
`invalid_argument`, `not_found`, `already_exists`, ...) reaches the API through an Update failure
and is answered with that code and message, unchanged.
"""

from temporalio.exceptions import ApplicationError

FAILED_PRECONDITION = "failed_precondition"
INVALID_ARGUMENT = "invalid_argument"
NOT_FOUND = "not_found"
ALREADY_EXISTS = "already_exists"
UNAVAILABLE = "unavailable"

# Activity errors that retrying cannot heal (checksum mismatch, missing file, bad format).
NON_RETRYABLE_SNAPSHOT = "SnapshotError"


def rejected(code: str, message: str) -> ApplicationError:
    return ApplicationError(message, type=code, non_retryable=True)
