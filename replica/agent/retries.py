"""A replica's start reads its model from the bucket: an S3 error that may pass (the server's
5xx or throttling, a connection that failed or broke, a read that timed out) is tried again
after a backoff (`DELAYS_S`, about a minute in all), each retry reported first
(`on_retry(attempt, delay_s, exc)`: the agent tells its deployment, whose condition says why it
waits: control/deployment.py `replica_retrying`); any other error (no such key, access denied)
and the last attempt's fail at once. botocore's own retries run inside each attempt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from botocore.exceptions import ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

T = TypeVar("T")
# Waits before each retry, seconds.
DELAYS_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
# S3 error codes of a server that may answer the same request later.
TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "SlowDown",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
    }
)


def is_transient(exc: BaseException) -> bool:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {}) or {}
        status = int((exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode") or 0)
        return error.get("Code") in TRANSIENT_CODES or status >= 500 or status == 429
    return isinstance(exc, BotoConnectionError | HTTPClientError)


async def retrying(
    attempt: Callable[[], Awaitable[T]],
    on_retry: Callable[[int, float, BaseException], Awaitable[Any]],
    delays: tuple[float, ...] = DELAYS_S,
) -> T:
    """``await attempt()``, again after each delay while it raises a transient S3 error."""
    for n, delay in enumerate((*delays, None), start=1):
        try:
            return await attempt()
        except Exception as exc:
            if delay is None or not is_transient(exc):
                raise
            await on_retry(n, delay, exc)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
