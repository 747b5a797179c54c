"""Deployments, below `/v1alpha1/inference`: `GET /deployments/parameters`, create, get, update,
list (optionally by `parentGatewayId`) and delete.

Create: a `hotLoad` section needs hot-load enabled for the organization (else
failed_precondition) and an engine that hot-loads (`ApiContext.hot_load_engines`; else
invalid_argument); a bucket or path outside the organization's grants is permission_denied,
naming the field. Update (`PATCH`): each field given replaces the current one; `hotLoad` is
immutable and must be given equal; only `runtime.version`, `runtime.engineConfig` and `traffic`
may change (a new runtime rolls the replicas one at a time); refused with failed_precondition
while a hot-load runs or the deployment is not READY. Answers `{"deployment": Deployment}`.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Query

from api.auth import PrincipalDep, require_granted
from api.clock import now
from api.context import ContextDep, ResourcesDep
from api.models import ENGINE_CONFIG_KEYS, CreateDeploymentRequest, UpdateDeploymentRequest
from contracts import names
from contracts.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from contracts.records import (
    Condition,
    ConditionStatus,
    Deployment,
    DeploymentInput,
    DeploymentSpec,
    DeploymentStatus,
    ResourceStatus,
    UpdateDeploymentCommand,
)

router = APIRouter()


def _fields(body: CreateDeploymentRequest | UpdateDeploymentRequest) -> dict[str, Any]:
    """What a create and an update both carry, as the records take it (an update's absent field: None)."""
    return {
        "name": body.name,
        "gateway_ids": body.gateway_ids,
        "runtime": body.runtime,
        "resources": body.resources,
        "model": body.model,
        "autoscaling": body.autoscaling,
        "traffic": body.traffic,
        "hot_load": body.hot_load.to_record() if body.hot_load else None,
    }


@router.get("/deployments/parameters")
async def deployment_parameters(
    p: PrincipalDep,
    ctx: ContextDep,
    gatewayIds: list[str] = Query(default=[]),  # noqa: N803 - wire name
) -> dict[str, Any]:
    settings = ctx.settings
    return {
        "runtimes": [
            {"engine": engine, "versions": ["0.32.0"], "hotLoadSupported": engine in ctx.hot_load_engines}
            for engine in names.ENGINES
        ],
        "engineConfigKeys": list(ENGINE_CONFIG_KEYS),
        "instanceTypes": [{"name": "cpu-local", "gpuCount": 0, "zones": [settings.zone]}],
        "zones": [settings.zone],
    }


@router.post("/deployments")
async def create_deployment(body: CreateDeploymentRequest, p: PrincipalDep, r: ResourcesDep, ctx: ContextDep):
    p.require_admin("creating a deployment")
    if body.hot_load is not None:
        if not p.hot_load_enabled:
            raise FailedPrecondition("hot-load is not enabled for this organization")
        if body.runtime.engine not in ctx.hot_load_engines:
            raise InvalidArgument(
                f"runtime.engine: hot-loading needs {' or '.join(map(repr, ctx.hot_load_engines))}, "
                f"got {body.runtime.engine!r}"
            )
    if body.autoscaling.max < body.autoscaling.min:
        raise InvalidArgument("autoscaling.max must be at least autoscaling.min")
    require_granted(p, body.model, body.hot_load)  # type: ignore[arg-type]  # the same fields
    zones = []
    for gid in body.gateway_ids:
        try:
            zones.extend((await r.get_gateway(p.organization_id, gid)).spec.zones)
        except NotFound:
            raise InvalidArgument(f"gatewayIds: gateway {gid} not found") from None
    dep_id = body.id or str(uuid.uuid4())
    if await r.memo(names.deployment_workflow_id(p.organization_id, dep_id)) is not None:
        raise AlreadyExists(f"deployment {dep_id} already exists")
    if any(d.spec.name == body.name for d in await r.list_deployments(p.organization_id)):
        raise AlreadyExists(f"a deployment named {body.name!r} already exists in this organization")
    created = now()
    dep = Deployment(
        spec=DeploymentSpec(id=dep_id, organization_id=p.organization_id, **_fields(body)),
        status=DeploymentStatus(
            status=ResourceStatus.CREATING,
            created_at=created,
            updated_at=created,
            conditions=[
                Condition(
                    type="ReplicasReady",
                    status=ConditionStatus.UNKNOWN,
                    reason="Creating",
                    message=f"starting {body.autoscaling.min} replica(s)",
                    last_update_time=created,
                )
            ],
        ),
    )
    await r.create_deployment(DeploymentInput(deployment=dep, gateway_zones=zones))
    return {"deployment": dep.wire()}


@router.get("/deployments/{deployment_id}")
async def get_deployment(deployment_id: str, p: PrincipalDep, r: ResourcesDep):
    return {"deployment": (await r.get_deployment(p.organization_id, deployment_id)).wire()}


@router.patch("/deployments/{deployment_id}")
async def update_deployment(deployment_id: str, body: UpdateDeploymentRequest, p: PrincipalDep, r: ResourcesDep):
    p.require_admin("updating a deployment")
    cmd = UpdateDeploymentCommand(**_fields(body), updated_at=now())
    return {"deployment": (await r.update_deployment(p.organization_id, deployment_id, cmd)).wire()}


@router.get("/deployments")
async def list_deployments(
    p: PrincipalDep,
    r: ResourcesDep,
    parentGatewayId: str | None = None,  # noqa: N803 - wire name
):
    return {"items": [d.wire() for d in await r.list_deployments(p.organization_id, parentGatewayId)]}


@router.delete("/deployments/{deployment_id}")
async def delete_deployment(deployment_id: str, p: PrincipalDep, r: ResourcesDep):
    p.require_admin("deleting a deployment")
    await r.delete_deployment(p.organization_id, deployment_id)
    return {}
