"""The replica steps (task queue `deployments/ORG/ID/replicas/NAME`, run by that replica's agent).

`apply_snapshot` moves one replica to a snapshot chain, all or nothing: stage while serving,
then one pause that labels, swaps and proves, then commit (the host copy takes the same bytes).
Invariants: on any failure the host copy is restored and the engine serves exactly its previous
weights, and the error names the cause; snapshot errors (`NON_RETRYABLE_SNAPSHOT`) and a failed
read-back (`READ_BACK_FAILED`, naming the tensors) are non-retryable; every step heartbeats, so
a cancel or a lost agent is noticed within seconds. docs/design.md, "The hot-load walk".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from contracts import names
from contracts.activities import (
    ApplySnapshotInput,
    ApplySnapshotResult,
    CommitPeerStageInput,
    DrainInput,
    PeerOffer,
    PeerOfferInput,
    StageFromPeerInput,
    StageFromPeerResult,
)
from contracts.errors import NON_RETRYABLE_SNAPSHOT, PEER_OFFER_REFUSED, READ_BACK_FAILED
from replica.agent.engine_rpc import ReadBackFailed
from replica.agent.metrics import ReplicaMetrics
from replica.agent.runtime import ReplicaRuntime
from snapshots.errors import SnapshotError

DETAIL_NAMES = 64  # tensors named in a failed read-back's details (its message counts them all)


def metrics_of(runtime: ReplicaRuntime) -> ReplicaMetrics:
    return ReplicaMetrics(runtime.deployment, runtime.name, "")


class ReplicaActivities:
    def __init__(self, runtime: ReplicaRuntime, metrics: ReplicaMetrics | None = None) -> None:
        self.runtime = runtime
        self.metrics = metrics or metrics_of(runtime)

    @activity.defn(name=names.APPLY_SNAPSHOT)
    async def apply_snapshot(self, inp: ApplySnapshotInput) -> ApplySnapshotResult:
        return await measured_step(
            self.metrics, names.APPLY_SNAPSHOT, replica_step(self.runtime, lambda: self.runtime.apply_from_bucket(inp))
        )

    @activity.defn(name=names.SERVE_REPLICA)
    async def serve_replica(self) -> None:
        """Scale-out: the deployment makes this joining replica a member. A Dynamo worker enters
        its frontend's routing pool (a vLLM server is routed to by the gateway's replica list)."""
        await self.runtime.engine.serve()

    @activity.defn(name=names.DRAIN_REPLICA)
    async def drain_replica(self, inp: DrainInput) -> float:
        """Scale-in: this replica is out of the deployment's rotation. A Dynamo worker leaves its
        frontend's routing pool; after `grace_seconds` for routers to notice, the engine pauses
        with ``mode=wait``: it takes no new request and returns once every request it held has
        finished. Returns the seconds that took; the deployment then stops the replica."""
        async with heartbeating(), self.runtime.lock:  # no weight change under way (none starts after)
            start = time.perf_counter()
            await self.runtime.engine.leave_pool()
            await asyncio.sleep(inp.grace_seconds)
            await self.runtime.engine.pause(mode="wait")
            return time.perf_counter() - start


async def measured_step(
    metrics: ReplicaMetrics, name: str, step: Awaitable[ApplySnapshotResult]
) -> ApplySnapshotResult:
    """A weight-changing step, counted and timed (replica/agent/metrics.py): its pause, the bytes
    it read from the bucket, the snapshot the replica serves after it."""
    with metrics.step(name, changes_weights=True):
        result = await step
    metrics.paused(result.pause_ms, result.swap_bytes)
    metrics.took_in("bucket", result.bytes_read_from_bucket)
    metrics.serving(result.identity)
    return result


async def replica_step(rt: ReplicaRuntime, step: Callable[[], Awaitable[ApplySnapshotResult]]) -> ApplySnapshotResult:
    """Run one weight-changing step on this replica: one at a time, heartbeating, and to the end.

    A cancel arriving mid-step waits for the engine step to finish or roll back, so a replica
    never stays paused or serves a mix of weights (a fault point's hold ends then: `step_canceled`);
    the step then reports what the replica really serves. A bad snapshot and a failed read-back
    are non-retryable errors."""
    async with rt.lock:
        rt.step_canceled.clear()
        try:
            async with heartbeating():
                running = asyncio.ensure_future(step())
                try:
                    return await asyncio.shield(running)
                except asyncio.CancelledError:
                    rt.step_canceled.set()
                    return await running
        except SnapshotError as exc:
            raise ApplicationError(str(exc), type=NON_RETRYABLE_SNAPSHOT, non_retryable=True) from None
        except ReadBackFailed as exc:
            # The first names only: a failure's details are a Temporal payload (2 MB at most), and a
            # model's every tensor can be tens of thousands of names.
            raise ApplicationError(
                str(exc), exc.tensors[:DETAIL_NAMES], type=READ_BACK_FAILED, non_retryable=True
            ) from None


@contextlib.asynccontextmanager
async def heartbeating(every: float = 2.0) -> AsyncIterator[None]:
    """Heartbeats the running activity every ``every`` seconds while the block runs, so Temporal
    sees a long step alive and delivers a cancel to it."""

    async def forever() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(every)

    task = asyncio.create_task(forever())
    try:
        yield
    finally:
        task.cancel()


class PeerActivities:
    """Weights passed replica to replica (`send_to_peers`, `stage_from_peer`, `commit_peer_stage`).

    Receivers stage while every replica serves and commit one at a time, in one short pause with
    the proof; each checks every tensor's (file's) Adler-32 against the sender's before it stages
    anything and reads nothing from the bucket (`replica.agent.peers`).
    """

    def __init__(self, runtime: ReplicaRuntime, metrics: ReplicaMetrics | None = None) -> None:
        self.runtime = runtime
        self.metrics = metrics or metrics_of(runtime)

    @activity.defn(name=names.OFFER_TO_PEER)
    async def offer_to_peer(self, inp: PeerOfferInput) -> PeerOffer:
        with self.metrics.step(names.OFFER_TO_PEER):
            return await self._offer(inp)

    async def _offer(self, inp: PeerOfferInput) -> PeerOffer:
        try:
            if inp.from_stage:
                async with heartbeating():  # waits for this replica's own update to stage
                    return await self.runtime.make_offer_from_stage(inp)
            await self.runtime.settled()  # the host copy has taken the last update
            return await asyncio.to_thread(self.runtime.make_offer, inp)
        except SnapshotError as exc:
            raise ApplicationError(str(exc), type=PEER_OFFER_REFUSED, non_retryable=True) from None

    @activity.defn(name=names.SEND_TO_PEERS)
    async def send_to_peers(self, offer: PeerOffer) -> int:
        async with heartbeating():
            with self.metrics.step(names.SEND_TO_PEERS):
                sent = await self.runtime.send_to_peers(offer)
            self.metrics.sent(sent)
            return sent

    @activity.defn(name=names.STAGE_FROM_PEER)
    async def stage_from_peer(self, inp: StageFromPeerInput) -> StageFromPeerResult:
        with self.metrics.step(names.STAGE_FROM_PEER):
            result = await self._stage(inp)
        self.metrics.took_in("peer", result.bytes_received)
        return result

    async def _stage(self, inp: StageFromPeerInput) -> StageFromPeerResult:
        # Under the replica's lock: a stage must not interleave with another weight change.
        async with self.runtime.lock, heartbeating():
            try:
                return await self.runtime.stage_from_peer(inp.offer, inp.rank)
            except SnapshotError as exc:
                raise ApplicationError(str(exc), type=PEER_OFFER_REFUSED, non_retryable=True) from None

    @activity.defn(name=names.COMMIT_PEER_STAGE)
    async def commit_peer_stage(self, inp: CommitPeerStageInput) -> ApplySnapshotResult:
        return await measured_step(
            self.metrics,
            names.COMMIT_PEER_STAGE,
            replica_step(self.runtime, lambda: self.runtime.commit_peer_stage(inp.identity, inp.prompt_cache_policy)),
        )
