"""The replica step (task queue `deployments/ORG/ID/replicas/NAME`, run by that replica's agent).

`apply_snapshot` moves one replica to a snapshot chain, all-or-nothing:

1. Stage, while the engine keeps serving: fetch the delta links this replica is missing (their
   files hold only the changed tensors) and decode them once, by the host copy, into shared
   memory (every changed tensor's Adler-32 checked); the engine stages views of those bytes,
   with the host copy (also in shared memory) as its roll-back source. A new full base goes
   through a staging file instead. From here on the delta's checked files may be offered to
   peers (`PeerOfferInput.from_stage`).
2. Pause the engine with `mode=keep` (in-flight requests and their KV cache stay; RESET_ALL drops
   the cache), set the weight version, swap the staged tensors in place and read back their
   Adler-32 (the served-weights proof, before anything is served), resume.
3. Commit: the replica serves the chain; the host copy takes the same bytes on a thread, which
   every later step waits for.

If anything fails, the host copy is restored and the engine is given back the tensors it had, so
the replica serves exactly its previous weights; the error names the cause. Snapshot errors
(checksum, missing file, bad format) are non-retryable. The step heartbeats while it stages, so a
cancel or a lost agent is noticed within seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from temporalio import activity
from temporalio.exceptions import ApplicationError

from contracts import names
from contracts.activities import (
    ApplySnapshotInput,
    ApplySnapshotResult,
    CommitPeerStageInput,
    PeerOffer,
    PeerOfferInput,
    StageFromPeerInput,
    StageFromPeerResult,
)
from contracts.errors import NON_RETRYABLE_SNAPSHOT

if TYPE_CHECKING:
    from replica.agent import ReplicaRuntime


class ReplicaActivities:
    def __init__(self, runtime: ReplicaRuntime) -> None:
        self.runtime = runtime

    @activity.defn(name=names.APPLY_SNAPSHOT)
    async def apply_snapshot(self, inp: ApplySnapshotInput) -> ApplySnapshotResult:
        return await _replica_step(self.runtime, lambda: self.runtime.apply_from_bucket(inp))


async def _replica_step(rt: ReplicaRuntime, step: Callable[[], Awaitable[ApplySnapshotResult]]) -> ApplySnapshotResult:
    """Run one weight-changing step on this replica: one at a time, heartbeating, and to the end.

    A cancel arriving mid-step waits for the engine step to finish or roll back, so a replica
    never stays paused or serves a mix of weights; the step then reports what the replica really
    serves. A bad snapshot is a non-retryable error."""
    from snapshots.errors import SnapshotError

    async with rt.lock:
        heartbeat = asyncio.create_task(_heartbeat_forever())
        try:
            running = asyncio.ensure_future(step())
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                return await running
        except SnapshotError as exc:
            raise ApplicationError(str(exc), type=NON_RETRYABLE_SNAPSHOT, non_retryable=True) from None
        finally:
            heartbeat.cancel()


async def _heartbeat_forever(every: float = 2.0) -> None:
    while True:
        activity.heartbeat()
        await asyncio.sleep(every)


class PeerActivities:
    """Weights passed replica to replica: the sender offers, then both ends join one group.

    The broadcast walk (`send_to_peers`, `stage_from_peer`, `commit_peer_stage`): the updated
    replica sends to every other replica at once while all of them keep serving; each receiver
    checks what it got and stages it (engine and host copy); then, one replica at a time, a
    commit swaps the stage in inside one short pause and proves the served bytes. For a delta
    link, the first replica offers its files as soon as its own update from the bucket has
    checked them (`PeerOfferInput.from_stage`), so the receivers stage while it swaps; they
    commit only after it.

    The sender streams the changed tensors from its engine (not from the bucket) over a
    torch.distributed group between the two engine processes (gloo on CPU, NCCL on GPU). The
    receiver checks every tensor's Adler-32 against the sender's verified host copy before its
    engine changes, loads all-or-nothing inside one pause, then updates its own host copy from
    what its engine now holds. It reads zero bytes from the bucket.
    """

    def __init__(self, runtime: ReplicaRuntime) -> None:
        self.runtime = runtime

    @activity.defn(name=names.OFFER_TO_PEER)
    async def offer_to_peer(self, inp: PeerOfferInput) -> PeerOffer:
        from snapshots.errors import SnapshotError

        try:
            if inp.from_stage:
                # Waits for this replica's own update to stage: heartbeat meanwhile.
                heartbeat = asyncio.create_task(_heartbeat_forever())
                try:
                    return await self.runtime.make_offer_from_stage(inp)
                finally:
                    heartbeat.cancel()
            await self.runtime.settled()  # the host copy has taken the last update
            return await asyncio.to_thread(self.runtime.make_offer, inp)
        except SnapshotError as exc:
            raise ApplicationError(str(exc), type="PeerOfferRefused", non_retryable=True) from None

    @activity.defn(name=names.SEND_TO_PEERS)
    async def send_to_peers(self, offer: PeerOffer) -> int:
        heartbeat = asyncio.create_task(_heartbeat_forever())
        try:
            return await self.runtime.send_to_peers(offer)
        finally:
            heartbeat.cancel()

    @activity.defn(name=names.STAGE_FROM_PEER)
    async def stage_from_peer(self, inp: StageFromPeerInput) -> StageFromPeerResult:
        from snapshots.errors import SnapshotError

        # Under the replica's lock: a stage must not interleave with another weight change.
        async with self.runtime.lock:
            heartbeat = asyncio.create_task(_heartbeat_forever())
            try:
                return await self.runtime.stage_from_peer(inp.offer, inp.rank)
            except SnapshotError as exc:
                raise ApplicationError(str(exc), type="PeerOfferRefused", non_retryable=True) from None
            finally:
                heartbeat.cancel()

    @activity.defn(name=names.COMMIT_PEER_STAGE)
    async def commit_peer_stage(self, inp: CommitPeerStageInput) -> ApplySnapshotResult:
        return await _replica_step(
            self.runtime, lambda: self.runtime.commit_peer_stage(inp.identity, inp.prompt_cache_policy)
        )
