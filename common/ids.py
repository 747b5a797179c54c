"""Client-chosen resource ids (organizations, deployments, gateways, hot-loads)."""

from __future__ import annotations

import re

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def resource_id_problem(value: str, field: str) -> str | None:
    """Client-chosen ids (deployments, gateways, hot-loads): one URL path segment, 1-128 chars."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        return f"{field} must be 1-128 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
    return None
