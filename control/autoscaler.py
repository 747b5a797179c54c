"""Autoscaling of a deployment between `autoscaling.min` and `max` (contracts/autoscaling.py has
the load reports and the rule); mixed into the deployment workflow (control/deployment.py),
whose state, replica lock and status it uses.

Invariants: a step starts only when the deployment is READY, no hot-load runs and no rolling
update is due, one replica at a time, and the next step's load must hold again from `scaled_at`.
Scale-out takes nothing out of service and holds back no hot-load: the new replica *joins* (no
request, no hot-load reaches it) and becomes a member only between hot-loads, under the replica
lock, once it serves exactly the current snapshot (from a serving member's peer transfer, else
from the bucket; all or nothing); a joiner that fails is stopped. Scale-in removes the newest
member, never while a hot-load runs: out of the replica list first, then drained, then stopped.
docs/operations.md, "Autoscaling".
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
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
    from contracts.autoscaling import LEVELS, LoadReport, policy, step
    from contracts.records import Heard, ReplicaEndpoint, ResourceStatus
    from control import metrics, replica_set
    from control.deployment_host import MixinBase
    from control.hot_load.options import PEER_STEP, REPLICA_STEP

# How long a joiner may take to start and report ready, and a drain to finish.
JOIN_TIMEOUT = timedelta(minutes=20)
DRAIN_TIMEOUT = timedelta(minutes=30)
# How long routers get to stop sending a leaving replica requests (the gateway re-reads every
# deployment twice a second; Dynamo's frontend watches its discovery).
DRAIN_GRACE_S = 2.0


class Autoscaler(MixinBase):
    """The deployment workflow's autoscaling (module docstring); the workflow is its host
    (control/deployment_host.py)."""

    def _init_autoscaler(self) -> None:
        # Replicas a scale-out started that are not members yet -> their endpoint once ready.
        self.joining: dict[str, ReplicaEndpoint | None] = {}

    def _hear(self, report: LoadReport) -> None:
        if report.level not in LEVELS or not report.gateway_id:
            return
        now = workflow.now()
        # Kept in the state (gateway id -> what it says and since when): it survives continue-as-new.
        heard = self.state.load_heard
        before = heard.get(report.gateway_id)
        since = before.since if before is not None and before.level == report.level else now
        heard[report.gateway_id] = Heard(report.level, since, now)

    def _scale_step(self) -> int:
        """+1 (one replica more), -1 (one fewer) or 0, by the rule, when a step may start."""
        st = self.state
        if (
            not st.load_heard
            or self.deleting
            or st.active_hot_load_id is not None
            or st.outdated
            or st.update_error is not None
            or st.deployment.status.status != ResourceStatus.READY
        ):
            return 0
        scaled = datetime.fromisoformat(st.scaled_at) if st.scaled_at else None
        return step(policy(self.spec.autoscaling), len(st.members), st.load_heard, workflow.now(), scaled)

    def _current_identity(self) -> str:
        return self.state.completed[-1].identity if self.state.completed else "initial"

    async def _scale_out(self) -> None:
        new = f"replica-{str(workflow.uuid4())[:8]}"
        self.joining[new] = None
        workflow.logger.info("scaling out: %s joins %d member(s)", new, len(self.state.members))
        self._settle()
        failure: str | None = None
        try:
            async with self.replica_lock:
                base = self._peer_source(self._current_identity()) is not None
                outcome = await self._start([new], timedelta(minutes=5), joining=True, base=base)
            if outcome.failed:
                raise RuntimeError(outcome.failures())
            await workflow.wait_condition(
                lambda: self.joining.get(new) is not None or self._failure_of(new) is not None or self.deleting,
                timeout=JOIN_TIMEOUT,
            )
            failure = self._failure_of(new)
            while failure is None and not self.deleting:
                await workflow.wait_condition(lambda: self.state.active_hot_load_id is None or self.deleting)
                if self.deleting:
                    break
                async with self.replica_lock:
                    if self.state.active_hot_load_id is not None:
                        continue  # one was admitted while the lock was taken: after it ends
                    await self._join(new)
                    return
        except asyncio.TimeoutError:
            failure = f"did not report ready within {JOIN_TIMEOUT}"
        except replica_set.PlacementFailed as exc:
            failure = f"no place for it: {exc}"
        except Exception as exc:  # noqa: BLE001 - the start or the catch-up failed: reported, not a crash
            failure = f"{exc.__cause__ or exc}"
        if self.deleting:
            return  # `_delete` stops it with the rest (it is still in `joining`)
        self.joining.pop(new, None)
        workflow.logger.warning("scale-out stopped: new replica %s failed: %s", new, failure)
        async with self.replica_lock:
            try:
                await replica_set.stop(self.state, [new])
            except Exception as exc:  # noqa: BLE001 - logged; it never served
                workflow.logger.warning("stopping replica %s failed: %s", new, exc)
        self.failures = [f for f in self.failures if f.name != new]  # type: ignore[has-type]  # python/mypy#19862
        self.state.scaled_at = self._now()  # the next try waits out the cool-down
        self._count("out", "failed")
        self._settle()

    async def _join(self, new: str) -> None:
        """Under the replica lock, no hot-load running: the joiner steps to the current snapshot
        (from a serving peer, else from the bucket) if it serves another, then becomes a member
        and serves."""
        endpoint = self.joining[new]
        assert endpoint is not None
        current = self._current_identity()
        if endpoint.current_snapshot_identity != current and self.spec.hot_load is not None:
            result = await self._catch_up_from_peer(endpoint, current)
            if result is None:
                result = await self._catch_up_from_bucket(endpoint, current)
            endpoint = endpoint.model_copy(
                update={"current_snapshot_identity": result.identity, "transitioned_at": self._now()}
            )
            workflow.logger.info("joining replica %s holds %s (from %s)", new, result.identity, result.source)
        if endpoint.current_snapshot_identity != current:
            raise RuntimeError(f"it serves {endpoint.current_snapshot_identity}, the deployment {current}")
        await workflow.execute_activity(
            names.SERVE_REPLICA,
            task_queue=endpoint.task_queue,
            summary=f"{new} enters the routing pool",
            start_to_close_timeout=timedelta(minutes=1),
            retry_policy=RetryPolicy(maximum_attempts=3),
        )
        del self.joining[new]
        self.state.members.append(new)
        self.state.replicas = sorted([*self.state.replicas, endpoint], key=lambda r: (r.zone, r.name))
        self.state.scaled_at = self._now()
        workflow.logger.info("scaled out: %s serves %s; %d member(s)", new, current, len(self.state.members))
        self._count("out", "joined")
        self._settle()

    def _peer_source(self, current: str) -> ReplicaEndpoint | None:
        """The member a joiner takes `current` from: the first in walk order that serves it."""
        hot_load = self.spec.hot_load
        if hot_load is None or current == "initial":
            return None
        members = set(self.state.members)
        return next(
            (r for r in self.state.replicas if r.name in members and r.current_snapshot_identity == current), None
        )

    async def _catch_up_from_peer(self, joiner: ReplicaEndpoint, current: str) -> ApplySnapshotResult | None:
        """The joiner takes `current` from a serving member: offer, send and stage (the member
        keeps serving; the joiner checks every tensor against the member's checksums), then the
        joiner swaps it in and proves it. None when there is no such member or a step failed
        (the joiner serves what it served; the caller reads the bucket)."""
        sender = self._peer_source(current)
        if sender is None:
            return None
        chain = self.state.chains[current]
        try:
            offer = await workflow.execute_activity(
                names.OFFER_TO_PEER,
                PeerOfferInput(
                    hot_load_id=f"join-{joiner.name}",
                    identity=current,
                    chain=chain,
                    target_identity=joiner.current_snapshot_identity,
                    world_size=2,
                    accept_files=True,
                    host_store=True,
                ),
                task_queue=sender.task_queue,
                result_type=PeerOffer,
                summary=f"offer {current} from {sender.name} to joining replica {joiner.name}",
                **PEER_STEP,
            )
            send = asyncio.ensure_future(
                workflow.execute_activity(
                    names.SEND_TO_PEERS,
                    offer,
                    task_queue=sender.task_queue,
                    result_type=int,
                    summary=f"send {current} ({offer.mode}) to joining replica {joiner.name}",
                    **PEER_STEP,
                )
            )
            try:
                await workflow.execute_activity(
                    names.STAGE_FROM_PEER,
                    StageFromPeerInput(offer=offer, rank=1),
                    task_queue=joiner.task_queue,
                    result_type=StageFromPeerResult,
                    summary=f"stage {current} from {sender.name} on {joiner.name}",
                    **PEER_STEP,
                )
            finally:
                await asyncio.gather(send, return_exceptions=True)
            result: ApplySnapshotResult = await workflow.execute_activity(
                names.COMMIT_PEER_STAGE,
                CommitPeerStageInput(identity=current),
                task_queue=joiner.task_queue,
                result_type=ApplySnapshotResult,
                summary=f"joining replica {joiner.name} swaps in {current}",
                **REPLICA_STEP,
            )
            return result
        except Exception as exc:  # noqa: BLE001 - the bucket is the fallback (a cancel is not an Exception)
            workflow.logger.warning(
                "joining replica %s did not take %s from %s (%s): it reads the bucket",
                joiner.name,
                current,
                sender.name,
                exc.__cause__ or exc,
            )
            return None

    async def _catch_up_from_bucket(self, joiner: ReplicaEndpoint, current: str) -> ApplySnapshotResult:
        hot_load = self.spec.hot_load
        assert hot_load is not None
        result: ApplySnapshotResult = await workflow.execute_activity(
            names.APPLY_SNAPSHOT,
            ApplySnapshotInput(
                hot_load_id=f"join-{joiner.name}",
                identity=current,
                chain=self.state.chains[current],
                bucket=hot_load.bucket,
                path_prefix=hot_load.path_prefix,
            ),
            task_queue=joiner.task_queue,
            result_type=ApplySnapshotResult,
            summary=f"bring joining replica {joiner.name} to {current} from the bucket",
            **REPLICA_STEP,
        )
        return result

    async def _scale_in(self) -> None:
        name = self.state.members[-1]  # the newest
        endpoint = next((r for r in self.state.replicas if r.name == name), None)
        # Out of the replica list first: no gateway routes to it and no hot-load walks it.
        self.state.replicas = [r for r in self.state.replicas if r.name != name]
        self.state.members = [n for n in self.state.members if n != name]
        self.state.pending_replicas = [n for n in self.state.pending_replicas if n != name]
        self._settle()
        workflow.logger.info("scaling in: %s drains; %d member(s) left", name, len(self.state.members))
        if endpoint is not None:
            try:
                await workflow.execute_activity(
                    names.DRAIN_REPLICA,
                    DrainInput(grace_seconds=DRAIN_GRACE_S),
                    task_queue=endpoint.task_queue,
                    result_type=float,
                    summary=f"drain {name}: out of rotation, finish the requests it holds",
                    start_to_close_timeout=DRAIN_TIMEOUT,
                    schedule_to_start_timeout=timedelta(minutes=1),
                    heartbeat_timeout=timedelta(seconds=30),
                    retry_policy=RetryPolicy(maximum_attempts=1),
                )
            except Exception as exc:  # noqa: BLE001 - its process may be gone: stopped either way
                workflow.logger.warning("draining %s failed: %s; stopping it", name, exc)
        async with self.replica_lock:
            try:
                await replica_set.stop(self.state, [name])
            except Exception as exc:  # noqa: BLE001 - logged; it is out of the deployment either way
                workflow.logger.warning("stopping replica %s failed: %s", name, exc)
        self.state.scaled_at = self._now()
        self._count("in", "removed")
        self._settle()

    @staticmethod
    def _count(direction: str, outcome: str) -> None:
        metrics.scaled(direction, outcome)  # not while replaying: workflow.metric_meter()


def joined_message(serving: int, joining: int) -> str:
    """The READY condition's message while a scale-out runs."""
    text = f"{serving} replica(s) serving"
    return f"{text}; {joining} joining (autoscaling)" if joining else text
