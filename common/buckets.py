"""Where a deployment may read: bucket names, object-key paths, and each organization's grants.

`model.bucket`/`model.path` and `hotLoad.bucket`/`hotLoad.pathPrefix` follow one set of rules:
a bucket follows S3's bucket-name rules; a path is a relative object-key prefix with no scheme,
no '.', '..' or empty segment, no backslash or control character (a trailing '/' is dropped). A
malformed value is invalid_argument (400) naming the field. A grant (contracts/tokens.py) is a
whole bucket (`"rollouts"`) or the keys under whole path segments (`"shared/team-b"`: `team-b`
and `team-b/…`, not `team-b2`); reading outside the organization's grants is permission_denied
(403) naming the field. Hot-loads read their deployment's `hotLoad` location, so one check
covers them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def bucket_problem(value: str, field: str) -> str | None:
    if not BUCKET_RE.match(value) or ".." in value:
        return (
            f"{field} must be a bucket name: 3-63 lowercase letters, digits, '.' or '-', "
            f"starting and ending with a letter or digit, no '..'; got {value!r}"
        )
    return None


def path_problem(value: str, field: str, *, allow_empty: bool) -> str | None:
    """Why `value` is not a plain object-key prefix, or None."""
    if SCHEME_RE.match(value):
        return f"{field} must be a path inside the bucket, not a URL; got {value!r}"
    if value.startswith("/"):
        return f"{field} must be relative to the bucket (no leading '/'); got {value!r}"
    if "\\" in value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        return f"{field} must not contain a backslash or control characters"
    parts = value.removesuffix("/").split("/") if value else []
    if any(p in (".", "..") for p in parts):
        return f"{field} must not contain '.' or '..' segments; got {value!r}"
    if any(p == "" for p in parts):
        return f"{field} must not contain an empty segment ('//'); got {value!r}"
    if not parts and not allow_empty:
        return f"{field} must not be empty"
    return None


def normalize_path(value: str) -> str:
    """A valid path without its trailing '/'."""
    return value.removesuffix("/")


@dataclass(frozen=True)
class Grant:
    """One bucket (and optional key prefix) an organization may read."""

    bucket: str
    prefix: str = ""

    @classmethod
    def parse(cls, text: str) -> Grant:
        """`BUCKET` or `BUCKET/PREFIX`; ValueError saying what is wrong."""
        bucket, _, prefix = str(text).partition("/")
        if p := bucket_problem(bucket, "bucket"):
            raise ValueError(f"grant {text!r}: {p}")
        if p := path_problem(prefix, "prefix", allow_empty=True):
            raise ValueError(f"grant {text!r}: {p}")
        return cls(bucket, normalize_path(prefix))

    def __str__(self) -> str:
        return f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket

    def covers(self, bucket: str, path: str) -> bool:
        if bucket != self.bucket:
            return False
        return not self.prefix or path == self.prefix or path.startswith(self.prefix + "/")


def grant_problem(
    grants: tuple[Grant, ...], organization_id: str, bucket_field: str, bucket: str, path_field: str, path: str
) -> str | None:
    """Why `bucket`/`path` is not granted to the organization (naming the field), or None."""
    if any(g.covers(bucket, path) for g in grants):
        return None
    if not any(g.bucket == bucket for g in grants):
        return f"{bucket_field}: bucket {bucket!r} is not granted to organization {organization_id}"
    granted = ", ".join(repr(g.prefix) for g in grants if g.bucket == bucket)
    return (
        f"{path_field}: {path!r} in bucket {bucket!r} is outside what organization {organization_id} "
        f"is granted there ({granted})"
    )
