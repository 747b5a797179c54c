"""The deployment entity workflow: one per deployment, the single writer of its state.

It places and starts the replicas (control/replica_set.py), admits hot-loads through the
``create_hot_load`` Update and keeps the chain of completed snapshots
(control/deployment_hot_loads.py), restarts and replaces lost replicas, rolls runtime updates
(``update_config``, ``_roll``), autoscales (control/autoscaler.py) and tears down on ``delete``.
Invariants: handlers share one state and one replica lock; the create handler marks the hot-load
active before its first await, so two creates are never both admitted; a hot-load's end is noted
from its signal and from the child's close, idempotently, and never fails the deployment; reads
never query it: it publishes its wire object in its memo on every change. The rules (status,
conditions, rolls, capacity): docs/design.md "Workflows" and "Deployment status rules".
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from contracts import names
    from contracts.activities import StartReplicasInput
    from contracts.autoscaling import LoadReport
    from contracts.errors import UNAVAILABLE, rejected
    from contracts.memo import ChunkedList
    from contracts.nodes import ReplicasLost
    from contracts.records import (
        Condition,
        ConditionStatus,
        Deployment,
        DeploymentInput,
        DeploymentSpec,
        ReplicaEndpoint,
        ReplicaFailure,
        ResourceStatus,
        UpdateDeploymentCommand,
        rfc3339,
    )
    from control import admission, replica_set
    from control.autoscaler import Autoscaler, joined_message
    from control.deployment_host import DeploymentHost
    from control.deployment_hot_loads import HotLoads

REPLICA_START_TIMEOUT = timedelta(minutes=20)
# How long a hot-load's admission waits for a replica check already in flight.
ADMISSION_LOCK_WAIT = timedelta(seconds=25)
# How often the deployment checks that its replica processes are alive.
SUPERVISE_EVERY = timedelta(seconds=10)
# Statuses past creation in which the deployment watches its replica set (and restarts replicas).
SUPERVISED = (ResourceStatus.READY, ResourceStatus.UPDATING, ResourceStatus.ERROR)


@workflow.defn
class DeploymentWorkflow(Autoscaler, HotLoads):
    @workflow.init
    def __init__(self, state: DeploymentInput) -> None:
        self.state = state
        self._init_autoscaler()
        self.failures: list[ReplicaFailure] = []
        self.deleting = False
        # One replica-set change at a time: starting (which checks the pid files first) and
        # stopping replicas from the main loop, the admission check and `verify_replicas`.
        self.replica_lock = asyncio.Lock()
        # Why the last placement failed (not enough capacity), shown as the condition while
        # members wait for a place; None once they all have one.
        self.placement_error: str | None = None
        # The node agents that did not answer the last check of the replica processes -> why.
        self.unanswered: dict[str, str] = {}
        # The replica list's memo chunks as last published (only the changed ones are upserted).
        self._replica_memo = ChunkedList(by_name=True)

    # ------------------------------------------------------------------ helpers
    @property
    def spec(self) -> DeploymentSpec:
        return self.state.deployment.spec

    def _now(self) -> str:
        return rfc3339(workflow.now())

    def _set_status(self, status: ResourceStatus, *conditions: Condition) -> None:
        st = self.state.deployment.status
        st.status = status
        if conditions:
            st.conditions = list(conditions)
        st.updated_at = self._now()
        self._publish()

    def _publish(self) -> None:
        st = self.state.deployment.status
        st.active_hot_load_id = self.state.active_hot_load_id
        st.ready_replicas = len(self.state.replicas)
        st.current_snapshot_identity = self.state.completed[-1].identity if self.state.completed else "initial"
        workflow.upsert_memo(
            {
                "deployment": self.state.deployment.wire(),
                # Internal routing facts for the gateway; not part of the wire object. In chunks
                # (contracts/memo.py): a replica's change rewrites only its own.
                **self._replica_memo.changes([r.wire() for r in self.state.replicas]),
            }
        )

    def _published_memo(self) -> dict[str, Any]:
        """The memo as `_publish` last left it: the deployment and every replica chunk."""
        return {"deployment": self.state.deployment.wire(), **self._replica_memo.published}

    def _settle(self) -> None:
        """Status from the replica set, past creation: READY only when every member serves the
        spec's runtime; publishes either way (one memo update)."""
        st = self.state.deployment.status
        if self.deleting or st.status not in SUPERVISED:
            self._publish()
            return
        members = self.state.members
        serving = {r.name for r in self.state.replicas}
        down = [m for m in members if m not in serving]
        n = len(members)
        if self.state.update_error:
            self._set_status(
                ResourceStatus.ERROR, self._condition("ReplicasReady", False, "UpdateFailed", self.state.update_error)
            )
        elif self.state.outdated:
            rt = self.spec.runtime
            self._set_status(
                ResourceStatus.UPDATING,
                self._condition(
                    "ReplicasReady",
                    False,
                    "RollingUpdate",
                    f"rolling the replicas onto runtime version {rt.version!r} engineConfig "
                    f"{dict(sorted(rt.engine_config.items()))}: {len(self.state.outdated)} replica(s) "
                    f"still on the previous runtime, {len(serving)} serving",
                ),
            )
        elif self.unanswered:
            self._set_status(
                ResourceStatus.UPDATING,
                self._condition(
                    "ReplicasReady",
                    False,
                    admission.NODE_UNREACHABLE,
                    "node agent(s) did not answer the last check of their replicas (cut off from the control "
                    "plane?): " + self._unanswered_text(),
                ),
            )
        elif down and self.placement_error:
            self._set_status(
                ResourceStatus.UPDATING,
                self._condition(
                    "ReplicasReady",
                    False,
                    "InsufficientCapacity",
                    f"replica(s) {', '.join(down)} wait for a place: {self.placement_error}; "
                    f"{n - len(down)} of {n} serving",
                ),
            )
        elif down:
            self._set_status(
                ResourceStatus.UPDATING,
                self._condition(
                    "ReplicasReady",
                    False,
                    "ReplicasRestarting",
                    f"replica(s) {', '.join(down)} (re)starting; {n - len(down)} of {n} serving",
                ),
            )
        else:
            self._set_status(
                ResourceStatus.READY,
                self._condition("ReplicasReady", True, "AllReplicasReady", joined_message(n, len(self.joining))),
            )

    def _start_input(self, names_: list[str], joining: bool = False, base: bool = False) -> StartReplicasInput:
        """Start these replicas on the spec's runtime; each catches up to the latest completed
        snapshot chain (if any) before it reports ready, or stays on the model's base weights
        (`base`: a joiner that takes the snapshot from a serving peer); `joining`: a scale-out's,
        out of its engine's routing pool until it becomes a member."""
        latest = self.state.completed[-1].identity if self.state.completed and not base else None
        return StartReplicasInput(
            deployment_id=self.spec.id,
            deployment_workflow_id=workflow.info().workflow_id,
            names=names_,
            zone=self.state.gateway_zones[0] if self.state.gateway_zones else "LOCAL-1A",
            model=self.spec.model,
            engine=self.spec.runtime.engine,
            engine_config=self.spec.runtime.engine_config,
            target_chain=self.state.chains.get(latest) if latest else None,
            hot_load_config=self.spec.hot_load,
            placements={n: self.state.placements[n] for n in names_ if n in self.state.placements},
            joining=joining,
        )

    def _zone(self) -> str:
        return self.state.gateway_zones[0] if self.state.gateway_zones else "LOCAL-1A"

    async def _start(
        self,
        names_: list[str],
        timeout: timedelta,
        pickup: timedelta = replica_set.NODE_PICKUP,
        attempts: int = 3,
        joining: bool = False,
        base: bool = False,
    ) -> replica_set.StartOutcome:
        """Start these replicas where they are placed (placing those without a place first);
        raises `PlacementFailed` when they cannot all be placed."""
        return await replica_set.start(
            self.state,
            names_,
            lambda group: self._start_input(group, joining, base),
            self._zone(),
            timeout,
            pickup,
            attempts=attempts,
        )

    def _unanswered_text(self) -> str:
        return "; ".join(f"{node}: {why}" for node, why in sorted(self.unanswered.items()))

    def _failure_of(self, name: str) -> str | None:
        return next((f.reason for f in self.failures if f.name == name), None)

    def _condition(self, type_: str, ok: bool, reason: str, message: str) -> Condition:
        return Condition(
            type=type_,
            status=ConditionStatus.TRUE if ok else ConditionStatus.FALSE,
            reason=reason,
            message=message,
            zone=self.state.gateway_zones[0] if self.state.gateway_zones else None,
            last_update_time=self._now(),
        )

    # ------------------------------------------------------------------ main loop
    @workflow.run
    async def run(self, state: DeploymentInput) -> None:
        self._publish()
        if self.state.deployment.status.status == ResourceStatus.CREATING:
            await self._create_replicas()

        def may_continue_as_new() -> bool:
            return (
                workflow.info().is_continue_as_new_suggested()
                and self.state.active_hot_load_id is None
                and workflow.all_handlers_finished()
            )

        def roll_due() -> bool:
            return bool(self.state.outdated) and self.state.update_error is None and not self.deleting

        while not self.deleting:
            if may_continue_as_new():
                # With the memo as last published: a new run starts with the memo given here
                # (else the first run's start memo: CREATING, no replicas) until its first
                # upsert, and the API and every gateway read it meanwhile.
                workflow.continue_as_new(self.state, memo=self._published_memo())
            if roll_due():
                await self._roll()
                continue
            if (direction := self._scale_step()) != 0:
                await (self._scale_out() if direction > 0 else self._scale_in())
                continue
            try:
                await workflow.wait_condition(
                    lambda: self.deleting or may_continue_as_new() or roll_due() or self._scale_step() != 0,
                    timeout=SUPERVISE_EVERY,
                )
            except asyncio.TimeoutError:
                if self.state.deployment.status.status in SUPERVISED:
                    await self._restart_lost_replicas()
        await self._delete()

    async def _restart_lost_replicas(self, admitting: bool = False) -> list[str]:
        if admitting and self.replica_lock.locked():
            # A check in flight (bounded by CHECK_TIMEOUT): wait for it, not longer.
            try:
                await workflow.wait_condition(lambda: not self.replica_lock.locked(), timeout=ADMISSION_LOCK_WAIT)
            except asyncio.TimeoutError:
                raise rejected(
                    UNAVAILABLE,
                    "the deployment is busy with its replicas (a start or a stop), try again in a few seconds",
                ) from None
        return await self._check_replicas(admitting)

    async def _check_replicas(self, admitting: bool) -> list[str]:
        """Start every member replica whose process is gone (each node agent checks its pid
        files; a live one is left alone); returns the names started. Each catches up to the
        current chain before it reports ready; until then it is out of rotation and the
        deployment says STATUS_UPDATING. A member lost with its node is placed elsewhere, but
        not while a hot-load runs (it would catch up to the chain before it): once it ends."""
        async with self.replica_lock:
            if not self.state.members or self.deleting:
                return []
            members = list(self.state.members)
            if self.state.active_hot_load_id is not None and not admitting:
                members = [m for m in members if m in self.state.placements]
            try:
                outcome = await self._start(
                    members,
                    replica_set.CHECK_TIMEOUT,
                    replica_set.ADMISSION_PICKUP if admitting else replica_set.CHECK_PICKUP,
                    attempts=1,
                )
                self.placement_error = None
            except replica_set.PlacementFailed as exc:
                self.placement_error = str(exc)
                self._settle()
                return []
            was = self.unanswered
            self.unanswered = dict(outcome.failed)
            for node, why in outcome.failed.items():
                workflow.logger.warning("starting replicas on node %s failed: %s", node, why)
            restarted = outcome.started
            if self.unanswered != was and not restarted:
                self._settle()
            if restarted:
                workflow.logger.warning("restarted lost replica(s) %s", ", ".join(restarted))
                self.state.replicas = [r for r in self.state.replicas if r.name not in restarted]
                self.state.pending_replicas = sorted(set(self.state.pending_replicas) | set(restarted))
                # A restarted replica runs the spec's runtime: nothing left to roll on it.
                self.state.outdated = [n for n in self.state.outdated if n not in restarted]
                self.failures = [f for f in self.failures if f.name not in restarted]
                self._settle()
            return restarted

    async def _roll(self) -> None:
        """Replace each outdated replica by a new one on the spec's runtime, one at a time: the
        new one starts, catches up to the current chain and serves before the old one leaves
        rotation and stops, so the others keep serving throughout."""
        while self.state.outdated and self.state.update_error is None and not self.deleting:
            old = self.state.outdated[0]
            new = f"replica-{str(workflow.uuid4())[:8]}"
            self.state.members.append(new)
            self.state.pending_replicas.append(new)
            self._settle()
            failure: str | None = None
            try:
                async with self.replica_lock:
                    outcome = await self._start([new], timedelta(minutes=5))
                if outcome.failed:
                    raise RuntimeError(outcome.failures())
                await workflow.wait_condition(
                    lambda: (
                        new not in self.state.pending_replicas or self._failure_of(new) is not None or self.deleting
                    ),
                    timeout=REPLICA_START_TIMEOUT,
                )
                failure = self._failure_of(new)
            except asyncio.TimeoutError:
                failure = f"did not become ready within {REPLICA_START_TIMEOUT}"
            except Exception as exc:  # noqa: BLE001 - the activity failed: reported, not a crash
                failure = f"start failed: {exc.__cause__ or exc}"
            if self.deleting:
                return  # `_delete` stops every member, the new one included
            if failure is not None:
                await self._stop_replicas([new])
                rt = self.spec.runtime
                self.state.update_error = (
                    f"the update to runtime version {rt.version!r} engineConfig "
                    f"{dict(sorted(rt.engine_config.items()))} stopped: new replica {new} failed: {failure}; "
                    f"{len(self.state.outdated)} replica(s) still serve the previous runtime; update the "
                    "deployment again (a fixed or the previous runtime) to roll again"
                )
                workflow.logger.warning("rolling update stopped: %s", self.state.update_error)
                self._settle()
                return
            # The new replica serves: the one it replaces leaves rotation, then stops.
            await self._stop_replicas([old])
            self._settle()

    async def _stop_replicas(self, names_: list[str]) -> None:
        """Take these replicas out of the deployment (out of rotation first), then stop them."""
        self.state.replicas = [r for r in self.state.replicas if r.name not in names_]
        self.state.pending_replicas = [n for n in self.state.pending_replicas if n not in names_]
        self.state.members = [n for n in self.state.members if n not in names_]
        self.state.outdated = [n for n in self.state.outdated if n not in names_]
        self._publish()
        async with self.replica_lock:
            try:
                await replica_set.stop(self.state, names_)
            except Exception as exc:  # noqa: BLE001 - logged; they are out of rotation either way
                workflow.logger.warning("stopping replica(s) %s failed: %s", ", ".join(names_), exc)

    async def _create_replicas(self) -> None:
        count = max(1, self.spec.autoscaling.min)
        self.state.replica_generation += 1
        # Deterministic, unique names: a short random suffix from the workflow's seeded uuid.
        names_ = [f"replica-{str(workflow.uuid4())[:8]}" for _ in range(count)]
        self.state.pending_replicas = list(names_)
        self.state.members = list(names_)
        try:
            async with self.replica_lock:
                outcome = await self._start(names_, timedelta(minutes=5))
            if outcome.failed:
                raise RuntimeError(outcome.failures())
        except replica_set.PlacementFailed as exc:
            self._set_status(
                ResourceStatus.FAILED, self._condition("ReplicasReady", False, "InsufficientCapacity", str(exc))
            )
            return
        except Exception as exc:  # noqa: BLE001 - reported as a condition, not a crash
            self._set_status(
                ResourceStatus.FAILED,
                self._condition("ReplicasReady", False, "ReplicaStartFailed", str(exc.__cause__ or exc)),
            )
            return
        try:
            await workflow.wait_condition(
                lambda: not self.state.pending_replicas or bool(self.failures) or self.deleting,
                timeout=REPLICA_START_TIMEOUT,
            )
        except asyncio.TimeoutError:
            self._set_status(
                ResourceStatus.FAILED,
                self._condition(
                    "ReplicasReady",
                    False,
                    "ReplicaStartTimeout",
                    f"replicas {', '.join(self.state.pending_replicas)} did not become ready within "
                    f"{REPLICA_START_TIMEOUT}",
                ),
            )
            return
        if self.failures:
            reasons = "; ".join(f"{f.name}: {f.reason}" for f in self.failures)
            self._set_status(
                ResourceStatus.FAILED,
                self._condition("ReplicasReady", False, "ReplicaFailed", reasons),
            )
            return
        if not self.deleting:
            self._set_status(
                ResourceStatus.READY,
                self._condition("ReplicasReady", True, "AllReplicasReady", f"{count} replica(s) serving"),
            )

    async def _delete(self) -> None:
        self._set_status(ResourceStatus.DELETING)
        if self.state.active_hot_load_id:
            try:
                await workflow.get_external_workflow_handle(
                    names.hot_load_workflow_id(self.spec.organization_id, self.state.active_hot_load_id)
                ).cancel()
            except Exception:  # noqa: BLE001 - it may have just finished
                pass
        all_names = list(
            dict.fromkeys(
                [
                    *self.state.members,
                    *(r.name for r in self.state.replicas),
                    *self.state.pending_replicas,
                    *self.joining,
                ]
            )
        )
        await replica_set.stop(self.state, all_names)
        self.state.replicas = []
        self.state.pending_replicas = []
        self.state.members = []
        self._publish()

    # ------------------------------------------------------------------ replicas report in
    @workflow.signal(name=names.REPLICA_READY)
    def replica_ready(self, endpoint: ReplicaEndpoint) -> None:
        if endpoint.name in self.joining and not self.deleting:
            self.joining[endpoint.name] = endpoint  # it becomes a member between hot-loads (control/autoscaler.py)
            return
        if endpoint.name not in self.state.members or self.deleting:
            # A replica taken out of the deployment (replaced, or deleted) that reported late.
            workflow.logger.warning("ignoring ready from %s: not a replica of this deployment", endpoint.name)
            return
        self.state.replicas = [r for r in self.state.replicas if r.name != endpoint.name] + [endpoint]
        self.state.replicas.sort(key=lambda r: (r.zone, r.name))
        if endpoint.name in self.state.pending_replicas:
            self.state.pending_replicas.remove(endpoint.name)
        self._settle()

    @workflow.signal(name=names.REPLICA_RETRYING)
    def replica_retrying(self, retry: ReplicaFailure) -> None:
        """A replica's start met an error that may pass (an S3 read: replica/agent/retries.py)
        and tries again after a backoff: while the deployment is creating or updating its
        replicas, its condition says so (reason `ReplicaStartRetrying`) until the replica is
        ready or reports its start failed."""
        status = self.state.deployment.status.status
        if self.deleting or status not in (ResourceStatus.CREATING, ResourceStatus.UPDATING):
            return
        self._set_status(
            status, self._condition("ReplicasReady", False, "ReplicaStartRetrying", f"{retry.name}: {retry.reason}")
        )

    @workflow.signal(name=names.REPLICA_FAILED)
    def replica_failed(self, failure: ReplicaFailure) -> None:
        """A replica reports its engine dead or its start failed: out of rotation; during
        creation that fails the deployment, afterwards the periodic check restarts it."""
        self.failures.append(failure)
        self.state.replicas = [r for r in self.state.replicas if r.name != failure.name]
        self.state.pending_replicas = [n for n in self.state.pending_replicas if n != failure.name]
        self._settle()

    @workflow.signal(name=names.LOAD_REPORT)
    def load_report(self, report: LoadReport) -> None:
        """A gateway's judgement of the deployment's load (contracts/autoscaling.py)."""
        self._hear(report)

    @workflow.signal(name=names.REPLICAS_LOST)
    async def replicas_lost(self, lost: ReplicasLost) -> None:
        """The registry declared a node lost: its replicas here are out of rotation and lose
        their place (the supervision places them elsewhere, and they catch up); a running
        hot-load hears of it at once, so it does not wait out its timeouts for them."""
        mine = [n for n in lost.names if n in self.state.members]
        for name in mine:
            placement = self.state.placements.get(name)
            if placement is not None and placement.node == lost.node:
                del self.state.placements[name]
            self.replica_failed(ReplicaFailure(name=name, reason=lost.reason))
        active = self.state.active_hot_load_id
        if mine and active is not None:
            try:
                await workflow.get_external_workflow_handle(
                    names.hot_load_workflow_id(self.spec.organization_id, active)
                ).signal(names.REPLICAS_LOST, ReplicasLost(node=lost.node, names=mine, reason=lost.reason))
            except Exception as exc:  # noqa: BLE001 - it may have just ended
                workflow.logger.warning("could not tell hot-load %s of lost replicas: %s", active, exc)

    @workflow.update
    async def verify_replicas(self) -> str:
        """Start every replica whose process is gone, now (the control worker calls this for
        each deployment when it starts: after a stack restart no replica runs); returns the
        deployment's status after the check."""
        if not self.deleting and self.state.deployment.status.status in (ResourceStatus.CREATING, *SUPERVISED):
            await self._restart_lost_replicas()
        return self.state.deployment.status.status.value

    # ------------------------------------------------------------------ delete
    @workflow.update
    def delete(self) -> None:
        self.deleting = True

    # ------------------------------------------------------------------ configuration
    @workflow.update
    def update_config(self, cmd: UpdateDeploymentCommand) -> Deployment:
        self._check_update(cmd)  # again: a hot-load may have been admitted since the validator
        spec = self.spec
        roll = cmd.runtime is not None and (
            cmd.runtime.version != spec.runtime.version or dict(cmd.runtime.engine_config) != spec.runtime.engine_config
        )
        if cmd.runtime is not None:
            spec.runtime.version = cmd.runtime.version
            spec.runtime.engine_config = dict(cmd.runtime.engine_config)
        if cmd.traffic is not None:
            spec.traffic = cmd.traffic
        self.state.deployment.status.updated_at = cmd.updated_at
        if roll:
            # Every member runs an earlier runtime now; the main loop rolls them (`_roll`).
            walk = [r.name for r in self.state.replicas]
            self.state.outdated = walk + [m for m in self.state.members if m not in walk]
            self.state.update_error = None
            self._settle()  # STATUS_UPDATING before the update returns: no hot-load slips in
        else:
            self._publish()
        return self.state.deployment

    @update_config.validator
    def _validate_update(self, cmd: UpdateDeploymentCommand) -> None:
        self._check_update(cmd)

    def _check_update(self, cmd: UpdateDeploymentCommand) -> None:
        admission.check_update(self.state, cmd, deleting=self.deleting)

    def _not_ready(self) -> str:
        return admission.not_ready(self.state, deleting=self.deleting)

    # ------------------------------------------------------------------ reads
    @workflow.query
    def describe(self) -> DeploymentInput:
        return self.state


if TYPE_CHECKING:  # mypy proves the workflow implements every member its mixins' host declares
    _HOST: type[DeploymentHost] = DeploymentWorkflow
