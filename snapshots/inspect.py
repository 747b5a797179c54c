"""Validate and describe a snapshot, local or on S3, without reading tensor data.

A snapshot is the set of immediate children of ``DIR/`` or ``s3://BUCKET/PREFIX/IDENTITY/``;
its layout (full, XOR delta, sparse delta) is docs/design.md's "The snapshot format", and any
other delta encoding, compression or checksum format is refused by name. ``version`` /
``base_version`` are informational: deltas chain by the hot-load request's identities.
:func:`check_required_files` is the cheap admission check (one listing and the index);
:func:`verify_required_files` also returns the fingerprint; :func:`inspect_snapshot` validates
every shard header too; :func:`read_delta_plan` / :func:`read_full_layout` return the validated
layout the apply, materialize and write paths work from.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from typing import Any

from snapshots.errors import (
    ChecksumError,
    HeaderError,
    LayoutError,
    SnapshotError,
    UnsupportedFormatError,
)
from snapshots.identity import validate_identity
from snapshots.safetensors_io import SafetensorsHeader, TensorEntry, parse_json_object, read_header_from
from snapshots.sparse import SPARSE, SparseTensor, pairs
from snapshots.storage import SnapshotSource, open_location

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
SHARD_SUFFIX = ".safetensors"
FULL = "full"
DELTA = "delta"
CHECKSUM_RE = re.compile(r"^[0-9a-fA-F]{8}$")
#: Index files larger than this are refused before they are parsed.
MAX_INDEX_BYTES = 64 * 2**20

_TYPE_ALIASES = {
    "full": FULL,
    "snapshot_type_full": FULL,
    "delta": DELTA,
    "incremental": DELTA,
    "snapshot_type_incremental": DELTA,
}


def normalize_type(snapshot_type: str) -> str:
    """``"full"`` or ``"delta"`` for any of the spellings the API and CLIs use."""
    try:
        return _TYPE_ALIASES[str(snapshot_type).strip().lower()]
    except KeyError:
        raise SnapshotError(f"unknown snapshot type {snapshot_type!r}; expected full or delta") from None


@dataclass(frozen=True)
class Index:
    """A parsed, structurally valid ``model.safetensors.index.json``."""

    file: str
    metadata: dict[str, Any]
    weight_map: dict[str, str]
    generated: bool = False  # built from a lone model.safetensors

    @property
    def is_delta(self) -> bool:
        return "delta_encoding" in self.metadata

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def parse_index(body: bytes, file: str) -> Index:
    """Parse index JSON: an object with an optional ``metadata`` object and a ``weight_map``
    object mapping tensor names to shard file names that are immediate children."""
    raw = parse_json_object(body, "index", LayoutError, file)
    metadata = raw.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise LayoutError("index metadata is not a JSON object", file=file)
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict):
        raise LayoutError("index has no weight_map object", file=file)
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or not shard.endswith(SHARD_SUFFIX)
            or "/" in shard
            or "\\" in shard
            or shard.startswith(".")
        ):
            raise LayoutError(
                f"weight_map points at {shard!r}; expected a *{SHARD_SUFFIX} file directly in the snapshot",
                file=file,
                tensor=name,
            )
    return Index(file, metadata, dict(weight_map))


def _read_index(source: SnapshotSource, files: dict[str, int]) -> Index:
    if INDEX_FILE not in files:
        if SINGLE_FILE in files:
            # save_pretrained writes no index below its shard size; the header is the index.
            header = _read_shard_header(source, SINGLE_FILE, files[SINGLE_FILE])
            if not header.tensors:
                raise LayoutError("holds no tensors", file=source.describe(SINGLE_FILE))
            return Index(
                source.describe(INDEX_FILE),
                {"total_size": sum(t.nbytes for t in header.tensors.values())},
                dict.fromkeys(header.tensors, SINGLE_FILE),
                generated=True,
            )
        raise LayoutError(f"missing {INDEX_FILE}", file=source.uri)
    if files[INDEX_FILE] > MAX_INDEX_BYTES:
        raise LayoutError(
            f"index is {files[INDEX_FILE]} bytes, over the {MAX_INDEX_BYTES} cap", file=source.describe(INDEX_FILE)
        )
    return parse_index(source.read_all(INDEX_FILE), source.describe(INDEX_FILE))


def _read_shard_header(source: SnapshotSource, name: str, size: int) -> SafetensorsHeader:
    return read_header_from(lambda offset, length: source.read_range(name, offset, length), size, source.describe(name))


def delta_encoding(metadata: dict[str, Any]) -> str:
    return str(metadata.get("delta_encoding", "")).strip().lower()


def check_delta_metadata(metadata: dict[str, Any], file: str) -> None:
    """Refuse, by name, any delta encoding, compression or checksum but xor / zstd / adler32, or
    sparse / none / adler32."""
    encoding = delta_encoding(metadata)
    if encoding not in ("xor", SPARSE):
        raise UnsupportedFormatError(
            f"delta_encoding {metadata.get('delta_encoding')!r} is not supported; 'xor' (zstd frames of new XOR "
            f"base) and 'sparse' (changed elements as NAME.indices and NAME.values) are",
            file=file,
        )
    compression = str(metadata.get("compression_format", "zstd" if encoding == "xor" else "none")).strip().lower()
    if encoding == SPARSE and compression not in ("none", ""):
        raise UnsupportedFormatError(
            f"compression_format {metadata.get('compression_format')!r} is not supported for a sparse delta; "
            "its indices and values are stored as they are (leave it out, or 'none')",
            file=file,
        )
    if encoding == "xor" and compression != "zstd":
        raise UnsupportedFormatError(
            f"compression_format {metadata.get('compression_format')!r} is not supported; only 'zstd' is",
            file=file,
        )
    checksum = str(metadata.get("checksum_format", "")).strip().lower().replace("-", "")
    if checksum != "adler32":
        raise UnsupportedFormatError(
            f"checksum_format {metadata.get('checksum_format')!r} is not supported; only "
            "'adler32' is (slime: --update-weight-delta-checksum adler32)",
            file=file,
        )


def _required(index: Index | None, snapshot_type: str) -> list[str]:
    names = [INDEX_FILE] if index is None or not index.generated else []
    if snapshot_type == FULL:
        names.append(CONFIG_FILE)
    if index is not None:
        names.extend(index.shards)
    return names


def check_required_files(
    location: str | os.PathLike[str] | SnapshotSource, snapshot_type: str, *, s3: Any = None
) -> list[str]:
    """The required files missing from a snapshot (empty when it is complete).

    Cheap enough for hot-load admission: one listing plus a read of the index, no shard headers.
    Full needs ``config.json``, the index (or a lone ``model.safetensors``) and every shard the
    index names; delta needs the index and its shards.

    Raises:
        SnapshotError: the index exists but is malformed, a full index is empty, or the index
            is of the other type (a delta's index submitted as full, or the reverse), or a
            delta's metadata names an unsupported format.
    """
    return verify_required_files(location, snapshot_type, s3=s3).missing


@dataclass(frozen=True)
class RequiredFiles:
    """What :func:`verify_required_files` found: the required files missing, and the snapshot's
    fingerprint, a digest of each required file present (name, size, version: the S3 ETag, a
    local file's mtime), so that the same check later tells a rewritten or removed file apart."""

    missing: list[str]
    fingerprint: str


def verify_required_files(
    location: str | os.PathLike[str] | SnapshotSource, snapshot_type: str, *, s3: Any = None
) -> RequiredFiles:
    """:func:`check_required_files` (same cost, same errors) with the snapshot's fingerprint."""
    snapshot_type = normalize_type(snapshot_type)
    source = open_location(location, s3=s3)
    versions = source.list_versions()
    files = {name: size for name, (size, _) in versions.items()}
    if INDEX_FILE not in files and not (snapshot_type == FULL and SINGLE_FILE in files):
        return RequiredFiles(sorted(_required(None, snapshot_type)), fingerprint(versions, []))
    index = _read_index(source, files)
    _check_type(index, snapshot_type, source)
    required = _required(index, snapshot_type)
    return RequiredFiles(sorted(n for n in required if n not in files), fingerprint(versions, required))


def fingerprint(versions: dict[str, tuple[int, str]], names: list[str]) -> str:
    """A digest of these files' names, sizes and versions (those of `names` that `versions`
    lists), in name order."""
    lines = (f"{name}\t{versions[name][0]}\t{versions[name][1]}\n" for name in sorted(set(names)) if name in versions)
    return hashlib.sha256("".join(lines).encode()).hexdigest()[:32]


def _check_type(index: Index, snapshot_type: str, source: SnapshotSource) -> None:
    if snapshot_type == FULL:
        if index.is_delta:
            raise LayoutError("index describes a delta (it has delta_encoding), not a full snapshot", file=index.file)
        if not index.weight_map:
            raise LayoutError("full snapshot index has an empty weight_map", file=index.file)
    else:
        if not index.is_delta:
            raise LayoutError("index has no delta_encoding: this is a full snapshot, not a delta", file=index.file)
        check_delta_metadata(index.metadata, index.file)


@dataclass(frozen=True)
class DeltaTensor:
    """One changed tensor of a delta: where its zstd frame is (a sparse delta: its indices and
    values, ``sparse``) and the new bytes' Adler-32."""

    name: str
    file: str  # shard name inside the snapshot
    begin: int  # absolute byte range of the frame in the shard (sparse: of the indices)
    end: int
    checksum: str  # 8 lowercase hex digits
    sparse: SparseTensor | None = None

    @property
    def wire_bytes(self) -> int:
        extra = self.sparse.values.end - self.sparse.values.begin if self.sparse is not None else 0
        return self.end - self.begin + extra


@dataclass
class DeltaPlan:
    """A validated delta: its metadata and its changed tensors (sorted by shard, then offset)."""

    source: SnapshotSource
    index: Index
    files: dict[str, int]
    tensors: dict[str, DeltaTensor]

    @property
    def uri(self) -> str:
        return self.source.uri

    @property
    def version(self) -> str | None:
        v = self.index.metadata.get("version")
        return None if v is None else str(v)

    @property
    def base_version(self) -> str | None:
        v = self.index.metadata.get("base_version")
        return None if v is None else str(v)

    @property
    def wire_bytes(self) -> int:
        return sum(t.wire_bytes for t in self.tensors.values())


@dataclass
class FullLayout:
    """A validated full checkpoint: where each tensor lives, plus any recorded checksums."""

    source: SnapshotSource
    index: Index
    files: dict[str, int]
    headers: dict[str, SafetensorsHeader]  # by shard name
    tensors: dict[str, tuple[str, TensorEntry]]  # name -> (shard, entry), in weight_map order
    checksums: dict[str, str]  # name -> adler32 hex recorded in a shard's __metadata__

    @property
    def tensor_bytes(self) -> int:
        return sum(entry.nbytes for _, entry in self.tensors.values())


def _read_headers(source: SnapshotSource, files: dict[str, int], shards: list[str]) -> dict[str, SafetensorsHeader]:
    if len(shards) <= 1:
        return {s: _read_shard_header(source, s, files[s]) for s in shards}
    # Remote headers cost a round trip each; fetch them concurrently.
    with ThreadPoolExecutor(max_workers=min(16, len(shards))) as pool:
        headers = pool.map(lambda s: _read_shard_header(source, s, files[s]), shards)
        return dict(zip(shards, headers))


def _open(location: Any, s3: Any, snapshot_type: str) -> tuple[SnapshotSource, dict[str, int], Index]:
    source = open_location(location, s3=s3)
    files = source.list_files()
    index = _read_index(source, files)
    _check_type(index, snapshot_type, source)
    missing = [n for n in _required(index, snapshot_type) if n not in files]
    if missing:
        raise LayoutError(f"missing {', '.join(sorted(missing))}", file=source.uri)
    return source, files, index


def _located(
    index: Index, headers: Mapping[str, SafetensorsHeader]
) -> Iterator[tuple[str, str, SafetensorsHeader, TensorEntry]]:
    """Each tensor the index's ``weight_map`` names, with its shard, that shard's header and its
    entry there, in index order; a tensor its shard does not hold is a LayoutError."""
    for name, shard in index.weight_map.items():
        header = headers[shard]
        entry = header.tensors.get(name)
        if entry is None:
            raise LayoutError(
                "weight_map names this tensor but the shard does not hold it", file=header.file, tensor=name
            )
        yield name, shard, header, entry


def _checksum(recorded: str, file: str, tensor: str) -> str:
    """A recorded Adler-32, lower-cased; a ChecksumError unless it is 8 hex digits."""
    if len(recorded) != 8 or not CHECKSUM_RE.match(recorded):
        raise ChecksumError(f"checksum {recorded!r} is not 8 hex digits", file=file, tensor=tensor)
    return recorded.lower()


def read_delta_plan(location: Any, *, s3: Any = None) -> DeltaPlan:
    """Validate a delta (files, index, metadata, shard headers, checksums) and locate its frames.

    Raises:
        SnapshotError: naming the file and tensor at fault.
    """
    source, files, index = _open(location, s3, DELTA)
    headers = _read_headers(source, files, index.shards)
    tensors: dict[str, DeltaTensor] = {}
    if delta_encoding(index.metadata) == SPARSE:
        for name, item in pairs(index.weight_map, headers).items():
            tensors[name] = DeltaTensor(
                name, item.indices.file, item.indices.begin, item.indices.end, item.checksum, sparse=item
            )
        ordered = dict(sorted(tensors.items(), key=lambda kv: (kv[1].file, kv[1].begin)))
        return DeltaPlan(source, index, files, ordered)
    for name, shard, header, entry in _located(index, headers):
        if entry.dtype != "U8" or len(entry.shape) != 1:
            raise HeaderError(
                f"delta tensors must be 1-D U8 zstd frames, got {entry.dtype}{list(entry.shape)}",
                file=header.file,
                tensor=name,
            )
        checksum = header.metadata.get(name)
        if checksum is None:
            raise ChecksumError("no Adler-32 checksum for this tensor in __metadata__", file=header.file, tensor=name)
        tensors[name] = DeltaTensor(name, shard, entry.begin, entry.end, _checksum(checksum, header.file, name))
    ordered = {t.name: t for t in sorted(tensors.values(), key=attrgetter("file", "begin"))}
    return DeltaPlan(source, index, files, ordered)


def read_full_layout(location: Any, *, s3: Any = None) -> FullLayout:
    """Validate a full checkpoint (files, index, shard headers) and locate every tensor.

    Raises:
        SnapshotError: naming the file and tensor at fault.
    """
    source, files, index = _open(location, s3, FULL)
    headers = _read_headers(source, files, index.shards)
    tensors: dict[str, tuple[str, TensorEntry]] = {}
    checksums: dict[str, str] = {}
    for name, shard, header, entry in _located(index, headers):
        tensors[name] = (shard, entry)
        recorded = header.metadata.get(name)
        if recorded is not None:
            checksums[name] = _checksum(recorded, header.file, name)
    return FullLayout(source, index, files, headers, tensors, checksums)


@dataclass(frozen=True)
class SnapshotInfo:
    """What :func:`inspect_snapshot` found. ``to_json()`` is what the CLI prints."""

    location: str
    type: str  # "full" | "delta"
    files: dict[str, int]  # every immediate child file with its size
    total_bytes: int
    tensors: int  # tensors in the snapshot (for a delta: the changed ones)
    tensor_bytes: int  # full: raw tensor bytes; delta: compressed frame bytes
    changed_tensors: list[str]  # delta only
    metadata: dict[str, Any]  # the index metadata
    previous_identity: str | None = None
    index_generated: bool = False
    checksummed_tensors: int = 0  # tensors with a recorded Adler-32
    empty_delta: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def inspect_snapshot(
    location: str | os.PathLike[str] | SnapshotSource,
    *,
    s3: Any = None,
    previous_identity: str | None = None,
) -> SnapshotInfo:
    """Validate a snapshot directory or ``s3://`` prefix and describe it.

    The type is read from the index: a delta has ``delta_encoding`` in its metadata.

    Args:
        s3: A boto3 S3 client, required for ``s3://`` locations.
        previous_identity: For a delta, the identity it was computed against (validated as an
            identity, field ``previousSnapshotIdentity``). Refused for a full snapshot.

    Raises:
        SnapshotError: naming the file and tensor at fault.
    """
    source = open_location(location, s3=s3)
    files = source.list_files()
    index = _read_index(source, files)
    common: dict[str, Any] = {
        "location": source.uri,
        "files": dict(sorted(files.items())),
        "total_bytes": sum(files.values()),
    }
    if index.is_delta:
        if previous_identity is not None:
            validate_identity(previous_identity, field="previousSnapshotIdentity")
        plan = read_delta_plan(source)
        return SnapshotInfo(
            type=DELTA,
            tensors=len(plan.tensors),
            tensor_bytes=plan.wire_bytes,
            changed_tensors=sorted(plan.tensors)
            if delta_encoding(plan.index.metadata) == SPARSE
            else list(plan.index.weight_map),
            metadata=plan.index.metadata,
            previous_identity=previous_identity,
            checksummed_tensors=len(plan.tensors),
            empty_delta=not plan.tensors,
            **common,
        )
    if previous_identity is not None:
        raise SnapshotError("a full snapshot has no previous identity", file=source.uri)
    layout = read_full_layout(source)
    return SnapshotInfo(
        type=FULL,
        tensors=len(layout.tensors),
        tensor_bytes=layout.tensor_bytes,
        changed_tensors=[],
        metadata=layout.index.metadata,
        index_generated=layout.index.generated,
        checksummed_tensors=len(layout.checksums),
        **common,
    )


__all__ = [
    "CONFIG_FILE",
    "DELTA",
    "DeltaPlan",
    "DeltaTensor",
    "FULL",
    "FullLayout",
    "INDEX_FILE",
    "Index",
    "RequiredFiles",
    "SINGLE_FILE",
    "SnapshotInfo",
    "check_delta_metadata",
    "check_required_files",
    "fingerprint",
    "inspect_snapshot",
    "normalize_type",
    "parse_index",
    "read_delta_plan",
    "read_full_layout",
    "verify_required_files",
]
