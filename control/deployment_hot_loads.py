"""A deployment's hot-loads, mixed into the deployment workflow (control/deployment.py), whose
state, replica checks and memo it uses.

Admission: the `create_hot_load` validator applies the guide's rules without I/O
(control/admission.py) and the handler applies them again, marks the operation active before its
first await, checks that every replica process runs and that each snapshot the hot-load reads is
in the bucket with the fingerprint it was first verified with (`admission.links_to_check`,
`state.verified_snapshots`), then starts the hot-load as a child (ABANDON, REJECT_DUPLICATE) with
the request's trace. Invariants: a create not admitted leaves its id free and the deployment as
it was; the outcome is recorded once, idempotently, from the `hot_load_finished` signal or the
child's close; a child that closed without an outcome only clears the active operation, so no
hot-load blocks the deployment forever. docs/design.md, "Admission".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError, ChildWorkflowError, is_cancelled_exception
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from opentelemetry import context as otel_context
    from opentelemetry import propagate as otel_propagate

    from contracts import names
    from contracts.activities import CheckSnapshotInput
    from contracts.errors import ALREADY_EXISTS, FAILED_PRECONDITION, INVALID_ARGUMENT, UNAVAILABLE, rejected
    from contracts.records import (
        CompletedLink,
        CreateHotLoadCommand,
        HotLoad,
        HotLoadInput,
        HotLoadOutcome,
        HotLoadSpec,
        HotLoadState,
        HotLoadStatus,
        ResourceStatus,
        SnapshotRef,
    )
    from contracts.search import hot_load_attributes
    from control import admission
    from control.deployment_host import MixinBase
    from control.hot_load.state import details as hot_load_details
    from control.hot_load.state import summary as hot_load_summary

# Chains kept for later deltas to build on: the most recently completed identities. A delta whose
# predecessor fell out of this window is refused like one never loaded (publish a full one).
MAX_CHAINS_KEPT = 256
SEEN_IDS_KEPT = 1024


class HotLoads(MixinBase):
    """The deployment workflow's hot-loads (module docstring); the workflow is its host
    (control/deployment_host.py)."""

    @workflow.update
    async def create_hot_load(self, cmd: CreateHotLoadCommand) -> HotLoad:
        self._admit(cmd)  # again, synchronously: the state may have changed since the validator
        self.state.active_hot_load_id = cmd.hot_load_id
        self.state.seen_hot_load_ids.append(cmd.hot_load_id)
        # Bounded: ids older than this are refused by the child's REJECT_DUPLICATE id policy and
        # by the API's existence check; the list only guards creates racing each other.
        del self.state.seen_hot_load_ids[:-SEEN_IDS_KEPT]
        self._publish()
        # What this handler starts (file checks, the hot-load workflow) carries the API request's
        # trace, so each operation is one trace; without tracing this changes nothing.
        trace_token = otel_context.attach(otel_propagate.extract(cmd.trace_context)) if cmd.trace_context else None
        try:
            return await self._check_and_start(cmd)
        finally:
            if trace_token is not None:
                otel_context.detach(trace_token)

    def _admit_replicas(self, restarted: list[str]) -> None:
        """A hot-load is admitted only if every replica process ran at admission: READY is what
        the replicas last reported, and a stack restart or a crash since may have taken them
        down unseen (one that does not run was just restarted, and the deployment is UPDATING
        until it serves again)."""
        if restarted:
            raise rejected(FAILED_PRECONDITION, self._not_ready())
        if self.unanswered:
            # A node cut off from the control plane: its replicas could not take the update.
            raise rejected(
                UNAVAILABLE,
                "node agent(s) did not answer the check of their replicas, try again: " + self._unanswered_text(),
            )
        if self.state.deployment.status.status != ResourceStatus.READY:
            # Admitted while a node agent had missed the periodic check (every one answered this
            # one), or the replicas changed while it ran: READY is the rule either way.
            raise rejected(FAILED_PRECONDITION, self._not_ready())

    def _check_snapshots(self, links: list[SnapshotRef], new: SnapshotRef) -> list[Awaitable[Any]]:
        """One check of each of these snapshots (up to a 64-link chain in one round trip); the
        caller reports the first failing link in chain order. Each link other than `new` (the
        chain's new link) that admission verified before is checked against its fingerprint then."""
        hl_cfg = self.spec.hot_load
        assert hl_cfg is not None
        return [
            workflow.execute_activity(
                names.CHECK_SNAPSHOT,
                CheckSnapshotInput(
                    bucket=hl_cfg.bucket,
                    path_prefix=hl_cfg.path_prefix,
                    identity=link.identity,
                    type=link.type,
                    verified=None if link is new else self.state.verified_snapshots.get(link.identity),
                ),
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=RetryPolicy(maximum_attempts=3, non_retryable_error_types=[FAILED_PRECONDITION]),
            )
            for link in links
        ]

    def _verified(self, links: list[SnapshotRef], checks: list[Any]) -> None:
        """Keep each checked link's fingerprint (a check answers `[fingerprint]`)."""
        for link, answer in zip(links, checks, strict=True):
            self.state.verified_snapshots[link.identity] = answer[0]

    async def _check_and_start(self, cmd: CreateHotLoadCommand) -> HotLoad:
        chain = admission.resolve_chain(self.state, cmd)
        hl_cfg = self.spec.hot_load
        assert hl_cfg is not None
        try:
            # Chosen before the first await: from what the replicas serve as admitted.
            links, new = admission.links_to_check(self.state, chain), chain[-1]
            # The replica check and the snapshot checks run together; their verdicts are read in
            # the order below, so the error a caller sees is the same.
            replicas, *checks = await asyncio.gather(
                self._restart_lost_replicas(admitting=True),
                *self._check_snapshots(links, new),
                return_exceptions=True,
            )
            if isinstance(replicas, BaseException):
                raise replicas
            self._admit_replicas(replicas)
            for outcome in checks:
                if isinstance(outcome, BaseException):
                    raise outcome
            self._verified(links, checks)
            hot_load = HotLoad(
                spec=HotLoadSpec(
                    id=cmd.hot_load_id,
                    deployment_id=self.spec.id,
                    organization_id=self.spec.organization_id,
                    identity=cmd.identity,
                    type=cmd.type,
                    incremental_snapshot_metadata=cmd.incremental_snapshot_metadata,
                    prompt_cache_policy=cmd.prompt_cache_policy,
                    snapshot_chain=chain,
                ),
                status=HotLoadStatus(state=HotLoadState.PENDING, created_at=cmd.created_at, updated_at=cmd.created_at),
            )
            inp = HotLoadInput(
                hot_load=hot_load,
                hot_load_config=hl_cfg,
                replicas=list(self.state.replicas),
                deployment_workflow_id=workflow.info().workflow_id,
            )
            child = await workflow.start_child_workflow(
                names.HOT_LOAD_WORKFLOW,
                inp,
                id=names.hot_load_workflow_id(self.spec.organization_id, cmd.hot_load_id),
                result_type=HotLoadOutcome,
                # What the Temporal UI shows of the operation before opening it.
                static_summary=hot_load_summary(hot_load),
                static_details=hot_load_details(inp),
                # The hot-load goes on (and reports) whatever becomes of this workflow run.
                parent_close_policy=ParentClosePolicy.ABANDON,
                # A hot-load id names one operation forever, even after it closed.
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=hot_load_attributes(hot_load),
                memo={"hotLoad": hot_load.wire()},
            )
        except Exception as exc:
            # Not admitted: the id stays free for a retry once the cause is fixed.
            self.state.active_hot_load_id = None
            if cmd.hot_load_id in self.state.seen_hot_load_ids:
                self.state.seen_hot_load_ids.remove(cmd.hot_load_id)
            self._publish()
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            if isinstance(cause, ApplicationError) and cause.type in (FAILED_PRECONDITION, INVALID_ARGUMENT):
                raise rejected(cause.type, cause.message) from None
            if type(exc).__name__ == "WorkflowAlreadyStartedError":
                raise rejected(ALREADY_EXISTS, f"hot-load {cmd.hot_load_id} already exists") from None
            if isinstance(cause, ApplicationError) or type(cause).__name__ == "TimeoutError":
                raise rejected(UNAVAILABLE, f"checking the snapshot files failed, try again: {cause}") from None
            raise
        asyncio.create_task(self._watch(child, cmd.hot_load_id))  # deterministic: the workflow loop
        return hot_load

    async def _watch(self, child: workflow.ChildWorkflowHandle[Any, Any], hot_load_id: str) -> None:
        """Takes note of the child's end however it closes: its outcome when it has one (the
        result of a COMPLETED hot-load, the failure details of a FAILED one), else (canceled,
        terminated, timed out) it only clears the active operation."""
        try:
            outcome = await child
        except Exception as exc:  # noqa: BLE001 - a failed child is an outcome, never this workflow's failure
            outcome = _outcome_of(exc)
            if outcome is None:
                if not is_cancelled_exception(exc):  # a canceled one reported by its signal
                    workflow.logger.warning("hot-load %s closed without an outcome: %s", hot_load_id, exc)
                if self.state.active_hot_load_id == hot_load_id:
                    self.state.active_hot_load_id = None
                    self._publish()
                return
        self._finish(outcome)

    @create_hot_load.validator
    def _validate_create(self, cmd: CreateHotLoadCommand) -> None:
        self._admit(cmd)

    def _admit(self, cmd: CreateHotLoadCommand) -> None:
        admission.admit(self.state, cmd, deleting=self.deleting)

    @workflow.signal
    def hot_load_finished(self, outcome: HotLoadOutcome) -> None:
        self._finish(outcome)

    def _finish(self, outcome: HotLoadOutcome) -> None:
        """Take note of an ended hot-load; idempotent (the signal and the watcher both call it)."""
        first = self.state.active_hot_load_id == outcome.hot_load_id
        if first:
            self.state.active_hot_load_id = None
        if first:
            served = {r.name: r.current_snapshot_identity for r in outcome.replicas}
            for r in self.state.replicas:
                if served.get(r.name):
                    r.current_snapshot_identity = served[r.name]
        already = any(link.hot_load_id == outcome.hot_load_id for link in self.state.completed)
        if outcome.state == HotLoadState.COMPLETED and outcome.chain and not already:
            # Re-inserted last, so the dict's order is completion order (oldest first).
            self.state.chains.pop(outcome.identity, None)
            self.state.chains[outcome.identity] = outcome.chain
            while len(self.state.chains) > MAX_CHAINS_KEPT:
                del self.state.chains[next(iter(self.state.chains))]
            self.state.completed.append(
                CompletedLink(
                    identity=outcome.identity,
                    type=outcome.chain[-1].type,
                    hot_load_id=outcome.hot_load_id,
                    previous_identity=outcome.chain[-2].identity if len(outcome.chain) > 1 else None,
                )
            )
            # Any chain needs at most 64 links; older completions only make the state bigger.
            self.state.completed = self.state.completed[-64:]
            # Fingerprints only of snapshots a kept chain holds (a failed hot-load's new one
            # goes too); only here, where no other hot-load can have been admitted since.
            kept = {link.identity for chain in self.state.chains.values() for link in chain}
            for identity in [i for i in self.state.verified_snapshots if i not in kept]:
                del self.state.verified_snapshots[identity]
        self._publish()


def _outcome_of(exc: BaseException) -> HotLoadOutcome | None:
    """The outcome a FAILED hot-load carries in its failure's details, if `exc` is that failure."""
    cause = exc.cause if isinstance(exc, ChildWorkflowError) else None
    if isinstance(cause, ApplicationError) and cause.details:
        try:
            return HotLoadOutcome.model_validate(cause.details[0])
        except ValueError:
            return None
    return None
