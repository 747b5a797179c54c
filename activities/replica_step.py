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
from typing import TYPE_CHECKING

from temporalio import activity
from temporalio.exceptions import ApplicationError

from workflows import names
from workflows.errors import NON_RETRYABLE_SNAPSHOT
from workflows.types import (
    ApplySnapshotInput,
    ApplySnapshotResult,
    PeerOffer,
    PeerOfferInput,
    PromptCachePolicy,
    ReceiveFromPeerInput,
)

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
                # A cancel arriving mid-step waits for the engine step to finish or roll back, so
                # a replica never stays paused or serves a mix of weights; the step then reports
                # what the replica really serves.
                step = asyncio.ensure_future(rt.apply_from_bucket(inp))
                try:
                    return await asyncio.shield(step)
                except asyncio.CancelledError:
                    return await step
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
            return await asyncio.to_thread(self.runtime.make_offer, inp)
        except SnapshotError as exc:
            raise ApplicationError(str(exc), type="PeerOfferRefused", non_retryable=True) from None

    @activity.defn(name=names.SEND_TO_PEER)
    async def send_to_peer(self, offer: PeerOffer) -> int:
        heartbeat = asyncio.create_task(_heartbeat_forever())
        try:
            return await self.runtime.send_to_peer(offer)
        finally:
            heartbeat.cancel()

    @activity.defn(name=names.RECEIVE_FROM_PEER)
    async def receive_from_peer(self, inp: ReceiveFromPeerInput) -> ApplySnapshotResult:
        from snapshots.errors import SnapshotError

        rt = self.runtime
        async with rt.lock:
            heartbeat = asyncio.create_task(_heartbeat_forever())
            try:
                swap = asyncio.ensure_future(rt.receive_from_peer(inp.offer, inp.prompt_cache_policy))
                try:
                    return await asyncio.shield(swap)
                except asyncio.CancelledError:
                    return await swap  # finish or roll back; never leave the engine paused
            except SnapshotError as exc:
                raise ApplicationError(str(exc), type=NON_RETRYABLE_SNAPSHOT, non_retryable=True) from None
            finally:
                heartbeat.cancel()
