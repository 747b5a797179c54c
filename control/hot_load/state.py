"""What a hot-load workflow shows: the operation and its replicas, as the API and the UI read them.

`WalkState` holds the hot-load wire object and one `Replica` per replica in walk order. Every
change is published at once, so reads need no worker: the memo (`hotLoad` and the replica
entries in chunks, contracts/memo.py; a change rewrites only its own chunk), the search
attribute `HotLoadState`, and the workflow's current details for the Temporal UI. States:
PENDING → IN_PROGRESS → COMPLETED | FAILED | CANCELED; a replica PENDING_UPDATE → UPDATING →
READY | ERROR.
"""

from __future__ import annotations

from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from contracts.memo import ChunkedList
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
        SnapshotType,
        rfc3339,
    )
    from contracts.search import STATE


def error_reason(exc: BaseException) -> str:
    """The message of what failed: an activity's cause, else the error itself."""
    cause = exc.__cause__ if isinstance(exc, ActivityError) and exc.__cause__ else exc
    if isinstance(cause, ApplicationError):
        return cause.message
    return str(cause)


def summary(hot_load: HotLoad) -> str:
    """One line naming the operation (the UI's static summary of a hot-load workflow)."""
    spec = hot_load.spec
    kind = "delta" if spec.type == SnapshotType.INCREMENTAL else "full"
    return f"hot-load {spec.id}: {spec.identity} ({kind}) on {spec.deployment_id}"


def details(inp: HotLoadInput) -> str:
    """What the operation is, in a few lines (the UI's static details of a hot-load workflow)."""
    spec = inp.hot_load.spec
    chain = " → ".join(link.identity for link in spec.snapshot_chain)
    names = ", ".join(r.name for r in sorted(inp.replicas, key=lambda r: (r.zone, r.name)))
    return "\n".join(
        [
            f"**{spec.identity}** ({spec.type.value}) on deployment `{spec.deployment_id}` "
            f"(organization `{spec.organization_id}`)",
            f"chain: {chain}",
            f"bucket: s3://{inp.hot_load_config.bucket}/{inp.hot_load_config.path_prefix}/",
            f"prompt cache: {spec.prompt_cache_policy.value}",
            f"replicas, in walk order: {names or 'none'}",
        ]
    )


def walk_order(endpoints: list[ReplicaEndpoint]) -> list[ReplicaEndpoint]:
    return sorted(endpoints, key=lambda r: (r.zone, r.name))


class WalkState:
    def __init__(self, inp: HotLoadInput) -> None:
        self.hot_load: HotLoad = inp.hot_load
        self.replicas: list[Replica] = [
            Replica(
                name=r.name,
                state=ReplicaState.PENDING_UPDATE,
                zone=r.zone,
                current_snapshot_identity=r.current_snapshot_identity,
                transitioned_at=r.transitioned_at or r.started_at,
                updated_at=inp.hot_load.status.created_at,
                node=r.node or None,
            )
            for r in walk_order(inp.replicas)
        ]
        # replica name -> what its step in flight does (shown while it is UPDATING).
        self._doing: dict[str, str] = {}
        self._memo = ChunkedList()

    @property
    def state(self) -> HotLoadState:
        return self.hot_load.status.state

    @staticmethod
    def now() -> str:
        return rfc3339(workflow.now())

    # ------------------------------------------------------------------ changes
    def publish(self) -> None:
        workflow.upsert_memo({"hotLoad": self.hot_load.wire(), **self._memo.changes([r.wire() for r in self.replicas])})
        workflow.set_current_details(self.progress())

    def set_state(self, state: HotLoadState, condition: Condition | None = None) -> None:
        self._record(state, condition)
        self.publish_state()

    def publish_state(self) -> None:
        """Make the operation's state visible: its search attribute and its memo."""
        workflow.upsert_search_attributes([STATE.value_set(self.state.value)])
        self.publish()

    def _record(self, state: HotLoadState, condition: Condition | None = None) -> None:
        st = self.hot_load.status
        now = self.now()
        st.state = state
        st.updated_at = now
        if state.terminal:
            st.finished_at = now
        if state == HotLoadState.CANCELED:
            st.canceled_at = now
        if condition is not None:
            st.conditions.append(condition)

    def moved(self, replica: Replica, state: ReplicaState, **fields: Any) -> None:
        now = self.now()
        replica.state = state
        replica.transitioned_at = now
        replica.updated_at = now
        for k, v in fields.items():
            setattr(replica, k, v)
        self.hot_load.status.updated_at = now
        self.publish()

    def doing(self, replica: Replica, what: str) -> None:
        """What `replica`'s step does now (the UI's live details); published at once."""
        self._doing[replica.name] = what
        workflow.set_current_details(self.progress())

    # ------------------------------------------------------------------ ends
    # An end is recorded here, not published: the workflow tells its deployment first and then
    # calls `publish_state`, so no read shows a terminal state that admission does not know yet.
    def completed(self) -> None:
        spec = self.hot_load.spec
        self._record(
            HotLoadState.COMPLETED,
            self._condition("Completed", "AllReplicasReady", f"{len(self.replicas)} replica(s) serve {spec.identity}"),
        )

    def failed(self, reason: str, message: str) -> None:
        self._record(HotLoadState.FAILED, self._condition("Failed", reason, f"{message}; {self.served('failed')}"))

    def canceled(self) -> None:
        self._record(HotLoadState.CANCELED, self._condition("Canceled", "Canceled", self.served("canceled")))

    def outcome(self) -> HotLoadOutcome:
        spec = self.hot_load.spec
        return HotLoadOutcome(
            hot_load_id=spec.id,
            identity=spec.identity,
            state=self.state,
            replicas=self.replicas,
            chain=spec.snapshot_chain,
        )

    # ------------------------------------------------------------------ views
    def served(self, verb: str) -> str:
        """What the replicas serve now, in words (the end condition's message)."""
        served = sorted({r.current_snapshot_identity for r in self.replicas})
        if len(served) > 1:
            return f"the operation {verb} with replicas serving different snapshots: {', '.join(served)}"
        return f"every replica serves {served[0] if served else 'nothing'}"

    def progress(self) -> str:
        """The walk at a glance: the state, the READY count, each replica in flight or failed."""
        ready = sum(1 for r in self.replicas if r.state == ReplicaState.READY)
        parts = [f"{self.state.value.removeprefix('HOT_LOAD_STATE_')}: {ready}/{len(self.replicas)} replicas READY"]
        for r in self.replicas:
            if r.state == ReplicaState.UPDATING:
                what = self._doing.get(r.name)
                parts.append(f"{r.name} UPDATING ({what})" if what else f"{r.name} UPDATING")
            elif r.state == ReplicaState.ERROR:
                parts.append(f"{r.name} ERROR: {r.error_reason}")
        return "; ".join(parts)

    def _condition(self, type_: str, reason: str, message: str) -> Condition:
        return Condition(
            type=type_,
            status=ConditionStatus.TRUE,
            reason=reason,
            message=message,
            last_update_time=self.now(),
        )
