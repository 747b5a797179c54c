"""Snapshot chains: a full base followed by up to 63 deltas, each against the link before it.

The service resolves a hot-load target into the chain that reconstructs it (the guide's
``snapshotChain``: full baseline first). Links are identified by the identities in the hot-load
requests (``identity`` / ``previousSnapshotIdentity``), not by the ``version`` fields inside a
delta's index, which may hold a trainer's own counters.

:func:`validate_chain` checks an ordered list of links; :func:`resolve_chain` walks back from a
target through a mapping of known snapshots. Both raise :class:`~snapshots.errors.ChainError`
naming the offending link (position and identity).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from snapshots.errors import ChainError, SnapshotError
from snapshots.identity import RESERVED_IDENTITY, validate_identity
from snapshots.inspect import DELTA, FULL, normalize_type

#: A chain holds at most this many deltas after its full base (the guide's limit).
MAX_CHAIN_DELTAS = 63


@dataclass(frozen=True)
class ChainLink:
    """One snapshot of a chain: ``type`` is ``"full"`` or ``"delta"`` (API spellings accepted)."""

    identity: str
    type: str
    previous_identity: str | None = None

    def normalized(self) -> ChainLink:
        return ChainLink(self.identity, normalize_type(self.type), self.previous_identity)


def _describe(position: int, link: ChainLink) -> str:
    return f"chain link {position} ({link.identity!r})"


def validate_chain(links: Sequence[ChainLink], *, max_deltas: int = MAX_CHAIN_DELTAS) -> list[ChainLink]:
    """Check that ``links`` is a full snapshot followed by deltas, each against the previous link.

    The base may be ``initial`` (the deployment's own weights); every other identity must be a
    valid identity. Returns the links with normalized types.

    Raises:
        ChainError: empty chain, base not full, a later link full, a delta whose previous
            identity is not the link before it, a repeated identity, or more than
            ``max_deltas`` deltas; the message names the link.
    """
    if not links:
        raise ChainError("empty chain: it needs a full snapshot as its base")
    normalized: list[ChainLink] = []
    seen: set[str] = set()
    for position, raw in enumerate(links):
        try:
            link = raw.normalized()
            if not (position == 0 and link.identity == RESERVED_IDENTITY):
                validate_identity(link.identity)
        except SnapshotError as exc:
            raise ChainError(f"{_describe(position, raw)}: {exc}") from None
        where = _describe(position, link)
        if link.identity in seen:
            raise ChainError(f"{where}: identity appears twice in the chain")
        seen.add(link.identity)
        if position == 0:
            if link.type != FULL:
                raise ChainError(f"{where}: a chain must start with a full snapshot, not a {link.type}")
        else:
            if link.type != DELTA:
                raise ChainError(f"{where}: only the first link may be full")
            expected = normalized[-1].identity
            if link.previous_identity != expected:
                raise ChainError(
                    f"{where}: delta was computed against {link.previous_identity!r}, but the "
                    f"previous link is {expected!r}"
                )
        normalized.append(link)
    if len(normalized) - 1 > max_deltas:
        raise ChainError(
            f"{_describe(max_deltas + 1, normalized[max_deltas + 1])}: the chain has "
            f"{len(normalized) - 1} deltas, more than the {max_deltas} allowed; publish a full "
            "snapshot to start a new chain"
        )
    return normalized


def resolve_chain(
    target: str, known: Mapping[str, ChainLink], *, max_deltas: int = MAX_CHAIN_DELTAS
) -> list[ChainLink]:
    """The chain that reconstructs ``target``, full base first, from ``known`` links by identity.

    Raises:
        ChainError: a link (or its base) is not in ``known``, the chain loops, or it is longer
            than ``max_deltas`` deltas.
    """
    reversed_links: list[ChainLink] = []
    identity: str | None = target
    visited: set[str] = set()
    while True:
        if identity is None:
            raise ChainError(f"{reversed_links[-1].identity!r}: delta has no previous identity")
        if identity in visited:
            raise ChainError(f"{identity!r}: the chain loops back to this snapshot")
        visited.add(identity)
        link = known.get(identity)
        if link is None:
            child = f" (the base of {reversed_links[-1].identity!r})" if reversed_links else ""
            raise ChainError(f"{identity!r}{child}: no such snapshot")
        link = link.normalized()
        reversed_links.append(link)
        if link.type == FULL:
            break
        if len(reversed_links) > max_deltas:
            raise ChainError(
                f"{target!r}: more than {max_deltas} deltas before reaching a full snapshot; "
                "publish a full snapshot to start a new chain"
            )
        identity = link.previous_identity
    return validate_chain(list(reversed(reversed_links)), max_deltas=max_deltas)


__all__ = ["ChainLink", "MAX_CHAIN_DELTAS", "resolve_chain", "validate_chain"]
