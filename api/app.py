"""The REST API, `/v1alpha1/inference`: gateways, deployments and hot-loads, as the guide states.

Every request is authenticated (Bearer token → organization and role) before anything else is
looked at: a missing or unknown token answers unauthenticated and a viewer's write answers
permission_denied even when its body is invalid or oversized. Another organization's resource
answers not_found. Every error is `{"code", "message", "details"}` with the HTTP status of its
code, never a traceback. Bodies are validated strictly and an invalid field is named.

Ids are per organization (contracts/names.py): two organizations may each create `foo`, and
creating, reading or deleting an id another organization uses behaves as if it did not exist.

Where deployments read (common/buckets.py): a malformed `model.bucket`/`model.path` or
`hotLoad.bucket`/`hotLoad.pathPrefix` is invalid_argument (400); a bucket or path not granted to
the caller's organization in the tokens file is permission_denied (403), naming the field, at
create; a hot-load checks its deployment's `hotLoad` against the grants again (a revoked grant
stops further loads).

Deployment update (not called by cwtrain; the guide: "include the same hotLoad section"):
`PATCH /deployments/{id}` with any of the create body's fields (no `id`). Each field given replaces
the current one. `hotLoad` must be present and equal to the deployment's (it is immutable; an
update that omits or changes it is invalid_argument), and may not be added to a deployment
created without it. `runtime.version`, `runtime.engineConfig` and `traffic` may change (a new runtime rolls
the replicas onto it one at a time: control/deployment.py); `name`, `gatewayIds`, `resources`, `model`,
`autoscaling` and `runtime.engine` must be unchanged if given. While a hot-load runs or the
deployment is not READY the update answers failed_precondition. Answers `{"deployment": Deployment}`.

Outside `/v1alpha1/inference`, without a token: `GET /healthz`, and `GET /metrics`, the API's
Prometheus metrics (api/metrics.py).

Cancel: `POST /hotLoads/{id}:cancel` asks the operation to stop before its next replica step and
waits (up to `cancel_wait_s`) for it to end, answering the operation as it then stands.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from opentelemetry import propagate as otel_propagate
from opentelemetry.trace import SpanKind
from starlette.exceptions import HTTPException as StarletteHTTPException
from temporalio.service import RPCError

from api import metrics as api_metrics
from api.listing import Record, dumps, page
from api.models import (
    ENGINE_CONFIG_KEYS,
    CreateDeploymentRequest,
    CreateGatewayRequest,
    CreateHotLoadRequest,
    UpdateDeploymentRequest,
)
from api.resources import Resources
from common.buckets import grant_problem
from common.errors import (
    AlreadyExists,
    ApiError,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    Unavailable,
)
from common.settings import Settings
from common.settings import temporal_client as connect_temporal
from common.telemetry import setup_tracing, temporal_interceptors
from common.telemetry import tracer as telemetry_tracer
from common.tokens import Principal, TokenStore
from contracts import names
from contracts.records import (
    Condition,
    ConditionStatus,
    CreateHotLoadCommand,
    Deployment,
    DeploymentInput,
    DeploymentSpec,
    DeploymentStatus,
    Gateway,
    GatewaySpec,
    GatewayStatus,
    HotLoadConfig,
    ModelSource,
    PromptCachePolicy,
    ResourceStatus,
    UpdateDeploymentCommand,
    rfc3339,
)

log = logging.getLogger("rollouts.api")
PREFIX = "/v1alpha1/inference"
MAX_BODY_BYTES = 1 << 20


def _now() -> str:
    return rfc3339(datetime.now(UTC))


# What each write is called in a permission_denied message; any other write is "this request".
WRITE_ACTIONS: list[tuple[str, re.Pattern[str], str]] = [
    ("POST", re.compile(r"^/gateways/?$"), "creating a gateway"),
    ("DELETE", re.compile(r"^/gateways/[^/]+$"), "deleting a gateway"),
    ("POST", re.compile(r"^/deployments/?$"), "creating a deployment"),
    ("PATCH", re.compile(r"^/deployments/[^/]+$"), "updating a deployment"),
    ("DELETE", re.compile(r"^/deployments/[^/]+$"), "deleting a deployment"),
    ("POST", re.compile(r"^/hotLoads/?$"), "creating a hot-load"),
    ("POST", re.compile(r"^/hotLoads/[^/]+:cancel$"), "canceling a hot-load"),
]
READ_METHODS = ("GET", "HEAD", "OPTIONS")
TERMINAL_STATES = ("HOT_LOAD_STATE_COMPLETED", "HOT_LOAD_STATE_FAILED", "HOT_LOAD_STATE_CANCELED")


def write_action(method: str, path: str) -> str:
    for m, pattern, action in WRITE_ACTIONS:
        if m == method and pattern.match(path):
            return action
    return "this request"


def _field_path(loc: tuple[Any, ...]) -> str:
    # The first element says where (body, query, path parameter); a field may itself be "path".
    parts = [str(p) for p in (loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)]
    return ".".join(parts) or "body"


def require_granted(p: Principal, model: ModelSource | None, hot_load: HotLoadConfig | None) -> None:
    """permission_denied naming the field when the organization may not read there (common/buckets.py)."""
    checks = []
    if model is not None:
        checks.append(("model.bucket", model.bucket, "model.path", model.path))
    if hot_load is not None:
        checks.append(("hotLoad.bucket", hot_load.bucket, "hotLoad.pathPrefix", hot_load.path_prefix))
    for bucket_field, bucket, path_field, path in checks:
        if problem := grant_problem(p.buckets, p.organization_id, bucket_field, bucket, path_field, path):
            raise PermissionDenied(problem)


# Engines whose deployments may hot-load, comma-separated: the guide's rule (dynamo-vllm alone) by
# default; an operator comparing engines (bench/dynamo_vs_vllm.py) may add vllm.
HOT_LOAD_ENGINES_ENV = "ROLLOUTS_HOT_LOAD_ENGINES"


def allowed_hot_load_engines() -> tuple[str, ...]:
    value = os.environ.get(HOT_LOAD_ENGINES_ENV, "").strip()
    engines = tuple(e.strip() for e in value.split(",") if e.strip()) if value else (names.HOT_LOAD_ENGINE,)
    unknown = [e for e in engines if e not in names.ENGINES]
    if unknown:
        raise SystemExit(f"{HOT_LOAD_ENGINES_ENV}: {', '.join(unknown)} is not an engine ({', '.join(names.ENGINES)})")
    return engines


def create_app(
    settings: Settings,
    *,
    temporal_client: Any = None,
    task_queue: str = names.CONTROL_TASK_QUEUE,
    cancel_wait_s: float = 10.0,
    tracer: Any = None,
) -> FastAPI:
    tokens = TokenStore(settings.tokens_file)
    hot_load_engines = allowed_hot_load_engines()
    state: dict[str, Any] = {}
    request_tracer = tracer or telemetry_tracer("rollouts.api")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client = temporal_client
        if client is None:
            setup_tracing("rollouts-api")
            client = await connect_temporal(settings, interceptors=temporal_interceptors(request_tracer))
        resources = Resources(client, task_queue=task_queue, hot_load_view=hot_load_view)
        state["resources"] = app.state.resources = resources
        try:
            yield
        finally:
            await resources.open_reads.close()
            await resources.hot_loads.close()

    app = FastAPI(title="rollouts", version="v1alpha1", lifespan=lifespan)
    app.state.cancel_wait_s = cancel_wait_s

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        api_metrics.ERRORS.labels(code=exc.code).inc()
        return JSONResponse(exc.body(), status_code=exc.http_status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
            if err.get("type") == "extra_forbidden":
                msg = "unknown field"
            elif err.get("type") == "missing":
                msg = "required field is missing"
            problems.append(f"{_field_path(tuple(err.get('loc', ())))}: {msg}")
        err = InvalidArgument("; ".join(problems[:10]) or "invalid request")
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(exc.status_code, "invalid_argument")
        return JSONResponse({"code": code, "message": str(exc.detail), "details": []}, status_code=exc.status_code)

    @app.exception_handler(RPCError)
    async def _temporal_down(_: Request, exc: RPCError) -> JSONResponse:
        # Temporal unreachable or overloaded: retryable for the client (cwtrain retries 503).
        log.warning("Temporal call failed: %s", exc)
        err = Unavailable(f"Temporal is unavailable: {exc.message}")
        return JSONResponse(err.body(), status_code=err.http_status)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse({"code": "internal", "message": "internal error; see the API log", "details": []}, status_code=500)

    @app.middleware("http")
    async def _limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > MAX_BODY_BYTES:
            err = PayloadTooLarge(f"request body larger than {MAX_BODY_BYTES} bytes")
            return JSONResponse(err.body(), status_code=err.http_status)
        return await call_next(request)

    # The outermost span of a trace: Temporal calls made while serving carry it on (the client's
    # TracingInterceptor), so a hot-load's workflow and activity spans join the request's trace.
    # It also counts and times the request (api/metrics.py), by the same route template.
    async def _span(request: Request, call_next):
        route = "unmatched"
        for r in app.router.routes:
            if getattr(r, "path_regex", None) is not None and r.path_regex.match(request.url.path):
                route = r.path  # the template: one span name per endpoint, not per id
                break
        start = time.perf_counter()
        with request_tracer.start_as_current_span(
            f"{request.method} {route}", kind=SpanKind.SERVER,
            attributes={"http.request.method": request.method, "url.path": request.url.path},
        ) as span:
            response = await call_next(request)
            span.set_attribute("http.response.status_code", response.status_code)
        api_metrics.observe(request.method, route, response.status_code, time.perf_counter() - start)
        return response

    # Added last, so it runs first: who asks, and may they write, before the body is looked at.
    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        path = request.url.path
        if path.startswith(PREFIX + "/"):
            try:
                who = tokens.authenticate(request.headers.get("authorization"))
                if request.method not in READ_METHODS:
                    who.require_admin(write_action(request.method, path[len(PREFIX):]))
            except ApiError as exc:
                return JSONResponse(exc.body(), status_code=exc.http_status)
            request.state.principal = who
        return await call_next(request)

    app.middleware("http")(_span)

    # ------------------------------------------------------------------ deps
    def principal(request: Request, authorization: str | None = Header(default=None)) -> Principal:
        who = getattr(request.state, "principal", None)
        return who if who is not None else tokens.authenticate(authorization)

    def res() -> Resources:
        if "resources" not in state:
            raise Unavailable("the API is starting")
        return state["resources"]

    def ui_link(workflow_id: str) -> str:
        return f"{settings.temporal_ui_url}/namespaces/{settings.temporal_namespace}/workflows/{quote(workflow_id, safe='')}"

    def hot_load_view(hot_load: dict[str, Any]) -> dict[str, Any]:
        spec = hot_load["spec"]
        hot_load["status"]["workflowUrl"] = ui_link(names.hot_load_workflow_id(spec["organizationId"], spec["id"]))
        return hot_load

    def hot_load_response(rec: Record) -> Response:
        # The record's JSON is encoded once (api/listing.py); a closed one is answered from memory.
        return Response(b'{"hotLoad":' + rec.json + b"}", media_type="application/json")

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        body, content_type = api_metrics.exposition()
        return Response(body, media_type=content_type)

    # ------------------------------------------------------------------ gateways
    @app.get(f"{PREFIX}/gateways/parameters")
    async def gateway_parameters(p: Principal = Depends(principal)) -> dict[str, Any]:
        return {"zones": [settings.zone]}

    @app.post(f"{PREFIX}/gateways")
    async def create_gateway(body: CreateGatewayRequest, p: Principal = Depends(principal), r: Resources = Depends(res)):
        p.require_admin("creating a gateway")
        zones = body.zones or [settings.zone]
        bad = [z for z in zones if z != settings.zone]
        if bad:
            raise InvalidArgument(f"zones: {', '.join(bad)} not offered here; GET /gateways/parameters lists {settings.zone}")
        gw = Gateway(
            spec=GatewaySpec(id=body.id or str(uuid.uuid4()), name=body.name, organization_id=p.organization_id, zones=zones),
            status=GatewayStatus(status=ResourceStatus.CREATING, endpoints=[settings.gateway_url], created_at=_now(), updated_at=_now()),
        )
        if any(g.spec.name == body.name for g in await r.list_gateways(p.organization_id)):
            raise AlreadyExists(f"a gateway named {body.name!r} already exists in this organization")
        await r.create_gateway(gw)
        gw.status.status = ResourceStatus.READY
        return {"gateway": gw.wire()}

    @app.get(f"{PREFIX}/gateways/{{gateway_id}}")
    async def get_gateway(gateway_id: str, p: Principal = Depends(principal), r: Resources = Depends(res)):
        return {"gateway": (await r.get_gateway(p.organization_id, gateway_id)).wire()}

    @app.get(f"{PREFIX}/gateways")
    async def list_gateways(p: Principal = Depends(principal), r: Resources = Depends(res)):
        return {"items": [g.wire() for g in await r.list_gateways(p.organization_id)]}

    @app.delete(f"{PREFIX}/gateways/{{gateway_id}}")
    async def delete_gateway(gateway_id: str, p: Principal = Depends(principal), r: Resources = Depends(res)):
        p.require_admin("deleting a gateway")
        await r.delete_gateway(p.organization_id, gateway_id)
        return {}

    # ------------------------------------------------------------------ deployments
    @app.get(f"{PREFIX}/deployments/parameters")
    async def deployment_parameters(
        gatewayIds: list[str] = Query(default=[]), p: Principal = Depends(principal)  # noqa: N803 - wire name
    ) -> dict[str, Any]:
        return {
            "runtimes": [{"engine": engine, "versions": ["0.32.0"], "hotLoadSupported": engine in hot_load_engines}
                         for engine in names.ENGINES],
            "engineConfigKeys": list(ENGINE_CONFIG_KEYS),
            "instanceTypes": [{"name": "cpu-local", "gpuCount": 0, "zones": [settings.zone]}],
            "zones": [settings.zone],
        }

    @app.post(f"{PREFIX}/deployments")
    async def create_deployment(body: CreateDeploymentRequest, p: Principal = Depends(principal), r: Resources = Depends(res)):
        p.require_admin("creating a deployment")
        if body.hot_load is not None:
            if not p.hot_load_enabled:
                raise FailedPrecondition("hot-load is not enabled for this organization")
            if body.runtime.engine not in hot_load_engines:
                raise InvalidArgument(
                    f"runtime.engine: hot-loading needs {' or '.join(map(repr, hot_load_engines))}, "
                    f"got {body.runtime.engine!r}"
                )
        if body.autoscaling.max < body.autoscaling.min:
            raise InvalidArgument("autoscaling.max must be at least autoscaling.min")
        require_granted(p, body.model, body.hot_load)
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
        now = _now()
        dep = Deployment(
            spec=DeploymentSpec(
                id=dep_id,
                name=body.name,
                organization_id=p.organization_id,
                gateway_ids=body.gateway_ids,
                runtime=body.runtime,
                resources=body.resources,
                model=body.model,
                autoscaling=body.autoscaling,
                traffic=body.traffic,
                hot_load=body.hot_load.to_record() if body.hot_load else None,
            ),
            status=DeploymentStatus(
                status=ResourceStatus.CREATING,
                created_at=now,
                updated_at=now,
                conditions=[
                    Condition(
                        type="ReplicasReady", status=ConditionStatus.UNKNOWN, reason="Creating",
                        message=f"starting {body.autoscaling.min} replica(s)", last_update_time=now,
                    )
                ],
            ),
        )
        await r.create_deployment(DeploymentInput(deployment=dep, gateway_zones=zones))
        return {"deployment": dep.wire()}

    @app.get(f"{PREFIX}/deployments/{{deployment_id}}")
    async def get_deployment(deployment_id: str, p: Principal = Depends(principal), r: Resources = Depends(res)):
        return {"deployment": (await r.get_deployment(p.organization_id, deployment_id)).wire()}

    @app.patch(f"{PREFIX}/deployments/{{deployment_id}}")
    async def update_deployment(
        deployment_id: str, body: UpdateDeploymentRequest, p: Principal = Depends(principal), r: Resources = Depends(res)
    ):
        p.require_admin("updating a deployment")
        cmd = UpdateDeploymentCommand(
            name=body.name,
            gateway_ids=body.gateway_ids,
            runtime=body.runtime,
            resources=body.resources,
            model=body.model,
            autoscaling=body.autoscaling,
            traffic=body.traffic,
            hot_load=body.hot_load.to_record() if body.hot_load else None,
            updated_at=_now(),
        )
        return {"deployment": (await r.update_deployment(p.organization_id, deployment_id, cmd)).wire()}

    @app.get(f"{PREFIX}/deployments")
    async def list_deployments(
        parentGatewayId: str | None = None, p: Principal = Depends(principal), r: Resources = Depends(res)  # noqa: N803
    ):
        return {"items": [d.wire() for d in await r.list_deployments(p.organization_id, parentGatewayId)]}

    @app.delete(f"{PREFIX}/deployments/{{deployment_id}}")
    async def delete_deployment(deployment_id: str, p: Principal = Depends(principal), r: Resources = Depends(res)):
        p.require_admin("deleting a deployment")
        await r.delete_deployment(p.organization_id, deployment_id)
        return {}

    # ------------------------------------------------------------------ hot-loads
    @app.post(f"{PREFIX}/hotLoads")
    async def create_hot_load(body: CreateHotLoadRequest, p: Principal = Depends(principal), r: Resources = Depends(res)):
        p.require_admin("creating a hot-load")
        dep = await r.get_deployment(p.organization_id, body.deployment_id)  # not_found across orgs
        require_granted(p, None, dep.spec.hot_load)  # a grant revoked since the create stops reads
        meta = body.incremental_snapshot_metadata
        cmd = CreateHotLoadCommand(
            hot_load_id=body.hot_load_id or str(uuid.uuid4()),
            identity=body.identity,
            type=body.type,
            incremental_snapshot_metadata=meta.model_dump() if meta else None,
            prompt_cache_policy=body.prompt_cache_policy or PromptCachePolicy.PRESERVE,
            organization_hot_load_enabled=p.hot_load_enabled,
            created_at=_now(),
        )
        otel_propagate.inject(cmd.trace_context)  # the request's span, for the operation's trace
        created = await r.create_hot_load(p.organization_id, body.deployment_id, cmd)
        api_metrics.HOT_LOADS_CREATED.inc()
        return hot_load_response(created)

    @app.get(f"{PREFIX}/hotLoads")
    async def list_hot_loads(
        parentDeploymentId: str | None = None,  # noqa: N803 - wire names
        maxPageSize: int | None = None,  # noqa: N803
        pageToken: str | None = None,  # noqa: N803
        p: Principal = Depends(principal),
        r: Resources = Depends(res),
    ):
        items, token = await r.list_hot_loads(p.organization_id, parentDeploymentId, maxPageSize, pageToken)
        # Each item is JSON already (encoded once per record): join, do not re-encode.
        tail = b',"nextPageToken":' + dumps(token) if token else b""
        return Response(b'{"hotLoads":[' + b",".join(items) + b"]" + tail + b"}", media_type="application/json")

    @app.get(f"{PREFIX}/hotLoads/{{hot_load_id}}")
    async def get_hot_load(hot_load_id: str, p: Principal = Depends(principal), r: Resources = Depends(res)):
        return hot_load_response(await r.hot_load(p.organization_id, hot_load_id))

    @app.get(f"{PREFIX}/hotLoads/{{hot_load_id}}/replicas")
    async def list_hot_load_replicas(
        hot_load_id: str,
        maxPageSize: int | None = None,  # noqa: N803
        pageToken: str | None = None,  # noqa: N803
        p: Principal = Depends(principal),
        r: Resources = Depends(res),
    ):
        rec = await r.hot_load(p.organization_id, hot_load_id, replicas=True)  # ordered by (zone, name)
        chunk, token = page(rec.replicas, maxPageSize, pageToken, f"replicas:{hot_load_id}")
        out: dict[str, Any] = {"replicas": chunk}
        if token:
            out["nextPageToken"] = token
        return out

    @app.post(f"{PREFIX}/hotLoads/{{hot_load_id}}:cancel")
    async def cancel_hot_load(hot_load_id: str, p: Principal = Depends(principal), r: Resources = Depends(res)):
        p.require_admin("canceling a hot-load")
        state = (await r.hot_load(p.organization_id, hot_load_id, fresh=True)).hot_load["status"]["state"]
        if state in TERMINAL_STATES:
            raise FailedPrecondition(f"hot-load {hot_load_id} already ended ({state})")
        rec = await r.cancel_hot_load(p.organization_id, hot_load_id)
        # The operation stops at its next replica step boundary; answer with the end state when it
        # comes soon, else with the state now (the client polls GET as for any operation).
        deadline = asyncio.get_running_loop().time() + app.state.cancel_wait_s
        while rec.hot_load["status"]["state"] not in TERMINAL_STATES:
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.1)
            rec = await r.hot_load(p.organization_id, hot_load_id, fresh=True)
        return hot_load_response(rec)

    return app

