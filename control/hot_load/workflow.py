"""The hot-load workflow (type ``HotLoadWorkflow``): one per operation, id ``hotLoads/ORG/ID``.

``run()`` is the walk: the first replica from the bucket (``apply_snapshot``), the fan-out to the
others (control/hot_load/fanout.py, stages.py, group.py), each swapping its stage in
(``commit_peer_stage``) at most ``hotLoad.maxConcurrentSwaps`` at a time (window.py), a failed
stage or commit falling back to the bucket. Invariants: a failed step stops the walk (no new step
starts; replicas already moved keep the new weights); the workflow signals its deployment
(``hot_load_finished``) before its memo and ``HotLoadState`` show the end, so a create right
after a read of the end is admitted; it closes as what the operation became (COMPLETED, FAILED
with a non-retryable ``ApplicationError``, CANCELED). The walk in full: docs/design.md
"The hot-load walk"; memo and details: control/hot_load/state.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from temporalio import workflow
from temporalio.exceptions import ApplicationError, is_cancelled_exception

from control.hot_load.options import PEER_STEP, REPLICA_STEP
from control.hot_load.stages import GroupedStages, NoStages, OneFanOut, Stages
from control.hot_load.state import WalkState, error_reason, walk_order
from control.hot_load.window import Window

with workflow.unsafe.imports_passed_through():
    # `import X as Y`, not `from control import metrics`: the sandbox would import the module
    # again (and register its metrics twice) through its own copy of the `control` package.
    import control.metrics as hot_load_metrics
    from contracts import names
    from contracts.activities import ApplySnapshotInput, ApplySnapshotResult, CommitPeerStageInput
    from contracts.nodes import ReplicasLost
    from contracts.records import HotLoadInput, HotLoadOutcome, HotLoadState, Replica, ReplicaEndpoint, ReplicaState

# The workflow's failure type when a replica step failed (the condition's reason too).
REPLICA_FAILED = "ReplicaFailed"
# A replica step given up because the replica's node was declared lost (the deployment says so).
REPLICA_LOST = "ReplicaLost"
NO_REPLICAS = "NoReplicas"


@workflow.defn(name=names.HOT_LOAD_WORKFLOW)
class HotLoadWorkflow:
    @workflow.init
    def __init__(self, inp: HotLoadInput) -> None:
        self.walk = WalkState(inp)
        # Replicas that went with a lost node (from the deployment) -> why.
        self.lost: dict[str, str] = {}

    @workflow.signal(name=names.REPLICAS_LOST)
    def replicas_lost(self, lost: ReplicasLost) -> None:
        for name in lost.names:
            self.lost.setdefault(name, lost.reason)

    @workflow.query
    def replicas_view(self) -> list[Replica]:
        return self.walk.replicas

    @workflow.run
    async def run(self, inp: HotLoadInput) -> HotLoadOutcome:
        self.walk.publish()
        failure: ApplicationError | None = None
        try:
            await self._walk(inp)
            self.walk.completed()
        except Exception as exc:
            if is_cancelled_exception(exc):
                self.walk.canceled()
            else:
                reason = getattr(exc, "type", None) or "Failed"
                failure = ApplicationError(error_reason(exc), type=reason, non_retryable=True)
                self.walk.failed(reason, error_reason(exc))
        except asyncio.CancelledError:
            self.walk.canceled()
        outcome = self.walk.outcome()
        hot_load_metrics.hot_load_ended(  # not while replaying: workflow.metric_meter()
            self.walk.state.value.removeprefix("HOT_LOAD_STATE_"),
            failure.type if failure and failure.type else "",
            (workflow.now() - workflow.info().start_time).total_seconds(),
            [r.error_reason or "" for r in self.walk.replicas if r.state == ReplicaState.ERROR],
        )
        await self._report_end(inp, outcome)
        self.walk.publish_state()  # only now may a read see the end: the deployment admits the next
        if self.walk.state == HotLoadState.CANCELED:
            raise asyncio.CancelledError()
        if failure is not None:
            raise ApplicationError(
                f"hot-load {outcome.hot_load_id} failed: {failure.message}",
                outcome,
                type=failure.type,
                non_retryable=True,
            )
        return outcome

    async def _report_end(self, inp: HotLoadInput, outcome: HotLoadOutcome) -> None:
        """Signal the deployment that the operation ended. The signal is in the deployment's
        history when this returns, so any create admitted after a read of the end sees it."""
        try:
            await workflow.get_external_workflow_handle(inp.deployment_workflow_id).signal(
                names.HOT_LOAD_FINISHED, outcome
            )
        except (Exception, asyncio.CancelledError):  # noqa: BLE001 - a cancel now changes nothing
            # The deployment may have been deleted meanwhile; it also awaits this workflow's end.
            workflow.logger.warning("could not report to %s", inp.deployment_workflow_id)

    async def _walk(self, inp: HotLoadInput) -> None:
        """First replica from the bucket (passing the update on from its stage when it can),
        then every other one in walk order, up to `maxConcurrentSwaps` at once, each from its
        stage when it got one; raises what stopped it."""
        if not self.walk.replicas:
            raise ApplicationError("the deployment has no ready replicas", type=NO_REPLICAS)
        self.walk.set_state(HotLoadState.IN_PROGRESS)
        steps = list(zip(self.walk.replicas, walk_order(inp.replicas)))
        (first, root), receivers = steps[0], steps[1:]
        stages = self._stages(inp, [endpoint for _, endpoint in receivers])
        delta = len(self.walk.hot_load.spec.snapshot_chain) > 1
        try:
            if delta:
                stages.add_root(root, staged=True)
            await self._step(first, "from the bucket", lambda: self._from_bucket(inp, root, first))
            self._raise_if_canceled()
            stages.committed(root.name)
            if not delta:
                stages.add_root(root, staged=False)
            await self._commit_all(inp, receivers, stages)
            await stages.end()
        except BaseException:
            stages.abandon()
            raise

    def _stages(self, inp: HotLoadInput, receivers: list[ReplicaEndpoint]) -> Stages:
        """Where the receivers' stages come from (control/hot_load/stages.py)."""
        if not receivers or not inp.peer_transfer:
            return NoStages()
        cfg = inp.hot_load_config
        serving = {r.name: r.current_snapshot_identity for r in inp.replicas}
        spec = self.walk.hot_load.spec
        if len(receivers) <= cfg.replicas_per_group:
            return OneFanOut(spec, receivers, serving, cfg.peer_fan_out)
        return GroupedStages(
            spec,
            receivers,
            serving,
            fan_out=cfg.peer_fan_out,
            group_size=cfg.replicas_per_group,
            workflow_id=workflow.info().workflow_id,
        )

    async def _commit_all(
        self,
        inp: HotLoadInput,
        receivers: list[tuple[Replica, ReplicaEndpoint]],
        stages: Stages,
    ) -> None:
        """Each receiver in walk order, from its stage or the bucket, at most `maxConcurrentSwaps`
        at a time. A failed step stops the walk: no new step starts, the ones in flight end. A
        cancel stops it too, and the steps in flight are canceled (each ends with its replica on
        the old weights or the new ones)."""
        window = Window(inp.hot_load_config.max_concurrent_swaps)
        try:
            for replica, endpoint in receivers:
                await window.room()
                self._raise_if_canceled()
                has_stage = await stages.ready(replica.name)
                self._raise_if_canceled()
                how = "commit of its peer stage" if has_stage else "from the bucket"
                window.start(self._receiver_step(inp, replica, endpoint, has_stage, how, stages))
            await window.drain()
        except BaseException as exc:
            await window.stop(cancel=isinstance(exc, asyncio.CancelledError) or is_cancelled_exception(exc))
            raise
        self._raise_if_canceled()

    async def _receiver_step(
        self,
        inp: HotLoadInput,
        replica: Replica,
        endpoint: ReplicaEndpoint,
        has_stage: bool,
        how: str,
        stages: Stages,
    ) -> None:
        await self._step(
            replica,
            how,
            lambda: self._from_stage_or_bucket(inp, endpoint, replica, has_stage),
            peer_round=stages.round(replica.name),
        )
        stages.committed(replica.name)

    async def _step(
        self,
        replica: Replica,
        how: str,
        run: Callable[[], Awaitable[ApplySnapshotResult]],
        *,
        peer_round: int | None = None,
    ) -> None:
        """One replica's update: UPDATING, then READY with what it serves, or ERROR (the walk
        stops); a step given up before it changed the replica leaves it PENDING_UPDATE, and so
        does one that failed once a cancel was asked (an agent may end a step it was asked to
        give up with an error; a failed step changed nothing): the walk ends CANCELED."""
        self.walk.moved(replica, ReplicaState.UPDATING, started_at=self.walk.now(), error_reason=None)
        self.walk.doing(replica, how)
        try:
            if replica.name in self.lost:
                raise ApplicationError(self.lost[replica.name], type=REPLICA_LOST)
            result = await run()
        except (Exception, asyncio.CancelledError) as exc:
            if is_cancelled_exception(exc) or workflow.cancellation_reason() is not None:
                self.walk.moved(replica, ReplicaState.PENDING_UPDATE, finished_at=self.walk.now())
                if is_cancelled_exception(exc):
                    raise
                workflow.logger.warning("%s: its step failed after the cancel (%s)", replica.name, error_reason(exc))
                raise asyncio.CancelledError() from exc
            reason = error_reason(exc)
            self.walk.moved(replica, ReplicaState.ERROR, error_reason=reason, finished_at=self.walk.now())
            raise ApplicationError(f"replica {replica.name}: {reason}", type=REPLICA_FAILED) from exc
        self.walk.moved(
            replica,
            ReplicaState.READY,
            current_snapshot_identity=result.identity,
            finished_at=self.walk.now(),
            source=result.source,
            bytes_read_from_bucket=result.bytes_read_from_bucket,
            pause_ms=round(result.pause_ms, 3),
            pause_breakdown_ms=result.pause_breakdown_ms or None,
            swap_bytes=result.swap_bytes or None,
            verified_tensors=result.verified_tensors,
            peer_round=peer_round if (result.source or "").startswith("peer:") else None,
        )

    async def _from_bucket(self, inp: HotLoadInput, endpoint: ReplicaEndpoint, replica: Replica) -> ApplySnapshotResult:
        spec = self.walk.hot_load.spec
        return await self._unless_lost(
            replica.name,
            workflow.start_activity(
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
                summary=f"update {replica.name} to {spec.identity} from the bucket",
                **REPLICA_STEP,
            ),
        )

    async def _from_stage_or_bucket(
        self, inp: HotLoadInput, endpoint: ReplicaEndpoint, replica: Replica, has_stage: bool
    ) -> ApplySnapshotResult:
        """Swap the replica's peer stage in; without one, or if the swap fails, read the bucket."""
        if has_stage:
            spec = self.walk.hot_load.spec
            try:
                return await self._unless_lost(
                    replica.name,
                    workflow.start_activity(
                        names.COMMIT_PEER_STAGE,
                        CommitPeerStageInput(identity=spec.identity, prompt_cache_policy=spec.prompt_cache_policy),
                        task_queue=endpoint.task_queue,
                        result_type=ApplySnapshotResult,
                        summary=f"swap {spec.identity} into {replica.name} from its peer stage",
                        **PEER_STEP,
                    ),
                )
            except Exception as exc:
                if is_cancelled_exception(exc):
                    raise
                if workflow.cancellation_reason() is not None:
                    # Canceled while the commit failed (an agent may end a step it was asked to
                    # give up with an error): the replica kept its weights, and no new step starts.
                    raise asyncio.CancelledError() from exc
                workflow.logger.warning(
                    "%s could not swap its stage in (%s): reading the bucket", replica.name, error_reason(exc)
                )
                self.walk.doing(replica, "from the bucket, its stage's swap failed")
        return await self._from_bucket(inp, endpoint, replica)

    async def _unless_lost(self, name: str, step: workflow.ActivityHandle[ApplySnapshotResult]) -> ApplySnapshotResult:
        """The replica step `step` (already scheduled: the walk's commands keep their order),
        unless the replica goes with its node first: then the step fails at once (no agent will
        run it) with the registry's reason. A cancel reaches the step as before: it is awaited to
        its end."""
        gone = asyncio.ensure_future(workflow.wait_condition(lambda: name in self.lost))
        try:
            await workflow.wait([step, gone], return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            gone.cancel()
            step.cancel()
            return await step
        if step.done():
            gone.cancel()
            return step.result()
        raise ApplicationError(self.lost[name], type=REPLICA_LOST)

    @staticmethod
    def _raise_if_canceled() -> None:
        """A replica step finishes its swap even when canceled, which hands its result back and
        swallows the cancel; the walk must still stop before the next replica."""
        if workflow.cancellation_reason() is not None:
            raise asyncio.CancelledError()
