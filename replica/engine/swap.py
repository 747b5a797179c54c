"""The swap of a staged update into a serving engine: the one transaction, inside one pause.

Both engine kinds run it in the process that holds vLLM's ``AsyncLLM`` (our vLLM server and a
Dynamo worker serve it as their ``swap_in_pause`` route: `replica.engine.control`). Its steps:
pause (keep), label, write the stage in, the steps after the write (``after_write``), prove
(read back every swapped tensor against the stage's Adler-32), resume. Invariants: the resume
always runs; a failure or a proof of other than ``expected`` tensors discards the stage (every
rank back on its tensors) and puts the previous label back before the resume; a read-back that
differs is answered (``read_back_failed``), rolled back the same way. docs/design.md ("The hot-load walk")
tells the whole hot-load around it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from contracts.engine_ranks import combine_swap, slowest
from replica.engine import host_pauses

# A step between the write and the proof (the "swap" fault point's hold is one: `HeldSwap`).
AfterWrite = Callable[[], Awaitable[None]]
# How long a held swap waits for the agent's verdict before it rolls back on its own.
HOLD_LIMIT_S = 3660.0


async def pause_at_once(engine: Any, clear_cache: bool, mode: str = "keep") -> None:
    """``engine.pause_generation(mode=mode)`` without the 20 ms sleep vLLM 0.32's AsyncLLM ends it
    with (so that in-flight requests' last outputs reach their streams first, "not required for
    correctness", its comment says): the engine core's pause itself returns once no step is in
    flight, and the label every output carries is attached there, in step order, so the sleep
    orders nothing a label depends on. An engine without that core call pauses the usual way."""
    core: Any = getattr(engine, "engine_core", None)
    if not hasattr(core, "pause_scheduler_async") or not hasattr(engine, "renderer"):
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache:
        await engine.renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


@dataclass(frozen=True)
class SwapRequest:
    """What the agent asks: swap the stage ``label`` in, ``previous`` being the label served now."""

    label: str
    previous: str
    clear_cache: bool = False  # drop the KV cache at the pause (PromptCachePolicy.RESET_ALL)
    expected: int | None = None  # how many tensors the proof must count
    ranks: int = 1  # tensor-parallel ranks: each proves its shard
    hold: bool = False  # wait after the write for the agent's verdict (`HeldSwap`)

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> SwapRequest:
        label, previous, ranks = body.get("label"), body.get("previous"), body.get("ranks", 1)
        if not isinstance(label, str) or not isinstance(previous, str):
            raise ValueError("'label' and 'previous' (strings) are required")
        if not isinstance(ranks, int) or ranks < 1:
            raise ValueError("'ranks' must be a positive integer")
        expected = body.get("expected")
        return cls(
            label,
            previous,
            bool(body.get("clear_cache", False)),
            None if expected is None else int(expected),
            ranks,
            bool(body.get("hold", False)),
        )


class _Laps:
    """The pause's parts in ms (``pause``, ``label``, ``swap``, ``resume``) and its ``window``."""

    def __init__(self) -> None:
        self.start = self.mark = time.perf_counter()
        self.ms: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.ms[name] = round((now - self.mark) * 1000, 3)
        self.mark = now
        if name == "resume":
            self.ms["window"] = round((now - self.start) * 1000, 3)


async def swap_in_pause(engine: Any, request: SwapRequest, after_write: Sequence[AfterWrite] = ()) -> dict[str, Any]:
    """The transaction (module docstring) over vLLM's ``engine``; answers the ranks' combined
    report (``verified``, or ``read_back_failed``) and ``timings_ms`` (the pause's parts and its
    window, all measured here: no hop between the agent and the engine falls inside the pause)."""
    with host_pauses.pausing():  # the host's other engines' stages give way meanwhile
        return await _in_pause(engine, request, after_write)


async def _in_pause(engine: Any, request: SwapRequest, after_write: Sequence[AfterWrite]) -> dict[str, Any]:
    laps = _Laps()
    await pause_at_once(engine, request.clear_cache)
    laps.lap("pause")
    try:
        await engine.update_weight_version(request.label)
        laps.lap("label")
        try:
            result = await _write_and_prove(engine, request, after_write)
            laps.lap("swap")
            if result.get("read_back_failed"):  # every rank rolled its tensors back, or does now
                await _roll_back(engine, request.previous, discard=request.ranks > 1)
            elif request.expected is not None and int(result.get("verified", -1)) != request.expected:
                raise RuntimeError(
                    f"the engine proved {result.get('verified')} of {request.expected} swapped tensor(s)"
                )
        except BaseException:
            await _roll_back(engine, request.previous, discard=True)
            raise
    finally:
        await engine.resume_generation()
        laps.lap("resume")
    if request.ranks > 1 and "verified" in result:  # every rank proved its shard: the stage is committed
        await engine.collective_rpc(method="release_staged", args=(request.label,))
    return {"result": result, "timings_ms": laps.ms}


async def _write_and_prove(engine: Any, request: SwapRequest, after_write: Sequence[AfterWrite]) -> dict[str, Any]:
    """Write the stage in and prove it: one call to every rank when nothing runs between the two
    (``swap_and_commit_staged``), else ``swap_staged``, the ``after_write`` steps, ``commit_staged``.
    A tensor-parallel engine's ranks hold their proven stages until all proved."""
    # Each proven tensor's checksum stays in the engine: the transaction needs only the count.
    proof_args = (request.label, request.ranks > 1, False)
    if not after_write:
        return _combined(await engine.collective_rpc(method="swap_and_commit_staged", args=proof_args), request)
    written = slowest(_counted(await engine.collective_rpc(method="swap_staged", args=(request.label,)), request))
    for step in after_write:
        await step()
    proof = _combined(await engine.collective_rpc(method="commit_staged", args=proof_args), request)
    return proof if proof.get("read_back_failed") else {**written, **proof}


def _counted(results: Any, request: SwapRequest) -> list[dict[str, Any]]:
    if len(results or []) != request.ranks:
        raise RuntimeError(f"expected {request.ranks} worker result(s), got {len(results or [])}")
    return list(results)


def _combined(results: Any, request: SwapRequest) -> dict[str, Any]:
    return combine_swap(_counted(results, request))


async def _roll_back(engine: Any, previous: str, *, discard: bool) -> None:
    """Discard the stage (a swapped one goes back on every rank), then restore the label; best
    effort, as the caller is already failing or answering the read-back's failure."""
    if discard:
        with contextlib.suppress(Exception):
            await engine.collective_rpc(method="discard_staged")
    with contextlib.suppress(Exception):
        await engine.update_weight_version(previous)


class HeldSwap:
    """The "swap" fault point, engine side (`replica.faults`): a swap asked with ``hold`` stops
    after its write, paused and labelled, until the agent's verdict (``swap_hook``): proceed to
    the proof, or roll back. One engine holds at most one swap; it rolls back by itself after
    :data:`HOLD_LIMIT_S` without a verdict."""

    def __init__(self) -> None:
        self._task: asyncio.Task[dict[str, Any]] | None = None
        self._verdict: asyncio.Future[bool] | None = None

    async def start(self, engine: Any, request: SwapRequest) -> dict[str, Any]:
        """Run the swap up to its hold; answers ``{"held": True}``, or the swap's own answer
        (or error) when it ended before the hold."""
        if self._task is not None and not self._task.done():
            raise ValueError("a swap is already held")
        arrived = asyncio.Event()
        verdict = self._verdict = asyncio.get_running_loop().create_future()

        async def hold() -> None:
            arrived.set()
            if not await asyncio.wait_for(asyncio.shield(verdict), HOLD_LIMIT_S):
                raise RuntimeError("the agent stopped the swap where it was held")

        task = self._task = asyncio.ensure_future(swap_in_pause(engine, request, after_write=(hold,)))
        waiting = asyncio.ensure_future(arrived.wait())
        await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done():
            self._task = None
            return task.result()
        return {"held": True}

    async def finish(self, proceed: bool) -> dict[str, Any]:
        """Give the held swap its verdict and answer what it then answers."""
        task, verdict = self._task, self._verdict
        if task is None or verdict is None:
            raise ValueError("no swap is held")
        self._task = self._verdict = None
        if not verdict.done():
            verdict.set_result(proceed)
        return await task
