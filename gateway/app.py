"""The OpenAI-compatible gateway in front of the deployments' replicas.

`/v1/chat/completions` and `/v1/completions` are routed by the request's `model` (a deployment's
`model.name`, or its id) to one of that deployment's replicas: the replica pinned to the request's
`X-Dynamo-Session-ID` while it is healthy (affinity with a TTL), else the least-loaded one.
Bodies and responses pass through unchanged (logprobs, token ids, SSE streams), except `nvext`,
which is translated for vLLM (`cache_salt`). A request that fails before any byte was sent is
retried on another replica; a stream that breaks midway ends with an error event, never silently.
During a replica's pause, vLLM queues new requests itself (`mode=keep`), so they wait, not fail.

The routing table comes from Temporal (the deployment workflows' memos), refreshed every second.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.auth import TokenStore
from api.errors import ApiError
from workers.settings import Settings

log = logging.getLogger("rollouts.gateway")
SESSION_HEADER = "x-dynamo-session-id"
SESSION_TTL_S = 600.0
REFRESH_S = 1.0
SUPPORTED_NVEXT = {"cache_salt"}


@dataclass
class Route:
    deployment_id: str
    model_name: str
    replicas: list[dict[str, Any]]


@dataclass
class Router:
    routes: dict[str, Route] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    sessions: dict[str, tuple[str, float]] = field(default_factory=dict)

    def resolve(self, model: str | None) -> Route | None:
        if model and model in self.routes:
            return self.routes[model]
        if not model and len(self.routes) == 1:
            return next(iter(self.routes.values()))
        return None

    def candidates(self, route: Route, session: str | None) -> list[str]:
        urls = [r["engineUrl"] for r in route.replicas]
        if not urls:
            return []
        by_load = sorted(urls, key=lambda u: (self.in_flight.get(u, 0), u))
        if session:
            pinned = self.sessions.get(session)
            if pinned and pinned[0] in urls and time.monotonic() - pinned[1] < SESSION_TTL_S:
                return [pinned[0]] + [u for u in by_load if u != pinned[0]]
        return by_load

    def pin(self, session: str | None, url: str) -> None:
        if session:
            self.sessions[session] = (url, time.monotonic())
            if len(self.sessions) > 100_000:  # bound memory: drop the oldest half
                for key, _ in sorted(self.sessions.items(), key=lambda kv: kv[1][1])[:50_000]:
                    self.sessions.pop(key, None)


def translate_nvext(body: dict[str, Any]) -> dict[str, Any]:
    nvext = body.pop("nvext", None)
    if nvext is None:
        return body
    if not isinstance(nvext, dict):
        raise ValueError("nvext must be a JSON object")
    unknown = sorted(set(nvext) - SUPPORTED_NVEXT)
    if unknown:
        raise ValueError(f"nvext: unsupported field(s) {', '.join(unknown)}; supported: {', '.join(sorted(SUPPORTED_NVEXT))}")
    if "cache_salt" in nvext:
        body["cache_salt"] = str(nvext["cache_salt"])
    return body


def create_gateway_app(settings: Settings, *, refresh: bool = True) -> FastAPI:
    tokens = TokenStore(settings.tokens_file)
    router = Router()
    state: dict[str, Any] = {}

    async def refresh_routes() -> None:
        from workers.settings import temporal_client

        client = await temporal_client(settings)
        while True:
            try:
                routes: dict[str, Route] = {}
                async for wf in client.list_workflows(
                    "ResourceKind='deployment' AND ExecutionStatus='Running'", page_size=1000
                ):
                    memo = await wf.memo()
                    dep = memo.get("deployment") or {}
                    spec = dep.get("spec") or {}
                    if not spec:
                        continue
                    route = Route(spec["id"], spec["model"]["name"], list(memo.get("replicas") or []))
                    routes[spec["id"]] = route
                    routes.setdefault(route.model_name, route)
                router.routes = routes
            except Exception as exc:  # noqa: BLE001 - keep the last table; Temporal may restart
                log.warning("routing refresh failed: %s", exc)
            await asyncio.sleep(REFRESH_S)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["http"] = httpx.AsyncClient(timeout=httpx.Timeout(connect=5, read=600, write=60, pool=60))
        task = asyncio.create_task(refresh_routes()) if refresh else None
        yield
        if task:
            task.cancel()
        await state["http"].aclose()

    app = FastAPI(title="rollouts gateway", lifespan=lifespan)
    app.state.router = router

    def error(status: int, code: str, message: str) -> JSONResponse:
        # OpenAI-style error envelope (what OpenAI SDKs parse), with our code.
        return JSONResponse({"error": {"message": message, "type": code, "code": code}}, status_code=status)

    def authorized(request: Request) -> JSONResponse | None:
        try:
            tokens.authenticate(request.headers.get("authorization"))
        except ApiError as exc:
            return error(exc.http_status, exc.code, exc.message)
        return None

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "models": sorted(k for k, r in router.routes.items() if k == r.model_name)}

    @app.get("/v1/models")
    async def models(request: Request):
        if (denied := authorized(request)) is not None:
            return denied
        seen = {r.model_name: r for r in router.routes.values()}
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "owned_by": "rollouts", "root": name, "deployment_id": r.deployment_id}
                for name, r in sorted(seen.items())
            ],
        }

    async def proxy(request: Request, path: str):
        if (denied := authorized(request)) is not None:
            return denied
        try:
            body = await request.json()
        except ValueError:
            return error(400, "invalid_argument", "request body is not JSON")
        if not isinstance(body, dict):
            return error(400, "invalid_argument", "request body must be a JSON object")
        route = router.resolve(body.get("model"))
        if route is None:
            known = sorted({r.model_name for r in router.routes.values()})
            return error(404, "not_found", f"model {body.get('model')!r} is not served here; models: {', '.join(known) or 'none'}")
        try:
            body = translate_nvext(body)
        except ValueError as exc:
            return error(400, "invalid_argument", str(exc))
        session = request.headers.get(SESSION_HEADER)
        stream = bool(body.get("stream"))
        payload = json.dumps(body).encode()
        http: httpx.AsyncClient = state["http"]
        last_error = "no ready replica"
        for url in router.candidates(route, session):
            router.in_flight[url] = router.in_flight.get(url, 0) + 1
            released = False

            def release(u: str = url) -> None:
                nonlocal released
                if not released:
                    released = True
                    router.in_flight[u] = max(0, router.in_flight.get(u, 1) - 1)

            try:
                upstream = await http.send(
                    http.build_request("POST", f"{url}{path}", content=payload, headers={"content-type": "application/json"}),
                    stream=True,
                )
            except httpx.TransportError as exc:
                release()
                last_error = f"replica {url}: {exc!r}"
                continue  # nothing was sent to the client yet: try the next replica
            router.pin(session, url)
            if not stream or upstream.status_code != 200:
                try:
                    content = await upstream.aread()
                finally:
                    await upstream.aclose()
                    release()
                return Response(content, status_code=upstream.status_code, media_type=upstream.headers.get("content-type"))

            async def relay(resp: httpx.Response = upstream):
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                except httpx.HTTPError as exc:
                    err = {"error": {"message": f"replica stream broke: {exc!r}", "type": "unavailable", "code": 503}}
                    yield f"data: {json.dumps(err)}\n\n".encode()
                finally:
                    await resp.aclose()
                    release()

            return StreamingResponse(relay(), status_code=200, media_type="text/event-stream")
        return error(503, "unavailable", f"no replica of {route.model_name} could take the request: {last_error}")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await proxy(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await proxy(request, "/v1/completions")

    return app
