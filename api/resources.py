"""Reads and writes of gateways, deployments and hot-loads, all through Temporal.

Every resource is a workflow (`deployments/ORG/ID`, `gateways/ORG/ID`, `hotLoads/ORG/ID`) that
publishes its wire object in its memo. Invariants: each lookup builds the workflow id from the
caller's organization (and checks the memo's organization), so another organization's resource
is not found; reads use describe/list, never a query, so they work with no worker running and
for closed operations; a hot-load closed without recording an end reads as FAILED/CANCELED
(`reconcile_hot_load`). Hot-loads are read as `Record`s (api/listing.py, api/open_reads.py).
Writes are workflow starts and Updates; an Update's `ApplicationError` type is the API code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from api.listing import HotLoadIndex, Record, page, quote
from api.open_reads import OpenReads
from contracts import names
from contracts.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable, from_code
from contracts.memo import replica_list
from contracts.records import (
    TERMINAL_HOT_LOAD_STATES,
    CreateHotLoadCommand,
    Deployment,
    DeploymentInput,
    Gateway,
    HotLoad,
    UpdateDeploymentCommand,
    rfc3339,
)
from contracts.search import deployment_attributes, gateway_attributes

__all__ = ["Resources", "page", "reconcile_hot_load", "update_error"]

_Resource = TypeVar("_Resource", Gateway, Deployment)


def update_error(exc: WorkflowUpdateFailedError) -> Exception:
    cause: BaseException | None = exc.cause
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__
    if isinstance(cause, ApplicationError) and cause.type:
        return from_code(cause.type, cause.message)
    return from_code("internal", f"update failed: {exc.cause or exc}")


class Resources:
    def __init__(
        self,
        client: Client,
        *,
        task_queue: str = names.CONTROL_TASK_QUEUE,
        hot_load_view: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        self.client = client
        # The control worker's queue; tests run the workflows on a queue of their own.
        self.task_queue = task_queue
        # `hot_load_view` completes a hot-load's wire object (its UI link) once per record.
        self.hot_loads = HotLoadIndex(client, reconcile_hot_load, hot_load_view)
        self.open_reads = OpenReads(self.hot_loads)

    # ------------------------------------------------------------------ plumbing
    async def memo(self, workflow_id: str, *, running_only: bool = False) -> dict[str, Any] | None:
        try:
            desc = await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                return None
            raise Unavailable(f"Temporal is unavailable: {exc.message}") from exc
        if running_only and desc.status is not None and desc.status.name != "RUNNING":
            return None
        return await desc.memo()  # type: ignore[return-value]  # memo(): a dict, typed Mapping

    async def _running(self, workflow_id: str, key: str, model: type[_Resource], org: str, what: str) -> _Resource:
        """The running workflow's ``memo[key]`` as ``model``, when it is ``org``'s; else NotFound naming ``what``."""
        memo = await self.memo(workflow_id, running_only=True)
        if not memo or key not in memo:
            raise NotFound(f"{what} not found")
        resource = model.model_validate(memo[key])
        if resource.spec.organization_id != org:
            raise NotFound(f"{what} not found")
        return resource

    async def _start_new(self, workflow: str, arg: Any, workflow_id: str, what: str, **options: Any) -> None:
        """Start a resource's workflow under an id no workflow has had; AlreadyExists naming ``what``
        when it had one."""
        try:
            await self.client.start_workflow(
                workflow,
                arg,
                id=workflow_id,
                task_queue=self.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                **options,
            )
        except Exception as exc:
            if type(exc).__name__ == "WorkflowAlreadyStartedError":
                raise AlreadyExists(f"{what} already exists") from None
            raise

    async def list_memos(self, query: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            async for wf in self.client.list_workflows(query, page_size=1000):
                out.append(await wf.memo())  # type: ignore[arg-type]  # memo(): a dict, typed Mapping
        except RPCError as exc:
            raise Unavailable(f"Temporal is unavailable: {exc.message}") from exc
        return out

    # ------------------------------------------------------------------ gateways
    async def get_gateway(self, org: str, gateway_id: str) -> Gateway:
        return await self._running(
            names.gateway_workflow_id(org, gateway_id), "gateway", Gateway, org, f"gateway {gateway_id}"
        )

    async def list_gateways(self, org: str) -> list[Gateway]:
        memos = await self.list_memos(
            f"ResourceKind='gateway' AND OrganizationId={quote(org)} AND ExecutionStatus='Running'"
        )
        gws = [Gateway.model_validate(m["gateway"]) for m in memos if "gateway" in m]
        return sorted(gws, key=lambda g: g.spec.name)

    async def create_gateway(self, gateway: Gateway) -> Gateway:
        await self._start_new(
            names.GATEWAY_WORKFLOW,
            gateway,
            names.gateway_workflow_id(gateway.spec.organization_id, gateway.spec.id),
            f"gateway {gateway.spec.id}",
            search_attributes=gateway_attributes(gateway),
            memo={"gateway": gateway.wire()},
        )
        return gateway

    async def delete_gateway(self, org: str, gateway_id: str) -> None:
        await self.get_gateway(org, gateway_id)
        users = [d for d in await self.list_deployments(org) if gateway_id in d.spec.gateway_ids]
        if users:
            raise FailedPrecondition(
                f"gateway {gateway_id} is used by deployment(s) {', '.join(d.spec.id for d in users)}; delete them "
                "first"
            )
        handle = self.client.get_workflow_handle(names.gateway_workflow_id(org, gateway_id))
        await handle.execute_update(names.DELETE)

    # ------------------------------------------------------------------ deployments
    async def get_deployment(self, org: str, deployment_id: str) -> Deployment:
        return await self._running(
            names.deployment_workflow_id(org, deployment_id),
            "deployment",
            Deployment,
            org,
            f"deployment {deployment_id}",
        )

    async def list_deployments(self, org: str, gateway_id: str | None = None) -> list[Deployment]:
        memos = await self.list_memos(
            f"ResourceKind='deployment' AND OrganizationId={quote(org)} AND ExecutionStatus='Running'"
        )
        deps = [Deployment.model_validate(m["deployment"]) for m in memos if "deployment" in m]
        if gateway_id:
            deps = [d for d in deps if gateway_id in d.spec.gateway_ids]
        return sorted(deps, key=lambda d: d.spec.name)

    async def create_deployment(self, state: DeploymentInput) -> Deployment:
        dep = state.deployment
        await self._start_new(
            names.DEPLOYMENT_WORKFLOW,
            state,
            names.deployment_workflow_id(dep.spec.organization_id, dep.spec.id),
            f"deployment {dep.spec.id}",
            search_attributes=deployment_attributes(dep.spec.organization_id, dep.spec.id),
            memo={"deployment": dep.wire(), "replicas": []},
        )
        return dep

    async def update_deployment(self, org: str, deployment_id: str, cmd: UpdateDeploymentCommand) -> Deployment:
        await self.get_deployment(org, deployment_id)
        handle = self.client.get_workflow_handle(names.deployment_workflow_id(org, deployment_id))
        try:
            return await handle.execute_update(names.UPDATE_CONFIG, cmd, result_type=Deployment)
        except WorkflowUpdateFailedError as exc:
            raise update_error(exc) from None

    async def delete_deployment(self, org: str, deployment_id: str) -> None:
        await self.get_deployment(org, deployment_id)
        handle = self.client.get_workflow_handle(names.deployment_workflow_id(org, deployment_id))
        try:
            await handle.execute_update(names.DELETE)
        except WorkflowUpdateFailedError as exc:
            raise update_error(exc) from None

    # ------------------------------------------------------------------ hot-loads
    async def create_hot_load(self, org: str, deployment_id: str, cmd: CreateHotLoadCommand) -> Record:
        workflow_id = names.hot_load_workflow_id(org, cmd.hot_load_id)
        known = self.hot_loads.closed(workflow_id)
        if known is not None or await self.memo(workflow_id) is not None:
            raise AlreadyExists(f"hot-load {cmd.hot_load_id} already exists")
        handle = self.client.get_workflow_handle(names.deployment_workflow_id(org, deployment_id))
        for attempt in range(2):
            try:
                hot_load = await handle.execute_update(names.CREATE_HOT_LOAD, cmd, result_type=HotLoad)
                return self.hot_loads.created(hot_load.wire())  # listed from now on
            except WorkflowUpdateFailedError as exc:
                err = update_error(exc)
            if not isinstance(err, AlreadyExists) or attempt:
                raise err
            # A retry of a create whose first attempt is still being admitted (the API died or the
            # client gave up mid-request): answer already_exists once the operation exists, so
            # the client's GET finds it; if that admission failed meanwhile, try this one.
            if await self._appears(workflow_id):
                raise err
        raise AssertionError("unreachable")

    async def _appears(self, workflow_id: str, within_s: float = 30.0) -> bool:
        deadline = asyncio.get_running_loop().time() + within_s
        while asyncio.get_running_loop().time() < deadline:
            if await self.memo(workflow_id) is not None:
                return True
            await asyncio.sleep(0.1)
        return False

    async def hot_load(self, org: str, hot_load_id: str, *, replicas: bool = False, fresh: bool = False) -> Record:
        """The operation as it stands: from memory once it closed, else described now, or from
        the last describe when this one is late (api/open_reads.py), waited for when `fresh` (its
        replica entries decoded only when asked for)."""
        workflow_id = names.hot_load_workflow_id(org, hot_load_id)
        rec = self.hot_loads.closed(workflow_id)
        if rec is None:
            try:
                if fresh:
                    rec = await self.hot_loads.read(workflow_id, replicas=replicas)
                else:
                    rec = await self.open_reads.read(workflow_id, replicas=replicas)
            except RPCError as exc:
                raise Unavailable(f"Temporal is unavailable: {exc.message}") from exc
        if rec is None or rec.organization_id != org:
            raise NotFound(f"hot-load {hot_load_id} not found")
        return rec

    async def list_hot_loads(
        self, org: str, deployment_id: str | None, max_page_size: int | None, page_token: str | None
    ) -> tuple[list[bytes], str | None]:
        """A page, newest first, each hot-load as JSON (see api/listing.py for how this stays
        fast and correct)."""
        return await self.hot_loads.page(org, deployment_id, max_page_size, page_token)

    async def cancel_hot_load(self, org: str, hot_load_id: str) -> Record:
        workflow_id = names.hot_load_workflow_id(org, hot_load_id)
        rec = await self.hot_load(org, hot_load_id, fresh=True)
        try:
            await self.client.get_workflow_handle(workflow_id).cancel()
        except RPCError as exc:
            if exc.status != RPCStatusCode.NOT_FOUND:  # NOT_FOUND: it closed meanwhile
                raise Unavailable(f"Temporal is unavailable: {exc.message}") from exc
        finally:
            self.open_reads.forget(workflow_id)  # reads from now on show the cancel's effect
        return rec


def reconcile_hot_load(
    memo: dict[str, Any], status: WorkflowExecutionStatus | None, close_time: datetime | None
) -> dict[str, Any]:
    """The operation as it really stands when its workflow closed without recording an end (an
    operator terminated it, it timed out or failed): FAILED (CANCELED if it was canceled) with a
    condition saying why, and a replica caught mid-step as ERROR, since what it serves is unknown.
    """
    hl = memo["hotLoad"]
    st = hl["status"]
    if status is None or status == WorkflowExecutionStatus.RUNNING or st["state"] in TERMINAL_HOT_LOAD_STATES:
        return memo
    canceled = status == WorkflowExecutionStatus.CANCELED
    when = rfc3339(close_time) if close_time else st.get("updatedAt")
    why = f"the operation's workflow ended {status.name} before it recorded a result"
    st["state"] = "HOT_LOAD_STATE_CANCELED" if canceled else "HOT_LOAD_STATE_FAILED"
    st["updatedAt"] = st["finishedAt"] = when
    if canceled:
        st["canceledAt"] = when
    st.setdefault("conditions", []).append(
        {
            "type": "Canceled" if canceled else "Failed",
            "status": "STATUS_TRUE",
            "reason": f"Workflow{status.name.title().replace('_', '')}",
            "message": why,
            "lastUpdateTime": when,
        }
    )
    for replica in replica_list(memo):
        if replica.get("state") == "UPDATING":
            replica.update(
                state="ERROR",
                finishedAt=when,
                transitionedAt=when,
                updatedAt=when,
                errorReason=f"{why}, during this replica's step; it serves {replica.get('currentSnapshotIdentity')} "
                "or the target, see the replica's log",
            )
    return memo
