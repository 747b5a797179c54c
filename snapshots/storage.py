"""Where a snapshot's files live: a local directory or an S3 prefix, behind one small interface.

A snapshot is the set of *immediate children* of one directory or one ``s3://bucket/prefix/``
(the service never reads nested entries). :func:`open_location` turns a path or an ``s3://`` URI
into a :class:`SnapshotSource`, which can list those files with their sizes (and with a version
that changes when a file is rewritten: the S3 ETag, a local file's mtime) and read byte ranges
of them. S3 reads are ranged GETs, so inspecting a snapshot costs a listing plus a few KiB per
shard header, and applying a delta fetches only the changed tensors' frames.

The S3 source takes a boto3 S3 client (or anything with ``list_objects_v2`` and ``get_object``
answering like one); this module never builds one itself. :func:`s3_client_from_env` does, for
the CLI.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from snapshots.errors import LayoutError, SnapshotError


class SnapshotSource(Protocol):
    """Read access to the immediate children of one snapshot location."""

    #: How the location is shown in messages (a path or an ``s3://`` URI ending in ``/``).
    uri: str

    def list_files(self) -> dict[str, int]:
        """Every immediate child file, by name, with its size in bytes."""
        ...

    def list_versions(self) -> dict[str, tuple[int, str]]:
        """Every immediate child file, by name, with its size and a version that changes when
        the file is rewritten (the S3 ETag; a local file's mtime in nanoseconds)."""
        ...

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of file ``name`` from ``offset``; short only at end of file."""
        ...

    def read_all(self, name: str) -> bytes:
        """The whole of file ``name``."""
        ...

    def describe(self, name: str) -> str:
        """``name`` as shown in error messages (full path or URI)."""
        ...


class LocalSource:
    """A snapshot directory on the local file system."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.uri = str(self.root)

    def list_files(self) -> dict[str, int]:
        return {name: size for name, (size, _) in self.list_versions().items()}

    def list_versions(self) -> dict[str, tuple[int, str]]:
        if not self.root.is_dir():
            raise LayoutError("snapshot location is not a directory", file=self.uri)
        files: dict[str, tuple[int, str]] = {}
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.is_file():
                    st = entry.stat()
                    files[entry.name] = (st.st_size, str(st.st_mtime_ns))
        return files

    def path(self, name: str) -> Path:
        return self.root / name

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        try:
            with open(self.root / name, "rb", buffering=0) as f:
                return os.pread(f.fileno(), length, offset)
        except OSError as exc:
            raise LayoutError(f"cannot read: {exc.strerror}", file=self.describe(name)) from exc

    def read_all(self, name: str) -> bytes:
        try:
            return (self.root / name).read_bytes()
        except OSError as exc:
            raise LayoutError(f"cannot read: {exc.strerror}", file=self.describe(name)) from exc

    def describe(self, name: str) -> str:
        return str(self.root / name)


class OpenedSource:
    """A source's ``read_range`` and ``describe`` for one pass over many tensors (a delta's
    decode): a local file is opened once, not once per tensor, and each file's description is
    made once. Thread-safe; :meth:`close` (or ``with``) closes the files."""

    def __init__(self, source: Any) -> None:
        self.source = source
        self.uri = source.uri
        self._fds: dict[str, int] = {}
        self._names: dict[str, str] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> OpenedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if not isinstance(self.source, LocalSource):
            return bytes(self.source.read_range(name, offset, length))
        if length <= 0:
            return b""
        try:
            return os.pread(self._fd(name), length, offset)
        except OSError as exc:
            raise LayoutError(f"cannot read: {exc.strerror}", file=self.describe(name)) from exc

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            with self._lock:
                fd = self._fds.get(name)
                if fd is None:
                    fd = self._fds[name] = os.open(self.source.path(name), os.O_RDONLY)
        return fd

    def describe(self, name: str) -> str:
        described = self._names.get(name)
        if described is None:
            described = self._names[name] = self.source.describe(name)
        return described

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # no leading slash; ends with "/" unless empty

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"


def snapshot_uri(bucket: str, path_prefix: str, identity: str) -> str:
    """Where a deployment's snapshot lives: ``s3://BUCKET/PATH_PREFIX/IDENTITY/``."""
    prefix = path_prefix.strip("/")
    return f"s3://{bucket}/{prefix + '/' if prefix else ''}{identity}/"


def parse_s3_uri(uri: str) -> S3Location:
    """Split ``s3://bucket/some/prefix/identity/`` into bucket and a ``/``-terminated prefix."""
    if not uri.startswith("s3://"):
        raise LayoutError("not an s3:// URI", file=uri)
    rest = uri[len("s3://") :]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise LayoutError("s3 URI has no bucket", file=uri)
    prefix = prefix.strip("/")
    if not prefix:
        raise LayoutError("s3 URI must name a snapshot prefix under the bucket", file=uri)
    if any(part in ("", ".", "..") for part in prefix.split("/")):
        raise LayoutError("s3 URI prefix has an empty, '.' or '..' segment", file=uri)
    return S3Location(bucket, prefix + "/")


class S3Source:
    """A snapshot under an S3 prefix, read with a caller-supplied boto3 S3 client."""

    def __init__(self, client: Any, location: S3Location | str) -> None:
        self.client = client
        self.location = parse_s3_uri(location) if isinstance(location, str) else location
        self.uri = self.location.uri

    def list_files(self) -> dict[str, int]:
        return {name: size for name, (size, _) in self.list_versions().items()}

    def list_versions(self) -> dict[str, tuple[int, str]]:
        files: dict[str, tuple[int, str]] = {}
        token: str | None = None
        seen: set[str] = set()
        while True:
            kwargs: dict[str, Any] = {
                "Bucket": self.location.bucket,
                "Prefix": self.location.prefix,
                # Only immediate children: deeper keys come back as CommonPrefixes, ignored.
                "Delimiter": "/",
            }
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call("list_objects_v2", self.uri, **kwargs)
            for obj in page.get("Contents") or []:
                name = obj["Key"][len(self.location.prefix) :]
                if name and "/" not in name:
                    files[name] = (int(obj.get("Size", 0)), str(obj.get("ETag", "")))
            if not page.get("IsTruncated"):
                return files
            token = page.get("NextContinuationToken")
            if not token or token in seen:
                # A store that repeats a token would loop forever; refuse instead.
                raise LayoutError("object listing did not make progress", file=self.uri)
            seen.add(token)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        body = self.open_range(name, offset, length)
        try:
            return body.read()
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()

    def read_all(self, name: str) -> bytes:
        answer = self._call(
            "get_object",
            self.describe(name),
            Bucket=self.location.bucket,
            Key=self.location.prefix + name,
        )
        return answer["Body"].read()

    def open_range(self, name: str, offset: int, length: int) -> Any:
        """One ranged GET of ``length`` bytes from ``offset``, as a stream (``read(n)``, ``close()``)
        to read in pieces, so a large range never sits in memory whole."""
        answer = self._call(
            "get_object",
            self.describe(name),
            Bucket=self.location.bucket,
            Key=self.location.prefix + name,
            Range=f"bytes={offset}-{offset + length - 1}",
        )
        return answer["Body"]

    def describe(self, name: str) -> str:
        return self.uri + name

    def _call(self, method: str, what: str, **kwargs: Any) -> Any:
        try:
            return getattr(self.client, method)(**kwargs)
        except SnapshotError:
            raise
        except Exception as exc:  # botocore.ClientError and transport errors alike
            code = ""
            response = getattr(exc, "response", None)
            if isinstance(response, dict):
                code = str(response.get("Error", {}).get("Code", ""))
            if code in ("NoSuchKey", "404", "NotFound"):
                raise LayoutError("object does not exist", file=what) from exc
            if code == "InvalidRange":
                raise LayoutError("object is shorter than its header says", file=what) from exc
            # Not a SnapshotError: storage being unreachable is not bad input, so callers may
            # retry it.
            raise


def is_s3_uri(location: str | os.PathLike[str]) -> bool:
    return isinstance(location, str) and location.startswith("s3://")


def open_location(location: str | os.PathLike[str] | SnapshotSource, *, s3: Any = None) -> SnapshotSource:
    """A :class:`SnapshotSource` for a directory path, an ``s3://`` URI, or a source itself.

    Raises:
        SnapshotError: an ``s3://`` URI without an ``s3`` client, or a malformed URI.
    """
    if isinstance(location, (LocalSource, S3Source)):
        return location
    if is_s3_uri(location):  # type: ignore[arg-type]
        if s3 is None:
            raise SnapshotError("an S3 client is needed to read this location", file=str(location))
        return S3Source(s3, str(location))
    if isinstance(location, (str, os.PathLike)):
        return LocalSource(location)
    return location  # already a source-like object


def s3_client_from_env() -> Any:
    """A boto3 S3 client configured from the standard environment.

    The endpoint comes from ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL`` or ``CW_S3_ENDPOINT``;
    credentials and region from boto3's usual chain (``AWS_ACCESS_KEY_ID`` ...). Path-style
    addressing is used, which every S3-compatible server accepts.
    """
    import boto3  # noqa: PLC0415 - boto3 loads only for s3:// locations
    from botocore.config import Config  # noqa: PLC0415 - boto3 loads only for s3:// locations

    endpoint = (
        os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or os.environ.get("CW_S3_ENDPOINT")
        or None
    )
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 5, "mode": "standard"}),
    )


__all__ = [
    "LocalSource",
    "S3Location",
    "S3Source",
    "SnapshotSource",
    "is_s3_uri",
    "open_location",
    "parse_s3_uri",
    "s3_client_from_env",
]
