"""Hot-loads, below `/v1alpha1/inference`: create, list (newest first, paged, optionally by
`parentDeploymentId`), get, the operation's replica entries (paged, by zone then name) and cancel.

Create checks the deployment's `hotLoad` against the organization's grants again (api/auth.py:
`require_granted`; a revoked grant stops further loads) and carries the request's trace context
into the operation. A hot-load's JSON is encoded once (api/listing.py) and answered as is.

Cancel: `POST /hotLoads/{id}:cancel` asks the operation to stop before its next replica step and
waits (up to `ApiContext.cancel_wait_s`) for it to end, answering the operation as it then stands;
an operation already ended is failed_precondition.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response
from opentelemetry import propagate as otel_propagate

from api import metrics as api_metrics
from api.auth import PrincipalDep, require_granted
from api.clock import now
from api.context import ContextDep, ResourcesDep
from api.listing import Record, dumps, page
from api.models import CreateHotLoadRequest
from contracts.errors import FailedPrecondition
from contracts.records import TERMINAL_HOT_LOAD_STATES, CreateHotLoadCommand, PromptCachePolicy

router = APIRouter()


def hot_load_response(rec: Record) -> Response:
    # The record's JSON is encoded once (api/listing.py); a closed one is answered from memory.
    return Response(b'{"hotLoad":' + rec.json + b"}", media_type="application/json")


@router.post("/hotLoads")
async def create_hot_load(body: CreateHotLoadRequest, p: PrincipalDep, r: ResourcesDep):
    p.require_admin("creating a hot-load")
    dep = await r.get_deployment(p.organization_id, body.deployment_id)  # not_found across orgs
    require_granted(p, None, dep.spec.hot_load)  # a grant revoked since the create stops reads
    meta = body.incremental_snapshot_metadata
    cmd = CreateHotLoadCommand(
        hot_load_id=body.hot_load_id or str(uuid.uuid4()),
        identity=body.identity,
        type=body.type,
        incremental_snapshot_metadata=meta.model_dump() if meta else None,  # type: ignore[arg-type]  # pydantic validates it
        prompt_cache_policy=body.prompt_cache_policy or PromptCachePolicy.PRESERVE,
        organization_hot_load_enabled=p.hot_load_enabled,
        created_at=now(),
    )
    otel_propagate.inject(cmd.trace_context)  # the request's span, for the operation's trace
    created = await r.create_hot_load(p.organization_id, body.deployment_id, cmd)
    api_metrics.HOT_LOADS_CREATED.inc()
    return hot_load_response(created)


@router.get("/hotLoads")
async def list_hot_loads(
    p: PrincipalDep,
    r: ResourcesDep,
    parentDeploymentId: str | None = None,  # noqa: N803 - wire names
    maxPageSize: int | None = None,  # noqa: N803
    pageToken: str | None = None,  # noqa: N803
):
    items, token = await r.list_hot_loads(p.organization_id, parentDeploymentId, maxPageSize, pageToken)
    # Each item is JSON already (encoded once per record): join, do not re-encode.
    tail = b',"nextPageToken":' + dumps(token) if token else b""
    return Response(b'{"hotLoads":[' + b",".join(items) + b"]" + tail + b"}", media_type="application/json")


@router.get("/hotLoads/{hot_load_id}")
async def get_hot_load(hot_load_id: str, p: PrincipalDep, r: ResourcesDep):
    return hot_load_response(await r.hot_load(p.organization_id, hot_load_id))


@router.get("/hotLoads/{hot_load_id}/replicas")
async def list_hot_load_replicas(
    hot_load_id: str,
    p: PrincipalDep,
    r: ResourcesDep,
    maxPageSize: int | None = None,  # noqa: N803
    pageToken: str | None = None,  # noqa: N803
):
    rec = await r.hot_load(p.organization_id, hot_load_id, replicas=True)  # ordered by (zone, name)
    chunk, token = page(rec.replicas, maxPageSize, pageToken, f"replicas:{hot_load_id}")
    out: dict[str, Any] = {"replicas": chunk}
    if token:
        out["nextPageToken"] = token
    return out


@router.post("/hotLoads/{hot_load_id}:cancel")
async def cancel_hot_load(hot_load_id: str, p: PrincipalDep, r: ResourcesDep, ctx: ContextDep):
    p.require_admin("canceling a hot-load")
    state = (await r.hot_load(p.organization_id, hot_load_id, fresh=True)).hot_load["status"]["state"]
    if state in TERMINAL_HOT_LOAD_STATES:
        raise FailedPrecondition(f"hot-load {hot_load_id} already ended ({state})")
    rec = await r.cancel_hot_load(p.organization_id, hot_load_id)
    # The operation stops at its next replica step boundary; answer with the end state when it
    # comes soon, else with the state now (the client polls GET as for any operation).
    deadline = asyncio.get_running_loop().time() + ctx.cancel_wait_s
    while rec.hot_load["status"]["state"] not in TERMINAL_HOT_LOAD_STATES:
        if asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(0.1)
        rec = await r.hot_load(p.organization_id, hot_load_id, fresh=True)
    return hot_load_response(rec)
