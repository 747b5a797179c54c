"""The time the API stamps on what it writes (`createdAt`, `updatedAt`): `now()`, RFC 3339 in UTC."""

from __future__ import annotations

from datetime import UTC, datetime

from contracts.records import rfc3339


def now() -> str:
    return rfc3339(datetime.now(UTC))
