"""snapshots: everything about the bytes of a hot-load snapshot (no Temporal, no HTTP).

The format (``docs/design.md``, "The snapshot format"): a *full* snapshot is Hugging Face
safetensors shards + ``config.json`` + ``model.safetensors.index.json``; a *delta* is shards of
1-D ``U8`` tensors, each one zstd frame of ``new XOR base`` for one changed tensor, with the new
bytes' Adler-32 in the shard ``__metadata__`` and ``xor`` / ``zstd`` / ``adler32`` in the index
metadata. cwtrain's ``write_delta`` and slime's disk-delta writer produce it; this package reads,
validates, applies, materializes and writes it.

Entry points (each module's docstring states its contract):

* :func:`validate_identity` - identity rules.
* :func:`inspect_snapshot`, :func:`check_required_files` - validate a directory or ``s3://`` prefix.
* :class:`HostWeights` - a replica's host copy of its weights: load, ``apply_delta``
  (all-or-nothing), ``tensor``, ``checksums``, ``materialize``.
* :func:`apply_delta` - the same for plain buffers.
* :func:`materialize_chain` (:func:`materialize_chain_report`) - base + deltas -> a full
  checkpoint directory, streamed in bounded memory, all-or-nothing (may be done in place).
* :func:`validate_chain`, :func:`resolve_chain` - full base + at most 63 deltas.
* :func:`write_delta`, :func:`write_full_snapshot` - writers.
* :mod:`snapshots.cli` - ``rollouts snapshot inspect|delta|apply|verify``.

Every failure on bad input is a :class:`SnapshotError` (a ``ValueError``) naming file and tensor.
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
