"""One SIMULATED replica (a stand-in for scale runs; see replica/simulated/__init__.py): the real
replica steps' contracts, answered without an engine.

A small host copy (`state_bytes`) stands for its weights; a snapshot's content is a
deterministic function of its identity, so every commit checks the served bytes' Adler-32
against the identity's (the proof). `apply_snapshot` really reads the chain's newest link from
the bucket; peer transfers move no bytes and take `transfer_ms`; a commit is timed (`pauseMs`)
and sleeps `pause_ms` if set. One step runs at a time. The fault points of replica/faults.py
read the simulated node's `faults.json`, so a replica fails or stalls as a real agent would.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
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
from contracts.errors import PEER_OFFER_REFUSED
from replica import faults
from snapshots.codec import adler32_hex

ENGINE = "simulated"


def content(identity: str, nbytes: int) -> np.ndarray:
    """The simulated weights of snapshot `identity`: `nbytes` bytes derived from its name."""
    seed = int.from_bytes(hashlib.sha256(identity.encode()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@dataclass
class Behaviour:
    """How the simulated replicas of one process behave (`rollouts sim-node` flags)."""

    state_bytes: int = 4096
    transfer_ms: float = 50.0
    pause_ms: float = 0.0
    faults_home: Path | None = None
    # bytes of a link in the bucket, by prefix: read once per process, as every replica's link is the same
    link_bytes: dict[str, int] = field(default_factory=dict)


class SimulatedReplica:
    def __init__(self, *, name: str, deployment: str, behaviour: Behaviour, s3: Any) -> None:
        self.name = name
        self.deployment = deployment
        self.b = behaviour
        self.s3 = s3
        self.serving = "initial"
        self.served = content("initial", behaviour.state_bytes)
        self.staged: tuple[str, np.ndarray] | None = None
        self.stage_source = "peer"
        self.lock = asyncio.Lock()

    def activities(self) -> list[Any]:
        return [
            self.apply_snapshot,
            self.offer_to_peer,
            self.send_to_peers,
            self.stage_from_peer,
            self.commit_peer_stage,
            self.serve_replica,
            self.drain_replica,
        ]

    async def _fault(self, point: str) -> None:
        if self.b.faults_home is not None:
            await faults.hit(self.b.faults_home, point, replica=self.name, deployment=self.deployment)

    def _read_link(self, bucket: str, prefix: str) -> int:
        """Every object of the link, read for real; its size in bytes."""
        total, token = 0, None
        while True:
            kw: dict[str, str] = {"ContinuationToken": token} if token else {}
            page = self.s3.list_objects_v2(Bucket=bucket, Prefix=prefix, **kw)
            for obj in page.get("Contents", []):
                total += len(self.s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read())
            token = page.get("NextContinuationToken")
            if not token:
                return total

    async def _commit(self, identity: str, *, bytes_read: int, source: str) -> ApplySnapshotResult:
        if self.staged is None or self.staged[0] != identity:
            raise ApplicationError(
                f"replica {self.name} holds no stage of {identity}", type="NoStage", non_retryable=True
            )
        await self._fault("pause")  # before the pause: a hold here is not part of it
        start = time.perf_counter()
        await self._fault("swap")
        staged = self.staged[1]
        self.served = staged.copy()
        if self.b.pause_ms:
            await asyncio.sleep(self.b.pause_ms / 1000)
        got, want = adler32_hex(self.served), adler32_hex(content(identity, self.b.state_bytes))
        pause_ms = (time.perf_counter() - start) * 1000
        if got != want:
            raise ApplicationError(
                f"read-back of {self.name}: {got} != {want}", type="ReadBackFailed", non_retryable=True
            )
        self.serving, self.staged = identity, None
        return ApplySnapshotResult(
            identity=identity,
            engine_pid=0,
            tensors_loaded=1,
            bytes_read_from_bucket=bytes_read,
            pause_ms=pause_ms,
            links_applied=[identity],
            source=source,
            verified_tensors=1,
        )

    @activity.defn(name=names.APPLY_SNAPSHOT)
    async def apply_snapshot(self, inp: ApplySnapshotInput) -> ApplySnapshotResult:
        async with self.lock:
            await self._fault("apply_snapshot")
            prefix = f"{inp.path_prefix}/{inp.identity}/"
            nbytes = await asyncio.to_thread(self._read_link, inp.bucket, prefix)
            self.b.link_bytes[inp.identity] = nbytes
            self.staged = (inp.identity, content(inp.identity, self.b.state_bytes))
            return await self._commit(inp.identity, bytes_read=nbytes, source="bucket")

    @activity.defn(name=names.OFFER_TO_PEER)
    async def offer_to_peer(self, inp: PeerOfferInput) -> PeerOffer:
        holds = self.serving == inp.identity or (self.staged is not None and self.staged[0] == inp.identity)
        if inp.peer_stage and not holds:
            raise ApplicationError(
                f"{self.name} holds no stage of {inp.identity} from a peer", type=PEER_OFFER_REFUSED, non_retryable=True
            )
        if inp.from_stage:
            # The real sender offers a delta's files once its own stage checked them.
            while self.serving != inp.identity and (self.staged is None or self.staged[0] != inp.identity):
                activity.heartbeat()
                await asyncio.sleep(0.02)
        return PeerOffer(
            source_replica=self.name,
            host="simulated",
            port=0,
            backend="simulated",
            base_identity=inp.target_identity,
            identity=inp.identity,
            chain=inp.chain,
            specs=[],
            expected_adler32={"state": adler32_hex(content(inp.identity, self.b.state_bytes))},
            world_size=inp.world_size,
            mode="files" if inp.from_stage else "tensors",
        )

    @activity.defn(name=names.SEND_TO_PEERS)
    async def send_to_peers(self, offer: PeerOffer) -> int:
        await asyncio.sleep(self.b.transfer_ms / 1000)
        return self.b.link_bytes.get(offer.identity, self.b.state_bytes)

    @activity.defn(name=names.STAGE_FROM_PEER)
    async def stage_from_peer(self, inp: StageFromPeerInput) -> StageFromPeerResult:
        async with self.lock:
            start = time.perf_counter()
            await asyncio.sleep(self.b.transfer_ms / 1000)
            await self._fault("stage_from_peer")
            data = content(inp.offer.identity, self.b.state_bytes)
            if adler32_hex(data) != inp.offer.expected_adler32.get("state"):
                raise ApplicationError(
                    f"{self.name}: the offer's checksum does not match", type=PEER_OFFER_REFUSED, non_retryable=True
                )
            self.staged = (inp.offer.identity, data)
            self.stage_source = f"peer:{inp.offer.source_replica}"
            return StageFromPeerResult(
                identity=inp.offer.identity,
                tensors_staged=1,
                bytes_received=self.b.link_bytes.get(inp.offer.identity, self.b.state_bytes),
                stage_ms=(time.perf_counter() - start) * 1000,
            )

    @activity.defn(name=names.SERVE_REPLICA)
    async def serve_replica(self) -> None:
        """A SIMULATED replica is routed to by no one: nothing to join."""

    @activity.defn(name=names.DRAIN_REPLICA)
    async def drain_replica(self, inp: DrainInput) -> float:
        """A SIMULATED replica serves no request: it has nothing to drain."""
        async with self.lock:
            return 0.0

    @activity.defn(name=names.COMMIT_PEER_STAGE)
    async def commit_peer_stage(self, inp: CommitPeerStageInput) -> ApplySnapshotResult:
        async with self.lock:
            await self._fault("commit_peer_stage")
            return await self._commit(inp.identity, bytes_read=0, source=self.stage_source)
