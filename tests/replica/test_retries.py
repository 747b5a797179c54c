"""replica/agent/retries.py: which S3 errors a replica's start tries again (the server's 5xx and
throttling, connection and read errors) and which it does not (no such key, access denied, any
other error), the backoff in between, each retry reported before its wait, and the last error
raised when the attempts run out."""

from __future__ import annotations

import asyncio

import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, ReadTimeoutError

from replica.agent.retries import is_transient, retrying


def _client_error(code: str, status: int) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def test_which_s3_errors_may_pass():
    assert is_transient(_client_error("InternalError", 500))
    assert is_transient(_client_error("SlowDown", 503))
    assert is_transient(_client_error("Whatever", 502))
    assert is_transient(_client_error("TooManyRequests", 429))
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(ReadTimeoutError(endpoint_url="http://127.0.0.1:1"))
    assert not is_transient(_client_error("NoSuchKey", 404))
    assert not is_transient(_client_error("AccessDenied", 403))
    assert not is_transient(ValueError("bad checkpoint"))


def test_transient_errors_are_tried_again_with_backoff_and_reported():
    errors = [_client_error("InternalError", 500), EndpointConnectionError(endpoint_url="http://x")]
    reported: list[tuple[int, float, str]] = []

    async def attempt() -> str:
        if errors:
            raise errors.pop(0)
        return "model"

    async def on_retry(n: int, delay: float, exc: BaseException) -> None:
        reported.append((n, delay, type(exc).__name__))

    assert asyncio.run(retrying(attempt, on_retry, delays=(0.01, 0.02, 0.04))) == "model"
    assert reported == [(1, 0.01, "ClientError"), (2, 0.02, "EndpointConnectionError")]


def test_a_lasting_or_permanent_error_is_raised():
    calls = []

    async def lasting() -> None:
        calls.append(1)
        raise _client_error("InternalError", 500)

    async def on_retry(*_: object) -> None:
        pass

    with pytest.raises(ClientError, match="InternalError"):
        asyncio.run(retrying(lasting, on_retry, delays=(0.0, 0.0)))
    assert len(calls) == 3  # the first attempt and one per delay

    async def missing() -> None:
        calls.append(1)
        raise _client_error("NoSuchKey", 404)

    calls.clear()
    with pytest.raises(ClientError, match="NoSuchKey"):
        asyncio.run(retrying(missing, on_retry, delays=(0.0, 0.0)))
    assert len(calls) == 1
