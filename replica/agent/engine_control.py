"""What a replica's runtime needs of its engine (`replica/agent/runtime.py`, `peers.py`): the
`EngineControl` protocol. `replica.agent.engine_rpc.EngineClient` is the one implementation (a
vLLM server's `EngineProcess` and a Dynamo worker's `DynamoEngineProcess` differ only in its
transport and its routing-pool methods); so is any stand-in a unit test gives the runtime.
A swap is one call, `swap_in_pause`: the transaction runs inside the engine (`replica.engine.swap`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from replica.peer_join import PeerJoin
from snapshots.regions import ServedWeights


class EngineControl(Protocol):
    ranks: int  # tensor-parallel ranks: each holds a shard, and answers for it

    @property
    def pid(self) -> int | None: ...

    # -- the routing pool (no-ops but for a Dynamo worker)
    async def leave_pool(self) -> None: ...
    async def rejoin_pool(self) -> None: ...
    async def hold_out(self) -> None: ...
    async def serve(self) -> None: ...
    async def open_gate(self) -> None: ...

    # -- the pause and the label
    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None: ...
    async def resume(self) -> None: ...
    async def set_weight_version(self, version: str) -> None: ...
    async def weight_version(self) -> str | None: ...

    # -- staging while serving
    async def stage_from_files(
        self,
        label: str,
        paths: Sequence[Path | str],
        names: Sequence[str] | None = None,
        expected_adler32: Mapping[str, str] | None = None,
    ) -> dict[str, Any]: ...
    async def stage_from_arena(
        self,
        label: str,
        path: Path | str,
        entries: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str],
        verify: bool = True,
        backup: tuple[Path | str, Mapping[str, int]] | None = None,
    ) -> dict[str, Any]: ...
    async def discard_staged(self) -> dict[str, Any]: ...

    # -- the swap and its proof
    async def swap_in_pause(
        self,
        label: str,
        previous: str,
        *,
        clear_cache: bool,
        expected: int,
        while_held: Callable[[], Awaitable[None]] | None = None,
    ) -> dict[str, Any]: ...
    async def served_shards(self, names: Sequence[str] | None = None) -> ServedWeights: ...

    # -- peers (jobs inside the engine, awaited with wait_job)
    async def start_peer_stage_send(self, join: PeerJoin, names: Sequence[str] | None = None) -> None: ...
    async def start_peer_stage_receive(
        self,
        join: PeerJoin,
        label: str,
        specs: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str] | None = None,
        save_path: Path | str | None = None,
    ) -> None: ...
    async def start_peer_send_files(self, join: PeerJoin, paths: Sequence[Path | str]) -> None: ...
    async def start_peer_receive_files(
        self,
        join: PeerJoin,
        specs: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str],
        out_dir: Path | str,
    ) -> None: ...
    async def wait_job(self, kind: str, timeout_s: float = 600.0, rpc_every_s: float = 5.0) -> dict[str, Any]: ...
