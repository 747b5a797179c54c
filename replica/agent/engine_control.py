"""What a replica's runtime needs of its engine (`replica/agent/runtime.py`, `peers.py`): the
`EngineControl` protocol. `replica.agent.engine_process.EngineProcess` (vLLM's OpenAI server) and
`replica.agent.dynamo.DynamoEngineProcess` (Dynamo's vLLM worker) are engines; so is any stand-in
a unit test gives the runtime.

``swaps_in_one_call`` says whether the engine does a whole swap (pause, label, swap and proof,
resume) in one call, `swap_in_pause`, inside its own process (a Dynamo worker: True); an engine
that does not (False) is driven call by call: `pause`, `set_weight_version`, `swap_staged` /
`commit_staged` / `swap_and_commit_staged`, `resume`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from snapshots.regions import ServedWeights


class EngineControl(Protocol):
    swaps_in_one_call: bool
    ranks: int  # tensor-parallel ranks: each holds a shard, and answers for it

    @property
    def pid(self) -> int | None: ...

    # -- the pause and the label
    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None: ...
    async def resume(self) -> None: ...
    async def set_weight_version(self, version: str) -> None: ...
    async def weight_version(self) -> str | None: ...

    # -- staging while serving
    async def stage_from_files(
        self, label: str, paths: Sequence[Path | str], names: Sequence[str] | None = None,
        expected_adler32: Mapping[str, str] | None = None,
    ) -> dict[str, Any]: ...
    async def stage_from_arena(
        self, label: str, path: Path | str, entries: Sequence[Sequence[Any]], expected_adler32: Mapping[str, str],
        verify: bool = True, backup: tuple[Path | str, Mapping[str, int]] | None = None,
    ) -> dict[str, Any]: ...
    async def discard_staged(self) -> dict[str, Any]: ...

    # -- the swap and its proof
    async def swap_staged(self, label: str) -> dict[str, Any]: ...
    async def commit_staged(self, label: str) -> dict[str, Any]: ...
    async def swap_and_commit_staged(self, label: str) -> dict[str, Any]: ...
    async def swap_in_pause(self, label: str, previous: str, *, clear_cache: bool, expected: int) -> dict[str, Any]: ...
    async def served_shards(self, names: Sequence[str] | None = None) -> ServedWeights: ...

    # -- peers (jobs inside the engine, awaited with wait_job)
    async def start_peer_stage_send(
        self, host: str, port: int, world_size: int, names: Sequence[str] | None = None,
        backend: str = "gloo", timeout_s: float = 300.0, external_store: bool = False,
    ) -> None: ...
    async def start_peer_stage_receive(
        self, label: str, host: str, port: int, rank: int, world_size: int, specs: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str] | None = None, save_path: Path | str | None = None,
        backend: str = "gloo", timeout_s: float = 300.0, external_store: bool = False,
    ) -> None: ...
    async def start_peer_send_files(
        self, host: str, port: int, world_size: int, paths: Sequence[Path | str], backend: str = "gloo",
        timeout_s: float = 300.0, external_store: bool = False,
    ) -> None: ...
    async def start_peer_receive_files(
        self, host: str, port: int, rank: int, world_size: int, specs: Sequence[Sequence[Any]],
        expected_adler32: Mapping[str, str], out_dir: Path | str, backend: str = "gloo",
        timeout_s: float = 300.0, external_store: bool = False,
    ) -> None: ...
    async def wait_job(self, kind: str, timeout_s: float = 600.0, rpc_every_s: float = 5.0) -> dict[str, Any]: ...
