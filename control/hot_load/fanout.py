"""The fan-out: replicas that hold the update pass it on, `fan_out` receivers at a time.

One `FanOut` per set of receivers (a hot-load's, or one stage group's), in walk order. Each free
sender (`add`: serving the update, or holding a checked stage of it) takes the next `fan_out`
waiting receivers into a group of its own (`offer_to_peer`, `send_to_peers`, `stage_from_peer`);
a receiver that staged becomes a sender, so N receivers take O(log N) rounds; `next(name)` puts
the receiver committed next first. Invariants: staging changes nothing any replica serves;
failures stay local (a failed receiver reads the bucket and sends nothing; a sender that offers
nothing is dropped and its receivers requeued); once `close`d with no sender left, every waiting
receiver reads the bucket (`ready` is False); `abandon` cancels every transfer without waiting.
Peer steps are tried once: the bucket is the retry. docs/design.md, "The hot-load walk".
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from temporalio import workflow
from temporalio.exceptions import is_cancelled_exception

from control.hot_load.options import PEER_STEP
from control.hot_load.state import error_reason

with workflow.unsafe.imports_passed_through():
    from contracts import names
    from contracts.activities import PeerOffer, PeerOfferInput, StageFromPeerInput, StageFromPeerResult
    from contracts.records import HotLoadSpec, ReplicaEndpoint


@dataclass
class _Sender:
    endpoint: ReplicaEndpoint
    staged: bool
    round: int
    # It staged the update from a peer (a receiver passing it on), not from the bucket.
    from_peer: bool = False


class FanOut:
    def __init__(
        self, spec: HotLoadSpec, receivers: list[ReplicaEndpoint], serving: dict[str, str], fan_out: int
    ) -> None:
        self.spec = spec
        self.fan_out = max(1, fan_out)
        self.serving = serving  # receiver name -> the snapshot it serves
        self.waiting: deque[ReplicaEndpoint] = deque(receivers)
        self.total = len(receivers)
        self.free: deque[_Sender] = deque()
        self.sending = 0
        self.closed = False
        self.outcomes: dict[str, bool] = {}
        self.rounds: dict[str, int] = {}
        self.errors: dict[str, str] = {}
        self.done_committing: set[str] = set()
        # Senders that offered nothing from their stage, until they swap the update in.
        self.dropped: dict[str, _Sender] = {}
        self._tasks: list[asyncio.Future[Any]] = []
        self._sends: list[asyncio.Future[Any]] = []
        self._loop: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ the walk's side
    def add(self, sender: ReplicaEndpoint, *, staged: bool, round: int = 0, from_peer: bool = False) -> None:
        self.free.append(_Sender(sender, staged, round, from_peer))
        if self._loop is None:
            self._loop = asyncio.ensure_future(self._run())

    def close(self) -> None:
        """No sender will be added but the receivers that stage."""
        self.closed = True
        if self._loop is None:
            self._loop = asyncio.ensure_future(self._run())

    def committed(self, name: str) -> None:
        """`name` swapped the update in: a sender that could not offer from its stage (it staged
        tensors, not files) offers what it now serves."""
        self.done_committing.add(name)
        sender = self.dropped.pop(name, None)
        if sender is not None:
            sender.staged = False
            self.free.append(sender)

    def next(self, name: str) -> None:
        """The walk needs `name` next: it goes to the head of the queue if it still waits."""
        for i, endpoint in enumerate(self.waiting):
            if endpoint.name == name:
                if i:
                    del self.waiting[i]
                    self.waiting.appendleft(endpoint)
                return

    async def ready(self, name: str) -> bool:
        """Whether `name` holds a checked stage; False (it reads the bucket) as soon as no
        sender is left to reach it."""
        self.next(name)
        await workflow.wait_condition(lambda: name in self.outcomes or (not self.free and self.sending == 0))
        if name not in self.outcomes:
            self.waiting = deque(r for r in self.waiting if r.name != name)
            self._settle(name, False, "no replica holds the update to pass on")
        return self.outcomes[name]

    def round(self, name: str) -> int | None:
        return self.rounds.get(name)

    def abandon(self) -> None:
        for task in [self._loop, *self._tasks]:
            if task is not None and not task.done():
                task.cancel()

    async def end(self) -> None:
        for send in self._sends:
            try:
                await send
            except Exception as exc:
                if is_cancelled_exception(exc):
                    raise

    # ------------------------------------------------------------------ the loop
    async def _run(self) -> None:
        """Until every receiver staged or reads the bucket: pair free senders with waiting receivers."""
        while True:
            await workflow.wait_condition(
                lambda: (
                    len(self.outcomes) == self.total
                    or (bool(self.waiting) and (bool(self.free) or (self.closed and self.sending == 0)))
                )
            )
            if len(self.outcomes) == self.total:
                return
            if not self.free:  # closed, nothing in flight, nobody to send: the bucket
                while self.waiting:
                    self._settle(self.waiting.popleft().name, False, "no replica holds the update to pass on")
                continue
            sender = self.free.popleft()
            batch = [self.waiting.popleft() for _ in range(min(self.fan_out, len(self.waiting)))]
            self.sending += 1
            self._tasks.append(asyncio.ensure_future(self._transfer(sender, batch)))

    def _settle(self, name: str, ok: bool, why: str = "") -> None:
        self.outcomes[name] = ok
        if why:
            self.errors[name] = why

    async def _transfer(self, sender: _Sender, batch: list[ReplicaEndpoint]) -> None:
        try:
            offer = await self._offer(sender, batch)
            if offer is None:  # the sender is dropped; its receivers wait for another
                self.waiting.extendleft(reversed(batch))
                if sender.staged and sender.endpoint.name in self.done_committing:
                    sender.staged = False  # it swapped the update in meanwhile: offer what it serves
                    self.free.append(sender)
                elif sender.staged:
                    self.dropped[sender.endpoint.name] = sender
                return
            send = asyncio.ensure_future(
                workflow.execute_activity(
                    names.SEND_TO_PEERS,
                    offer,
                    task_queue=sender.endpoint.task_queue,
                    summary=f"send {self.spec.identity} ({offer.mode}) to {', '.join(r.name for r in batch)}",
                    **PEER_STEP,
                )
            )
            self._sends.append(send)
            stages = [asyncio.ensure_future(self._stage(offer, rank, sender, r)) for rank, r in enumerate(batch, 1)]
            await asyncio.gather(send, *stages, return_exceptions=True)
            if send.done() and not send.cancelled() and send.exception() is None:
                self.free.append(sender)
        finally:
            self.sending -= 1

    async def _offer(self, sender: _Sender, batch: list[ReplicaEndpoint]) -> PeerOffer | None:
        serving = {self.serving.get(r.name, "") for r in batch}
        from_stage = sender.staged and sender.endpoint.name not in self.done_committing
        when = "from its stage" if from_stage else "as it serves it"
        try:
            offer: PeerOffer = await workflow.execute_activity(
                names.OFFER_TO_PEER,
                PeerOfferInput(
                    hot_load_id=self.spec.id,
                    identity=self.spec.identity,
                    chain=self.spec.snapshot_chain,
                    # Receivers on different snapshots get every tensor ("" is no identity).
                    target_identity=serving.pop() if len(serving) == 1 else "",
                    world_size=1 + len(batch),
                    accept_files=True,
                    host_store=True,
                    from_stage=from_stage,
                    peer_stage=from_stage and sender.from_peer,
                ),
                task_queue=sender.endpoint.task_queue,
                result_type=PeerOffer,
                summary=f"offer {self.spec.identity} from {sender.endpoint.name} {when} to {len(batch)} peer(s)",
                **PEER_STEP,
            )
            return offer
        except Exception as exc:
            if is_cancelled_exception(exc):
                raise
            workflow.logger.warning(
                "no offer from %s %s (%s): it passes nothing on", sender.endpoint.name, when, error_reason(exc)
            )
            return None

    async def _stage(self, offer: PeerOffer, rank: int, sender: _Sender, receiver: ReplicaEndpoint) -> None:
        try:
            await workflow.execute_activity(
                names.STAGE_FROM_PEER,
                StageFromPeerInput(offer=offer, rank=rank),
                task_queue=receiver.task_queue,
                result_type=StageFromPeerResult,
                summary=f"stage {self.spec.identity} from {sender.endpoint.name} on {receiver.name} "
                f"(round {sender.round + 1}, rank {rank})",
                **PEER_STEP,
            )
        except Exception as exc:
            if is_cancelled_exception(exc):
                raise
            why = error_reason(exc)
            workflow.logger.warning(
                "%s did not stage from %s (%s): it reads the bucket", receiver.name, sender.endpoint.name, why
            )
            self._settle(receiver.name, False, why)
            return
        self.rounds[receiver.name] = sender.round + 1
        self._settle(receiver.name, True)
        self.free.append(_Sender(receiver, staged=True, round=sender.round + 1, from_peer=True))
