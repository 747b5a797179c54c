"""Reads and writes of gateways, deployments and hot-loads, all through Temporal.

Temporal is the system of record: every resource is a workflow (deployments and gateways are
entity workflows `deployments/ID`, `gateways/ID`; a hot-load is the workflow whose id is the
hot-load id) that publishes its wire object in its memo. Reads use describe/list (visibility),
never a query, so they work with no worker running and for closed operations. Writes are workflow
starts and Updates; an Update's `ApplicationError` type is the API error code.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from api.errors import AlreadyExists, InvalidArgument, NotFound, Unavailable, from_code
from workflows import names
from workflows.deployment import DeploymentWorkflow, search_attributes as deployment_attributes
from workflows.gateway import GatewayWorkflow, search_attributes as gateway_attributes
from workflows.types import CreateHotLoadCommand, Deployment, DeploymentInput, Gateway, HotLoad

MAX_PAGE_SIZE = 1000
DEFAULT_PAGE_SIZE = 50


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def update_error(exc: WorkflowUpdateFailedError) -> Exception:
    cause = exc.cause
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__
    if isinstance(cause, ApplicationError) and cause.type:
        return from_code(cause.type, cause.message)
    return from_code("internal", f"update failed: {exc.cause or exc}")


class Resources:
    def __init__(self, client: Client) -> None:
        self.client = client

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
        return await desc.memo()

    async def list_memos(self, query: str) -> list[dict[str, Any]]:
        out = []
        try:
            async for wf in self.client.list_workflows(query, page_size=1000):
                out.append(await wf.memo())
        except RPCError as exc:
            raise Unavailable(f"Temporal is unavailable: {exc.message}") from exc
        return out

    # ------------------------------------------------------------------ gateways
    async def get_gateway(self, org: str, gateway_id: str) -> Gateway:
        memo = await self.memo(names.gateway_workflow_id(gateway_id), running_only=True)
        if not memo or "gateway" not in memo:
            raise NotFound(f"gateway {gateway_id} not found")
        gw = Gateway.model_validate(memo["gateway"])
        if gw.spec.organization_id != org:
            raise NotFound(f"gateway {gateway_id} not found")
        return gw

    async def list_gateways(self, org: str) -> list[Gateway]:
        memos = await self.list_memos(
            f"ResourceKind='gateway' AND OrganizationId={_quote(org)} AND ExecutionStatus='Running'"
        )
        gws = [Gateway.model_validate(m["gateway"]) for m in memos if "gateway" in m]
        return sorted(gws, key=lambda g: g.spec.name)

    async def create_gateway(self, gateway: Gateway) -> Gateway:
        try:
            await self.client.start_workflow(
                GatewayWorkflow.run,
                gateway,
                id=names.gateway_workflow_id(gateway.spec.id),
                task_queue=names.CONTROL_TASK_QUEUE,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=gateway_attributes(gateway),
                memo={"gateway": gateway.wire()},
            )
        except Exception as exc:
            if type(exc).__name__ == "WorkflowAlreadyStartedError":
                raise AlreadyExists(f"gateway {gateway.spec.id} already exists") from None
            raise
        return gateway

    async def delete_gateway(self, org: str, gateway_id: str) -> None:
        await self.get_gateway(org, gateway_id)
        users = [d for d in await self.list_deployments(org) if gateway_id in d.spec.gateway_ids]
        if users:
            from api.errors import FailedPrecondition

            raise FailedPrecondition(
                f"gateway {gateway_id} is used by deployment(s) {', '.join(d.spec.id for d in users)}; delete them first"
            )
        handle = self.client.get_workflow_handle(names.gateway_workflow_id(gateway_id))
        await handle.execute_update(GatewayWorkflow.delete)

    # ------------------------------------------------------------------ deployments
    async def get_deployment(self, org: str, deployment_id: str) -> Deployment:
        memo = await self.memo(names.deployment_workflow_id(deployment_id), running_only=True)
        if not memo or "deployment" not in memo:
            raise NotFound(f"deployment {deployment_id} not found")
        dep = Deployment.model_validate(memo["deployment"])
        if dep.spec.organization_id != org:
            raise NotFound(f"deployment {deployment_id} not found")
        return dep

    async def list_deployments(self, org: str, gateway_id: str | None = None) -> list[Deployment]:
        memos = await self.list_memos(
            f"ResourceKind='deployment' AND OrganizationId={_quote(org)} AND ExecutionStatus='Running'"
        )
        deps = [Deployment.model_validate(m["deployment"]) for m in memos if "deployment" in m]
        if gateway_id:
            deps = [d for d in deps if gateway_id in d.spec.gateway_ids]
        return sorted(deps, key=lambda d: d.spec.name)

    async def create_deployment(self, state: DeploymentInput) -> Deployment:
        dep = state.deployment
        try:
            await self.client.start_workflow(
                DeploymentWorkflow.run,
                state,
                id=names.deployment_workflow_id(dep.spec.id),
                task_queue=names.CONTROL_TASK_QUEUE,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=deployment_attributes(dep.spec.organization_id, dep.spec.id),
                memo={"deployment": dep.wire(), "replicas": []},
            )
        except Exception as exc:
            if type(exc).__name__ == "WorkflowAlreadyStartedError":
                raise AlreadyExists(f"deployment {dep.spec.id} already exists") from None
            raise
        return dep

    async def delete_deployment(self, org: str, deployment_id: str) -> None:
        await self.get_deployment(org, deployment_id)
        handle = self.client.get_workflow_handle(names.deployment_workflow_id(deployment_id))
        try:
            await handle.execute_update(DeploymentWorkflow.delete)
        except WorkflowUpdateFailedError as exc:
            raise update_error(exc) from None

    # ------------------------------------------------------------------ hot-loads
    async def create_hot_load(self, deployment_id: str, cmd: CreateHotLoadCommand) -> HotLoad:
        if await self.memo(names.hot_load_workflow_id(cmd.hot_load_id)) is not None:
            raise AlreadyExists(f"hot-load {cmd.hot_load_id} already exists")
        handle = self.client.get_workflow_handle(names.deployment_workflow_id(deployment_id))
        try:
            return await handle.execute_update(DeploymentWorkflow.create_hot_load, cmd, result_type=HotLoad)
        except WorkflowUpdateFailedError as exc:
            raise update_error(exc) from None

    async def hot_load_memo(self, org: str, hot_load_id: str) -> dict[str, Any]:
        memo = await self.memo(names.hot_load_workflow_id(hot_load_id))
        if not memo or "hotLoad" not in memo:
            raise NotFound(f"hot-load {hot_load_id} not found")
        if memo["hotLoad"]["spec"].get("organizationId") != org:
            raise NotFound(f"hot-load {hot_load_id} not found")
        return memo

    async def list_hot_loads(self, org: str, deployment_id: str | None) -> list[dict[str, Any]]:
        query = f"ResourceKind='hotLoad' AND OrganizationId={_quote(org)}"
        if deployment_id:
            query += f" AND DeploymentId={_quote(deployment_id)}"
        hot_loads = [m["hotLoad"] for m in await self.list_memos(query) if "hotLoad" in m]
        # The SQLite visibility store cannot ORDER BY: order here, newest first, id breaking ties.
        hot_loads.sort(key=lambda h: (h["status"]["createdAt"], h["spec"]["id"]), reverse=True)
        return hot_loads

    async def cancel_hot_load(self, org: str, hot_load_id: str) -> dict[str, Any]:
        memo = await self.hot_load_memo(org, hot_load_id)
        await self.client.get_workflow_handle(names.hot_load_workflow_id(hot_load_id)).cancel()
        return memo


# ---------------------------------------------------------------------- pagination
def page(items: list[Any], max_page_size: int | None, page_token: str | None, scope: str) -> tuple[list[Any], str | None]:
    """Offset pagination with an opaque token bound to the listing's filter."""
    size = DEFAULT_PAGE_SIZE if not max_page_size else max_page_size
    if size < 0:
        raise InvalidArgument("maxPageSize must not be negative")
    size = min(size, MAX_PAGE_SIZE)
    offset = 0
    if page_token:
        try:
            doc = json.loads(base64.urlsafe_b64decode(page_token.encode() + b"=="))
            offset, token_scope = int(doc["o"]), doc["s"]
        except Exception:
            raise InvalidArgument("pageToken is not a token this listing returned") from None
        if token_scope != scope or offset < 0:
            raise InvalidArgument("pageToken belongs to a different listing (keep the same filter)")
    chunk = items[offset : offset + size]
    nxt = offset + size
    token = None
    if nxt < len(items):
        token = base64.urlsafe_b64encode(json.dumps({"o": nxt, "s": scope}).encode()).decode().rstrip("=")
    return chunk, token
