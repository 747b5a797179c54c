"""snapshots: everything about the bytes of a hot-load snapshot (no Temporal, no HTTP).

The format is docs/design.md's "The snapshot format": full safetensors checkpoints, XOR+zstd
deltas and sparse deltas, each tensor's Adler-32 recorded. Entry points: :func:`validate_identity`;
:func:`inspect_snapshot`, :func:`check_required_files`; :class:`HostWeights` (a replica's host
copy) and :func:`apply_delta`; :func:`materialize_chain` (:func:`materialize_chain_report`,
streamed, bounded memory); :func:`validate_chain`, :func:`resolve_chain`; :func:`write_delta`,
:func:`write_full_snapshot`; :mod:`snapshots.cli`. Invariants: every apply is all or nothing, and
every failure on bad input is a :class:`SnapshotError` (a ``ValueError``) naming file and tensor.
"""

from snapshots.chain import MAX_CHAIN_DELTAS, ChainLink, resolve_chain, validate_chain
from snapshots.codec import DeltaReport, adler32_hex
from snapshots.errors import (
    ChainError,
    ChecksumError,
    DeltaMismatchError,
    HeaderError,
    IdentityError,
    LayoutError,
    SnapshotError,
    UnsupportedFormatError,
)
from snapshots.host import HostWeights, apply_delta, checkpoint_checksums, compare_checksums, materialize_chain
from snapshots.identity import validate_identity
from snapshots.inspect import (
    SnapshotInfo,
    check_required_files,
    inspect_snapshot,
    read_delta_plan,
    read_full_layout,
)
from snapshots.safetensors_io import TensorEntry, list_tensors, read_header, read_tensor_bytes
from snapshots.stream import MaterializeReport, materialize_chain_report, stream_checksums
from snapshots.writer import DeltaStats, write_delta, write_full_snapshot

__all__ = [
    "MAX_CHAIN_DELTAS",
    "ChainError",
    "ChainLink",
    "ChecksumError",
    "DeltaMismatchError",
    "DeltaReport",
    "DeltaStats",
    "HeaderError",
    "HostWeights",
    "IdentityError",
    "LayoutError",
    "MaterializeReport",
    "SnapshotError",
    "SnapshotInfo",
    "TensorEntry",
    "UnsupportedFormatError",
    "adler32_hex",
    "apply_delta",
    "check_required_files",
    "checkpoint_checksums",
    "compare_checksums",
    "inspect_snapshot",
    "list_tensors",
    "materialize_chain",
    "materialize_chain_report",
    "read_delta_plan",
    "read_full_layout",
    "read_header",
    "read_tensor_bytes",
    "resolve_chain",
    "stream_checksums",
    "validate_chain",
    "validate_identity",
    "write_delta",
    "write_full_snapshot",
]
