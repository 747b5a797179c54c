"""Snapshot identity rules.

An identity names a snapshot under ``s3://BUCKET/PATH_PREFIX/IDENTITY/``; it is used verbatim as
one object-key segment, so it must be exactly one path segment: 1-128 characters, no ``/``, not
``.`` or ``..`` (nor containing ``..``, which some stores and proxies normalise), no NUL or other
control characters. ``initial`` is reserved for a deployment's base weights and cannot be
hot-loaded under that name.
"""

from __future__ import annotations

from snapshots.errors import IdentityError

IDENTITY_MAX_LEN = 128
#: The identity a deployment's base weights carry before any hot-load completed.
RESERVED_IDENTITY = "initial"


def validate_identity(identity: str, *, field: str = "identity") -> str:
    """Return ``identity`` unchanged if it is a valid snapshot identity.

    Args:
        field: The request field the value came from, named in the error
            (``previousSnapshotIdentity`` for example).

    Raises:
        IdentityError: the value breaks a rule; the message names ``field`` and the rule.
    """
    if not isinstance(identity, str):
        raise IdentityError(f"{field} must be a string, got {type(identity).__name__}")
    if not identity:
        raise IdentityError(f"{field} must be a non-empty string of 1-{IDENTITY_MAX_LEN} characters")
    if len(identity) > IDENTITY_MAX_LEN:
        raise IdentityError(
            f"{field} must be 1-{IDENTITY_MAX_LEN} characters: at most {IDENTITY_MAX_LEN} (got {len(identity)})"
        )
    if "/" in identity or "\\" in identity:
        raise IdentityError(f"{field} must be a single path segment (no '/'): {identity!r}")
    if identity in (".", "..") or ".." in identity:
        raise IdentityError(f"{field} must not contain '..': {identity!r}")
    if any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in identity):
        raise IdentityError(f"{field} must not contain NUL or control characters: {identity!r}")
    if identity == RESERVED_IDENTITY:
        raise IdentityError(f"{field} {RESERVED_IDENTITY!r} is reserved for the deployment's base weights")
    return identity


def identity_problem(identity: str, field: str = "identity") -> str | None:
    """Why ``identity`` is not a valid snapshot identity (naming ``field``), or None."""
    try:
        validate_identity(identity, field=field)
    except IdentityError as exc:
        return str(exc)
    return None


__all__ = ["IDENTITY_MAX_LEN", "RESERVED_IDENTITY", "identity_problem", "validate_identity"]
