"""Where and how one engine joins a broadcast group of engines: the one record the agent sends
(`replica.agent.engine_rpc`'s ``start_peer_*``) and the engine's peer jobs read
(`replica.engine.extension`, which forms the group: `replica.engine.peer_group`).

It travels as a JSON object (:meth:`PeerJoin.to_json`, :meth:`PeerJoin.of`); rank 0 sends,
ranks 1..world_size-1 receive.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class PeerJoin:
    """The rendezvous (``host:port``; ``external_store``: another process already hosts its
    store), this member's ``rank`` in a group of ``world_size``, the torch.distributed
    ``backend``, and how long forming the group may take."""

    host: str
    port: int
    world_size: int
    rank: int = 0
    backend: str = "gloo"
    timeout_s: float = 300.0
    external_store: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, value: dict[str, Any]) -> PeerJoin:
        """The record from its JSON object; a TypeError names a field it lacks or does not know."""
        return cls(**value)
