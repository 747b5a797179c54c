"""The errors of the ``snapshots`` package.

Every failure to read, validate, apply or write a snapshot is a :class:`SnapshotError`, a
``ValueError`` (bad input: a retry will not help), carrying the ``file`` and, when there is one,
the ``tensor``, both named in its message. Subclasses let callers map failures to API reasons
without parsing messages: :class:`IdentityError`, :class:`HeaderError`, :class:`LayoutError`,
:class:`UnsupportedFormatError`, :class:`DeltaMismatchError`, :class:`ChecksumError`,
:class:`ChainError`.
"""

from __future__ import annotations


class SnapshotError(ValueError):
    """A snapshot (or one of its files or tensors) is unusable.

    ``file`` and ``tensor`` are also folded into the message, in that order, so ``str(exc)``
    is a complete one-line report.
    """

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        self.file = file
        self.tensor = tensor
        self.detail = message
        prefix = ""
        if file is not None:
            prefix += f"{file}: "
        if tensor is not None:
            prefix += f"tensor {tensor!r}: "
        super().__init__(prefix + message)


class IdentityError(SnapshotError):
    """A snapshot identity is not a valid single path segment."""


class HeaderError(SnapshotError):
    """A safetensors file is truncated or its header is malformed or inconsistent."""


class LayoutError(SnapshotError):
    """Required files are missing, or the index and the shards disagree."""


class UnsupportedFormatError(SnapshotError):
    """A delta uses an encoding, compression or checksum format the service does not accept."""


class DeltaMismatchError(SnapshotError):
    """A delta does not fit the base it is applied to, or one of its frames is unusable."""


class ChecksumError(SnapshotError):
    """A checksum is missing, malformed, or does not match the reconstructed bytes."""


class ChainError(SnapshotError):
    """A snapshot chain is malformed; the message names the offending link."""


__all__ = [
    "ChainError",
    "ChecksumError",
    "DeltaMismatchError",
    "HeaderError",
    "IdentityError",
    "LayoutError",
    "SnapshotError",
    "UnsupportedFormatError",
]
