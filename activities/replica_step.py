"""The replica step (task queue `replica/DEPLOYMENT/NAME`, run by that replica's agent).

`apply_snapshot` moves one replica to a snapshot chain, all-or-nothing:

1. Stage, while the engine keeps serving: apply to the host copy only the chain links this
   replica is missing (a new full base replaces the copy; deltas are decoded, XORed and checked
   against their Adler-32 by `snapshots`), and write the changed tensors to a staging file.
2. Pause the engine with `mode=keep` (in-flight requests and their KV cache stay), load the
   changed tensors in place, reset the prefix cache under RESET_ALL, resume.

If anything fails, the host copy is restored and the engine is given back the tensors it had, so
the replica serves exactly its previous weights; the error names the cause. Snapshot errors
(checksum, missing file, bad format) are non-retryable. The step heartbeats while it stages, so a
cancel or a lost agent is noticed within seconds.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from temporalio import activity
from temporalio.exceptions import ApplicationError

from workflows import names
from workflows.errors import NON_RETRYABLE_SNAPSHOT
from workflows.types import ApplySnapshotInput, ApplySnapshotResult, PromptCachePolicy

if TYPE_CHECKING:
    from replica.agent import ReplicaRuntime


class ReplicaActivities:
    def __init__(self, runtime: ReplicaRuntime) -> None:
        self.runtime = runtime

    @activity.defn(name=names.APPLY_SNAPSHOT)
    async def apply_snapshot(self, inp: ApplySnapshotInput) -> ApplySnapshotResult:
        from snapshots.errors import SnapshotError

        rt = self.runtime
        async with rt.lock:
            heartbeat = asyncio.create_task(_heartbeat_forever())
            try:
                try:
                    staged = await asyncio.to_thread(rt.stage_chain, inp)
                except SnapshotError as exc:
                    raise ApplicationError(str(exc), type=NON_RETRYABLE_SNAPSHOT, non_retryable=True) from None
                if staged.nothing_to_do:
                    return ApplySnapshotResult(
                        identity=inp.identity, engine_pid=rt.engine.pid, tensors_loaded=0,
                        bytes_read_from_bucket=staged.bytes_read, pause_ms=0.0, links_applied=[],
                    )
                t0 = time.perf_counter()
                # A cancel arriving now waits for the engine step to finish or roll back, so a
                # replica never stays paused or serves a mix of weights; the step then reports
                # what the replica really serves.
                swap = asyncio.ensure_future(self._swap_in_engine(staged, inp))
                try:
                    await asyncio.shield(swap)
                except asyncio.CancelledError:
                    await swap
                pause_ms = (time.perf_counter() - t0) * 1000
                rt.commit(staged, inp)
                return ApplySnapshotResult(
                    identity=inp.identity,
                    engine_pid=rt.engine.pid,
                    tensors_loaded=len(staged.names),
                    bytes_read_from_bucket=staged.bytes_read,
                    pause_ms=pause_ms,
                    links_applied=staged.links,
                )
            finally:
                heartbeat.cancel()

    async def _swap_in_engine(self, staged, inp: ApplySnapshotInput) -> None:
        rt = self.runtime
        # RESET_ALL: clear the KV cache at the pause, so paused requests are recomputed on the new
        # weights after the resume and no prefix computed under the old ones is reused.
        reset = inp.prompt_cache_policy == PromptCachePolicy.RESET_ALL
        try:
            await rt.engine.pause(mode="keep", clear_cache=reset)
            try:
                await rt.engine.load_weights_from_files([str(staged.path)], staged.names)
            finally:
                await rt.engine.resume()
        except Exception as exc:
            await rt.roll_back(staged)
            raise ApplicationError(
                f"loading {len(staged.names)} tensor(s) into the engine failed, previous weights "
                f"restored: {exc}",
                type="EngineLoadFailed",
            ) from None


async def _heartbeat_forever(every: float = 2.0) -> None:
    while True:
        activity.heartbeat()
        await asyncio.sleep(every)
