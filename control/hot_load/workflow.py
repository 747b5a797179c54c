"""The hot-load workflow: one per operation, workflow id = the hot-load id.

PENDING → IN_PROGRESS → COMPLETED | FAILED | CANCELED. Replicas are walked one at a time in
(zone, name) order; each step is one activity on that replica's own task queue, run by its agent
next to the engine: stage the snapshot, pause (keeping in-flight requests), apply in place,
verify, resume.

The first replica reads the snapshot from the bucket. Then it broadcasts the changed tensors to
every other replica at once over one process group (`send_to_peers` + `stage_from_peer`, all
replicas still serving), and each receiver in turn swaps its stage in (`commit_peer_stage`, one
short pause) as soon as its own stage is ready, while the later ones still stage (patched
`pipelined-commits`; before it, every stage was awaited first). For a delta, the broadcast
starts as soon as the first replica has checked the link's files, while it still swaps them in
(patched `early-broadcast`: the offer waits for its stage); the receivers still commit only
after it is READY, and if its update fails their stages are abandoned (nothing they serve
changed). Without such files it broadcasts after its commit. A replica whose stage or commit
fails reads the bucket instead. (Histories from
before the broadcast walk, unpatched, replay the pairwise transfer `_receive_from_peer`.) A replica's state goes PENDING_UPDATE → UPDATING → READY | ERROR, with
`startedAt`, `finishedAt`, `transitionedAt` and `errorReason`.

A failed step stops the walk (FAILED); replicas that already moved keep the new weights and the
rest keep theirs, and the replica list says which is which. A cancel stops before the next
replica step. The memo carries the wire objects after every change, so reads need no worker.
When it ends, the workflow tells its deployment (signal `hot_load_finished`).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, is_cancelled_exception

with workflow.unsafe.imports_passed_through():
    from contracts import names
    from contracts.activities import (
        ApplySnapshotInput,
        ApplySnapshotResult,
        CommitPeerStageInput,
        PeerOffer,
        PeerOfferInput,
        ReceiveFromPeerInput,
        StageFromPeerInput,
        StageFromPeerResult,
    )
    from contracts.errors import NON_RETRYABLE_SNAPSHOT
    from contracts.records import (
        Condition,
        ConditionStatus,
        HotLoad,
        HotLoadInput,
        HotLoadOutcome,
        HotLoadState,
        Replica,
        ReplicaEndpoint,
        ReplicaState,
        rfc3339,
    )
    from contracts.search import STATE

# A replica step retries what can heal (a replica briefly unreachable, a storage hiccup); a
# snapshot that is wrong (checksum, missing file, bad format) fails at once.
REPLICA_STEP_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=3,
    non_retryable_error_types=[NON_RETRYABLE_SNAPSHOT],
)
REPLICA_STEP_OPTIONS = dict(
    start_to_close_timeout=timedelta(minutes=15),
    # A step that no agent picks up means the replica is gone; a lost replica is restarted by its
    # deployment within seconds and needs a minute or two to start and catch up.
    schedule_to_start_timeout=timedelta(minutes=10),
    heartbeat_timeout=timedelta(seconds=30),
    retry_policy=REPLICA_STEP_RETRY,
    cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
)
# A peer step is tried once: on failure the replica reads the bucket instead.
PEER_STEP_OPTIONS = dict(
    start_to_close_timeout=timedelta(minutes=10),
    schedule_to_start_timeout=timedelta(minutes=1),
    heartbeat_timeout=timedelta(seconds=30),
    retry_policy=RetryPolicy(maximum_attempts=1),
    cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
)


def _error_reason(exc: BaseException) -> str:
    cause = exc.__cause__ if isinstance(exc, ActivityError) and exc.__cause__ else exc
    if isinstance(cause, ApplicationError):
        return cause.message
    return str(cause)


@workflow.defn
class HotLoadWorkflow:
    @workflow.init
    def __init__(self, inp: HotLoadInput) -> None:
        self.hot_load: HotLoad = inp.hot_load
        self._broadcast_send: asyncio.Future[Any] | None = None  # the pipelined walk's send
        self.replicas: list[Replica] = [
            Replica(
                name=r.name,
                state=ReplicaState.PENDING_UPDATE,
                zone=r.zone,
                current_snapshot_identity=r.current_snapshot_identity,
                transitioned_at=r.transitioned_at or r.started_at,
                updated_at=inp.hot_load.status.created_at,
            )
            for r in sorted(inp.replicas, key=lambda r: (r.zone, r.name))
        ]

    # ------------------------------------------------------------------ state
    def _now(self) -> str:
        return rfc3339(workflow.now())

    def _publish(self) -> None:
        workflow.upsert_memo(
            {"hotLoad": self.hot_load.wire(), "replicas": [r.wire() for r in self.replicas]}
        )

    def _set_state(self, state: HotLoadState, condition: Condition | None = None) -> None:
        st = self.hot_load.status
        now = self._now()
        st.state = state
        st.updated_at = now
        if state.terminal:
            st.finished_at = now
        if state == HotLoadState.CANCELED:
            st.canceled_at = now
        if condition is not None:
            st.conditions.append(condition)
        workflow.upsert_search_attributes([STATE.value_set(state.value)])
        self._publish()

    def _replica_moved(self, r: Replica, state: ReplicaState, **fields: Any) -> None:
        now = self._now()
        r.state = state
        r.transitioned_at = now
        r.updated_at = now
        for k, v in fields.items():
            setattr(r, k, v)
        self.hot_load.status.updated_at = now
        self._publish()

    # ------------------------------------------------------------------ run
    @workflow.run
    async def run(self, inp: HotLoadInput) -> HotLoadOutcome:
        self._publish()
        spec = self.hot_load.spec
        try:
            if not self.replicas:
                raise ApplicationError("the deployment has no ready replicas", type="NoReplicas")
            self._set_state(HotLoadState.IN_PROGRESS)
            endpoints = sorted(inp.replicas, key=lambda r: (r.zone, r.name))
            updated: list[ReplicaEndpoint] = []
            staged: set[str] | None = None  # replicas holding a stage from the broadcast
            # Pipelined: each receiver's stage task (name -> task); its commit waits only for it.
            stage_tasks: dict[str, asyncio.Future[bool]] | None = None
            # The broadcast the first replica starts from its own checked stage (patched
            # `early-broadcast`): the receivers stage while it swaps; None: after its commit.
            early: asyncio.Future[dict[str, asyncio.Future[bool]] | None] | None = None
            receivers = list(zip(self.replicas, endpoints))[1:]
            for index, (replica, endpoint) in enumerate(zip(self.replicas, endpoints)):
                self._raise_if_canceled()
                if (index == 0 and receivers and inp.peer_transfer and len(spec.snapshot_chain) > 1
                        and workflow.patched("early-broadcast")):
                    early = asyncio.ensure_future(self._start_broadcast(inp, endpoint, receivers, from_stage=True))
                if index == 1 and inp.peer_transfer and workflow.patched("peer-broadcast"):
                    if workflow.patched("pipelined-commits"):
                        stage_tasks = await early if early is not None else None
                        if stage_tasks is None:
                            stage_tasks = await self._start_broadcast(inp, updated[0], receivers)
                    else:
                        staged = await self._broadcast(inp, updated[0], receivers)
                    self._raise_if_canceled()
                if stage_tasks is not None and index >= 1:
                    # Later receivers keep staging while this one commits.
                    has_stage = await stage_tasks[replica.name]
                    self._raise_if_canceled()
                self._replica_moved(replica, ReplicaState.UPDATING, started_at=self._now(), error_reason=None)
                try:
                    if stage_tasks is not None and index >= 1:
                        result = await self._commit_stage(inp, endpoint, replica, has_stage)
                    elif staged is None:
                        result = await self._update_one(inp, endpoint, replica, updated[-1] if updated else None)
                    else:
                        result = await self._commit_stage(inp, endpoint, replica, replica.name in staged)
                except (Exception, asyncio.CancelledError) as exc:
                    if early is not None and index == 0:
                        self._abandon_broadcast(early)
                    if is_cancelled_exception(exc):
                        # The step was given up before it changed the replica: it serves what it
                        # did. (Patched: histories from before this change replay without it.)
                        if workflow.patched("cancel-reports-replica-pending"):
                            self._replica_moved(replica, ReplicaState.PENDING_UPDATE, finished_at=self._now())
                        raise
                    reason = _error_reason(exc)
                    self._replica_moved(replica, ReplicaState.ERROR, error_reason=reason, finished_at=self._now())
                    raise ApplicationError(f"replica {replica.name}: {reason}", type="ReplicaFailed") from exc
                self._replica_moved(
                    replica,
                    ReplicaState.READY,
                    current_snapshot_identity=result.identity,
                    finished_at=self._now(),
                    source=result.source,
                    bytes_read_from_bucket=result.bytes_read_from_bucket,
                    pause_ms=round(result.pause_ms, 3),
                    verified_tensors=result.verified_tensors,
                )
                updated.append(endpoint)
            if self._broadcast_send is not None:
                # Done once every receiver staged; a failed send was already answered by the
                # receivers falling back to the bucket.
                try:
                    await self._broadcast_send
                except Exception as exc:  # noqa: BLE001
                    if is_cancelled_exception(exc):
                        raise
            # A cancel that arrived while the last step finished its all-or-nothing swap.
            self._raise_if_canceled()
            self._set_state(
                HotLoadState.COMPLETED,
                Condition(
                    type="Completed", status=ConditionStatus.TRUE, reason="AllReplicasReady",
                    message=f"{len(self.replicas)} replica(s) serve {spec.identity}",
                    last_update_time=self._now(),
                ),
            )
        except Exception as exc:
            if is_cancelled_exception(exc):
                self._set_state(
                    HotLoadState.CANCELED,
                    Condition(
                        type="Canceled", status=ConditionStatus.TRUE, reason="Canceled",
                        message=self._mixed_message("canceled"), last_update_time=self._now(),
                    ),
                )
            else:
                self._set_state(
                    HotLoadState.FAILED,
                    Condition(
                        type="Failed", status=ConditionStatus.TRUE, reason=getattr(exc, "type", None) or "Failed",
                        message=f"{_error_reason(exc)}; {self._mixed_message('failed')}",
                        last_update_time=self._now(),
                    ),
                )
        except asyncio.CancelledError:
            self._set_state(
                HotLoadState.CANCELED,
                Condition(
                    type="Canceled", status=ConditionStatus.TRUE, reason="Canceled",
                    message=self._mixed_message("canceled"), last_update_time=self._now(),
                ),
            )
        outcome = HotLoadOutcome(
            hot_load_id=spec.id,
            identity=spec.identity,
            state=self.hot_load.status.state,
            replicas=self.replicas,
            chain=spec.snapshot_chain,
        )
        try:
            await workflow.get_external_workflow_handle(inp.deployment_workflow_id).signal(
                "hot_load_finished", outcome
            )
        except Exception:  # noqa: BLE001 - the deployment may have been deleted meanwhile
            workflow.logger.warning("could not report to %s", inp.deployment_workflow_id)
        return outcome

    async def _update_one(
        self, inp: HotLoadInput, endpoint: ReplicaEndpoint, replica: Replica, peer: ReplicaEndpoint | None
    ) -> ApplySnapshotResult:
        """One replica step: from an updated peer when there is one, else from the bucket."""
        if peer is not None and inp.peer_transfer:
            try:
                return await self._receive_from_peer(inp, endpoint, replica, peer)
            except Exception as exc:
                if is_cancelled_exception(exc):
                    raise
                # The bucket still has the snapshot: a broken peer link must not fail the update.
                workflow.logger.warning(
                    "peer transfer %s -> %s failed (%s); reading from the bucket", peer.name, endpoint.name,
                    _error_reason(exc),
                )
        return await self._bucket_step(inp, endpoint)

    def _bucket_step(self, inp: HotLoadInput, endpoint: ReplicaEndpoint) -> Any:
        spec = self.hot_load.spec
        return workflow.execute_activity(
            names.APPLY_SNAPSHOT,
            ApplySnapshotInput(
                hot_load_id=spec.id,
                identity=spec.identity,
                chain=spec.snapshot_chain,
                bucket=inp.hot_load_config.bucket,
                path_prefix=inp.hot_load_config.path_prefix,
                prompt_cache_policy=spec.prompt_cache_policy,
            ),
            task_queue=endpoint.task_queue,
            result_type=ApplySnapshotResult,
            **REPLICA_STEP_OPTIONS,
        )

    async def _offer(
        self, sender: ReplicaEndpoint, receivers: list[tuple[Replica, ReplicaEndpoint]], host_store: bool,
        from_stage: bool = False,
    ) -> PeerOffer | None:
        """What `sender` offers every receiver (None: no offer, they read the bucket; with
        `from_stage`, what it offers from its update's stage before it swaps it in)."""
        spec = self.hot_load.spec
        serving = {r.current_snapshot_identity for r, _ in receivers}
        try:
            return await workflow.execute_activity(
                names.OFFER_TO_PEER,
                PeerOfferInput(
                    hot_load_id=spec.id, identity=spec.identity, chain=spec.snapshot_chain,
                    # Receivers on different snapshots get every tensor ("" is no identity).
                    target_identity=serving.pop() if len(serving) == 1 else "",
                    world_size=1 + len(receivers),
                    accept_files=True,
                    host_store=host_store,
                    from_stage=from_stage,
                ),
                task_queue=sender.task_queue,
                result_type=PeerOffer,
                **PEER_STEP_OPTIONS,
            )
        except Exception as exc:
            if is_cancelled_exception(exc):
                raise
            workflow.logger.warning("no peer offer from %s (%s): reading the bucket", sender.name, _error_reason(exc))
            return None

    async def _broadcast(
        self, inp: HotLoadInput, sender: ReplicaEndpoint, receivers: list[tuple[Replica, ReplicaEndpoint]]
    ) -> set[str]:
        """Send the update from `sender` to every receiver at once; returns who staged it.

        Nothing any replica serves changes here: each receiver only checks and stages."""
        offer = await self._offer(sender, receivers, host_store=False)
        if offer is None:
            return set()
        send = self._send(sender, offer)
        stages = [
            asyncio.ensure_future(self._stage(offer, rank, endpoint))
            for rank, (_, endpoint) in enumerate(receivers, start=1)
        ]
        await workflow.wait([send, *stages])
        for task in [send, *stages]:
            if task.cancelled() or (task.exception() is not None and is_cancelled_exception(task.exception())):
                raise asyncio.CancelledError()
        if send.exception() is not None:
            workflow.logger.warning("broadcast from %s failed (%s): reading the bucket", sender.name,
                                    _error_reason(send.exception()))
            return set()
        ok = set()
        for (replica, _), task in zip(receivers, stages):
            if task.exception() is None:
                ok.add(replica.name)
            else:
                workflow.logger.warning("%s did not stage from %s (%s): it reads the bucket", replica.name,
                                        sender.name, _error_reason(task.exception()))
        return ok

    async def _start_broadcast(
        self, inp: HotLoadInput, sender: ReplicaEndpoint, receivers: list[tuple[Replica, ReplicaEndpoint]],
        from_stage: bool = False,
    ) -> dict[str, asyncio.Future[bool]] | None:
        """Start sending the update from `sender` to every receiver at once; returns, per
        receiver, a task that ends True once it holds a checked stage (False: it reads the
        bucket). Nothing any replica serves changes here.

        `from_stage`: `sender` is still updating (from the bucket); it offers the delta files
        once its own stage has checked them, and None means it has no such offer (the caller
        broadcasts after its commit instead)."""
        async def no_stage() -> bool:
            return False

        offer = await self._offer(sender, receivers, host_store=True, from_stage=from_stage)
        if offer is None:
            if from_stage:
                return None
            return {r.name: asyncio.ensure_future(no_stage()) for r, _ in receivers}
        send = self._send(sender, offer)

        async def stage(rank: int, replica: Replica, endpoint: ReplicaEndpoint) -> bool:
            try:
                await self._stage(offer, rank, endpoint)
                return True
            except Exception as exc:
                if is_cancelled_exception(exc):
                    raise
                # A stage is checked against the sender's checksums, so one that succeeded is
                # good whatever became of the others; a failed one reads the bucket.
                workflow.logger.warning("%s did not stage from %s (%s): it reads the bucket", replica.name,
                                        sender.name, _error_reason(exc))
                return False

        self._broadcast_send = send
        return {
            replica.name: asyncio.ensure_future(stage(rank, replica, endpoint))
            for rank, (replica, endpoint) in enumerate(receivers, start=1)
        }

    @staticmethod
    def _send(sender: ReplicaEndpoint, offer: PeerOffer) -> asyncio.Future[Any]:
        """The sender's side of a broadcast, started."""
        return asyncio.ensure_future(
            workflow.execute_activity(names.SEND_TO_PEERS, offer, task_queue=sender.task_queue, **PEER_STEP_OPTIONS)
        )

    @staticmethod
    def _stage(offer: PeerOffer, rank: int, receiver: ReplicaEndpoint) -> Any:
        """A receiver's side of a broadcast: join as `rank`, check and stage (an activity)."""
        return workflow.execute_activity(
            names.STAGE_FROM_PEER,
            StageFromPeerInput(offer=offer, rank=rank),
            task_queue=receiver.task_queue,
            result_type=StageFromPeerResult,
            **PEER_STEP_OPTIONS,
        )

    def _abandon_broadcast(self, early: asyncio.Future[dict[str, asyncio.Future[bool]] | None]) -> None:
        """The first replica's update failed or was canceled after it started broadcasting:
        cancel the offer, the send and every receiver's stage. They only stage (nothing any
        receiver serves changes), and each agent's lock orders a stage before its next step, so
        the walk does not wait for them to end."""
        tasks: list[asyncio.Future[Any]] = [early]
        if early.done() and not early.cancelled() and early.exception() is None and early.result():
            tasks += list(early.result().values())  # type: ignore[union-attr]
        if self._broadcast_send is not None:
            tasks.append(self._broadcast_send)
        for task in tasks:
            task.cancel()

    async def _commit_stage(
        self, inp: HotLoadInput, endpoint: ReplicaEndpoint, replica: Replica, has_stage: bool
    ) -> ApplySnapshotResult:
        """Swap a replica's broadcast stage in; without one, or if the swap fails, read the bucket."""
        if has_stage:
            spec = self.hot_load.spec
            try:
                return await workflow.execute_activity(
                    names.COMMIT_PEER_STAGE,
                    CommitPeerStageInput(identity=spec.identity, prompt_cache_policy=spec.prompt_cache_policy),
                    task_queue=endpoint.task_queue,
                    result_type=ApplySnapshotResult,
                    **PEER_STEP_OPTIONS,
                )
            except Exception as exc:
                if is_cancelled_exception(exc):
                    raise
                workflow.logger.warning("%s could not swap its stage in (%s): reading the bucket", replica.name,
                                        _error_reason(exc))
        return await self._bucket_step(inp, endpoint)

    async def _receive_from_peer(
        self, inp: HotLoadInput, endpoint: ReplicaEndpoint, replica: Replica, peer: ReplicaEndpoint
    ) -> ApplySnapshotResult:
        spec = self.hot_load.spec
        offer: PeerOffer = await workflow.execute_activity(
            names.OFFER_TO_PEER,
            PeerOfferInput(
                hot_load_id=spec.id, identity=spec.identity, chain=spec.snapshot_chain,
                target_identity=replica.current_snapshot_identity,
            ),
            task_queue=peer.task_queue,
            result_type=PeerOffer,
            **PEER_STEP_OPTIONS,
        )
        # Both ends join one process group: run the two steps concurrently.
        send = workflow.execute_activity(
            names.SEND_TO_PEER, offer, task_queue=peer.task_queue, **PEER_STEP_OPTIONS
        )
        receive = workflow.execute_activity(
            names.RECEIVE_FROM_PEER,
            ReceiveFromPeerInput(offer=offer, prompt_cache_policy=spec.prompt_cache_policy),
            task_queue=endpoint.task_queue,
            result_type=ApplySnapshotResult,
            **PEER_STEP_OPTIONS,
        )
        send_task, receive_task = asyncio.ensure_future(send), asyncio.ensure_future(receive)
        await workflow.wait([send_task, receive_task], return_when=asyncio.FIRST_EXCEPTION)
        for task in (send_task, receive_task):
            if task.done() and not task.cancelled() and task.exception() is not None:
                for other in (send_task, receive_task):
                    other.cancel()
                raise task.exception()  # type: ignore[misc]
        return receive_task.result()

    @staticmethod
    def _raise_if_canceled() -> None:
        """A replica step finishes its swap even when canceled, which hands its result back and
        swallows the cancel; the walk must still stop before the next replica."""
        if workflow.cancellation_reason() is not None:
            raise asyncio.CancelledError()

    def _mixed_message(self, verb: str) -> str:
        served = sorted({r.current_snapshot_identity for r in self.replicas})
        if len(served) > 1:
            return f"the operation {verb} with replicas serving different snapshots: {', '.join(served)}"
        return f"every replica serves {served[0] if served else 'nothing'}"

    @workflow.query
    def replicas_view(self) -> list[Replica]:
        return self.replicas
