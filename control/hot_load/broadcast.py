"""The broadcast: the first replica sends the update to every other replica at once.

One `Broadcast` per hot-load, from the first replica (the sender, rank 0) to the receivers
(ranks 1.., in walk order), over one process group between the engines:

- `start(from_stage=...)` asks the sender for an offer (`offer_to_peer`) and, once it has one,
  starts the sender's side (`send_to_peers`) and every receiver's stage (`stage_from_peer`: join
  the group, receive, check against the sender's checksums, stage). Nothing any replica serves
  changes. With `from_stage` the sender is still updating from the bucket and offers the delta
  link's files as soon as its own stage has checked them (before its swap); it refuses when its
  update holds no such files, and the walk starts again after its commit.
- `offered()` is whether the last start got an offer.
- `ready(name)` waits for that receiver's stage: True once it holds a checked stage, False when
  there is no offer or its stage failed (it reads the bucket instead). A stage is checked against
  the sender's checksums, so one that succeeded is good whatever became of the others.
- `abandon()` cancels the offer, the send and every stage (the walk failed or was canceled);
  the receivers only staged, and each agent orders a stage before its next step, so the walk
  does not wait for them.
- `end()` waits for the send: a failed send was already answered by the receivers reading the
  bucket.

Peer steps are tried once (control/hot_load/options.py); the bucket is the retry.
"""

from __future__ import annotations

import asyncio
from typing import Any

from temporalio import workflow
from temporalio.exceptions import is_cancelled_exception

from control.hot_load.options import PEER_STEP
from control.hot_load.state import error_reason

with workflow.unsafe.imports_passed_through():
    from contracts import names
    from contracts.activities import PeerOffer, PeerOfferInput, StageFromPeerInput, StageFromPeerResult
    from contracts.records import HotLoadSpec, Replica, ReplicaEndpoint


class Broadcast:
    def __init__(
        self, spec: HotLoadSpec, sender: ReplicaEndpoint, receivers: list[tuple[Replica, ReplicaEndpoint]]
    ) -> None:
        self.spec = spec
        self.sender = sender
        self.receivers = receivers
        self._offer: asyncio.Future[PeerOffer | None] | None = None
        self._send: asyncio.Future[Any] | None = None
        self._stages: dict[str, asyncio.Future[bool]] = {}

    def start(self, *, from_stage: bool) -> None:
        self._offer = asyncio.ensure_future(self._open(from_stage))

    async def offered(self) -> bool:
        return self._offer is not None and await self._offer is not None

    async def ready(self, name: str) -> bool:
        if not await self.offered():
            return False
        return await self._stages[name]

    def abandon(self) -> None:
        for task in [self._offer, self._send, *self._stages.values()]:
            if task is not None and not task.done():
                task.cancel()

    async def end(self) -> None:
        if self._send is None:
            return
        try:
            await self._send
        except Exception as exc:
            if is_cancelled_exception(exc):
                raise

    # ------------------------------------------------------------------ steps
    async def _open(self, from_stage: bool) -> PeerOffer | None:
        offer = await self._ask(from_stage)
        if offer is not None:
            self._send = asyncio.ensure_future(workflow.execute_activity(
                names.SEND_TO_PEERS, offer, task_queue=self.sender.task_queue,
                summary=f"send {self.spec.identity} ({offer.mode}) to {len(self.receivers)} peer(s)", **PEER_STEP,
            ))
            self._stages = {
                replica.name: asyncio.ensure_future(self._stage(offer, rank, replica, endpoint))
                for rank, (replica, endpoint) in enumerate(self.receivers, start=1)
            }
        return offer

    async def _ask(self, from_stage: bool) -> PeerOffer | None:
        """The sender's offer to every receiver (None: no offer, they read the bucket)."""
        serving = {r.current_snapshot_identity for r, _ in self.receivers}
        when = "from its stage" if from_stage else "after its commit"
        try:
            return await workflow.execute_activity(
                names.OFFER_TO_PEER,
                PeerOfferInput(
                    hot_load_id=self.spec.id, identity=self.spec.identity, chain=self.spec.snapshot_chain,
                    # Receivers on different snapshots get every tensor ("" is no identity).
                    target_identity=serving.pop() if len(serving) == 1 else "",
                    world_size=1 + len(self.receivers),
                    accept_files=True,
                    host_store=True,
                    from_stage=from_stage,
                ),
                task_queue=self.sender.task_queue,
                result_type=PeerOffer,
                summary=f"offer {self.spec.identity} from {self.sender.name} {when}",
                **PEER_STEP,
            )
        except Exception as exc:
            if is_cancelled_exception(exc):
                raise
            workflow.logger.warning("no peer offer from %s %s (%s)", self.sender.name, when, error_reason(exc))
            return None

    async def _stage(self, offer: PeerOffer, rank: int, replica: Replica, endpoint: ReplicaEndpoint) -> bool:
        try:
            await workflow.execute_activity(
                names.STAGE_FROM_PEER,
                StageFromPeerInput(offer=offer, rank=rank),
                task_queue=endpoint.task_queue,
                result_type=StageFromPeerResult,
                summary=f"stage {self.spec.identity} from {self.sender.name} on {replica.name} (rank {rank})",
                **PEER_STEP,
            )
            return True
        except Exception as exc:
            if is_cancelled_exception(exc):
                raise
            workflow.logger.warning("%s did not stage from %s (%s): it reads the bucket", replica.name,
                                    self.sender.name, error_reason(exc))
            return False
