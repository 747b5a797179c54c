"""Gateways, below `/v1alpha1/inference`: `GET /gateways/parameters` (the zones offered: the
stack's one), create, get, list and delete. A gateway's name is unique in its organization; its
zones must be offered here, and its endpoint is the stack's gateway URL."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter

from api.auth import PrincipalDep
from api.clock import now
from api.context import ContextDep, ResourcesDep
from api.models import CreateGatewayRequest
from contracts.errors import AlreadyExists, InvalidArgument
from contracts.records import Gateway, GatewaySpec, GatewayStatus, ResourceStatus

router = APIRouter()


@router.get("/gateways/parameters")
async def gateway_parameters(p: PrincipalDep, ctx: ContextDep) -> dict[str, Any]:
    return {"zones": [ctx.settings.zone]}


@router.post("/gateways")
async def create_gateway(body: CreateGatewayRequest, p: PrincipalDep, r: ResourcesDep, ctx: ContextDep):
    p.require_admin("creating a gateway")
    settings = ctx.settings
    zones = body.zones or [settings.zone]
    bad = [z for z in zones if z != settings.zone]
    if bad:
        raise InvalidArgument(
            f"zones: {', '.join(bad)} not offered here; GET /gateways/parameters lists {settings.zone}"
        )
    gw = Gateway(
        spec=GatewaySpec(
            id=body.id or str(uuid.uuid4()), name=body.name, organization_id=p.organization_id, zones=zones
        ),
        status=GatewayStatus(
            status=ResourceStatus.CREATING, endpoints=[settings.gateway_url], created_at=now(), updated_at=now()
        ),
    )
    if any(g.spec.name == body.name for g in await r.list_gateways(p.organization_id)):
        raise AlreadyExists(f"a gateway named {body.name!r} already exists in this organization")
    await r.create_gateway(gw)
    gw.status.status = ResourceStatus.READY
    return {"gateway": gw.wire()}


@router.get("/gateways/{gateway_id}")
async def get_gateway(gateway_id: str, p: PrincipalDep, r: ResourcesDep):
    return {"gateway": (await r.get_gateway(p.organization_id, gateway_id)).wire()}


@router.get("/gateways")
async def list_gateways(p: PrincipalDep, r: ResourcesDep):
    return {"items": [g.wire() for g in await r.list_gateways(p.organization_id)]}


@router.delete("/gateways/{gateway_id}")
async def delete_gateway(gateway_id: str, p: PrincipalDep, r: ResourcesDep):
    p.require_admin("deleting a gateway")
    await r.delete_gateway(p.organization_id, gateway_id)
    return {}
