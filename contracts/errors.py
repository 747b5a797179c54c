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
# A swap whose in-pause read-back found the engine's bytes differ from the snapshot's checksums:
# the engine was rolled back; the same snapshot would fail the same way, so it is not retried.
READ_BACK_FAILED = "ReadBackFailed"
# An error injected by a fault point (replica/faults.py), in tests of the walk's failure branches.
INJECTED_FAULT = "InjectedFault"
