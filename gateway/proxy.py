"""The gateway's inference proxy: one authenticated request to the deployment it names, and the answer.

``Proxy.serve`` reads and routes the body and sends a vLLM deployment's request to its replicas
(``forward``, ``through_replicas``), a dynamo deployment's to ``DynamoProxy.forward``;
``open`` / ``aclose`` hold its HTTP clients for the app's lifespan. Invariants: the gateway's own
refusals are ``contracts.errors.ApiError`` (400, 404, 413, 503); a replica is retried only while
the client has received nothing; each try holds one request in flight on the router and the
request counts on ``meter`` from routing to the end of its answer; every answer names its replica
in ``x-rollouts-replica``. The rules: docs/design.md "The gateway".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.settings import Settings
from contracts.errors import InvalidArgument, NotFound, Unavailable
from gateway.attempt import REPLICA_HEADER, SESSION_HEADER, Attempt, Served
from gateway.body import read_json_object
from gateway.dynamo_proxy import DynamoProxy
from gateway.load import LoadMeter
from gateway.nvext import RequestError, plan_request
from gateway.relay import Relay, finish_answer
from gateway.routing import DeploymentView, ReplicaView, Router
from gateway.sse import as_chunks, sse, sse_events
from gateway.upstream import upstream_client, upstream_error


class _NextReplica(Exception):
    """A replica's failure the client did not see (nothing was sent to it yet): try the next."""


@dataclass(frozen=True)
class _Upstream:
    """What goes to each replica: ``path``, the JSON ``payload``; ``whole``: a non-streamed
    request (``replay``: a streamed one sent so, to be replayed as a stream)."""

    path: str
    payload: bytes
    replay: bool
    whole: bool


async def _sent(http: httpx.AsyncClient, request: httpx.Request, *, stream: bool) -> httpx.Response:
    try:
        return await http.send(request, stream=stream)
    except httpx.TransportError as exc:
        raise _NextReplica(f"{type(exc).__name__}: {exc}") from None


def _refused(status: int, content: bytes, content_type: str | None, more: bool) -> Response:
    """A replica's error answer: a 5xx while another replica is left goes there (`_NextReplica`);
    anything else is the client's answer (``gateway.upstream.upstream_error``)."""
    if status >= 500 and more:
        raise _NextReplica(f"HTTP {status} {content[:200].decode(errors='replace')}")
    return upstream_error(status, content, content_type)


class Proxy:
    def __init__(self, settings: Settings, router: Router, meter: LoadMeter) -> None:
        self.settings, self.router, self.meter = settings, router, meter
        self.relay = Relay(router)
        self.dynamo = DynamoProxy(settings, router, self.relay)
        self.http: httpx.AsyncClient  # open() makes it

    def open(self) -> None:
        # No overall timeout: a request queued behind a paused replica waits (docs/design.md "The gateway").
        self.http = upstream_client()
        self.dynamo.open()

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.dynamo.aclose()

    async def serve(self, request: Request, path: str, organization_id: str) -> Response:
        body = await read_json_object(request)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidArgument("model must be a string: a deployment's model.name or id")
        session = request.headers.get(SESSION_HEADER)
        named, view = await self.router.fresh_route(model, organization_id, session)
        if not named:
            known = sorted({v.model_name for v in self.router.models(organization_id)})
            raise NotFound(f"model {model!r} is not served here; models: {', '.join(known) or 'none'}")
        if view is None:
            states = "; ".join(v.describe() for v in named)
            raise Unavailable(
                f"no replica of {named[0].model_name} could take the request: no running replica of a deployment "
                f"that takes traffic: {states}"
            )
        self.meter.begin(view.workflow_id)
        try:
            response = await self.forward(body, path, view, session)
        except BaseException:
            self.meter.end(view.workflow_id)
            raise
        return self.meter.track(view.workflow_id, response)

    async def forward(self, body: dict[str, Any], path: str, view: DeploymentView, session: str | None) -> Response:
        """The request to the chosen deployment's replicas (or its Dynamo frontend) and the answer."""
        try:
            plan = plan_request(body, path, view.engine_config)
        except RequestError as exc:
            raise InvalidArgument(str(exc)) from exc
        if view.active_hot_load_id or not all(r.settled for r in view.replicas):
            # A hot-load is (or was, in the cached view) under way: label against a current read.
            view = await self.router.fresh_view(view.workflow_id) or view
        attempt = Attempt(plan=plan, view=view)
        if view.dynamo:
            return await self.dynamo.forward(attempt, path, session)
        return await self.through_replicas(attempt, path, session)

    async def through_replicas(self, attempt: Attempt, path: str, session: str | None) -> Response:
        """A vLLM deployment's request to its replicas, the next one after a failure that the
        client did not see (`_NextReplica`: the replica is marked failed and the failure kept
        for the 503 that ends the list)."""
        upstream = self._upstream(attempt, path)
        failures: list[str] = []
        candidates = self.router.candidates(attempt.view, session)
        for i, replica in enumerate(candidates):
            try:
                return await self._through_one(attempt, upstream, replica, session, more=i + 1 < len(candidates))
            except _NextReplica as failed:
                self.router.mark_failed(replica.engine_url)
                failures.append(f"{replica.name}: {failed}")
        detail = "; ".join(failures[-4:]) or "no running replica"
        raise Unavailable(f"no replica of {attempt.view.model_name} could take the request: {detail}")

    def _upstream(self, attempt: Attempt, path: str) -> _Upstream:
        """The body every replica gets: the deployment's model name (whether the client named it
        or the deployment's id); a streamed request for routes sent non-streamed (`_Upstream`)."""
        plan = attempt.plan
        # vLLM sends routes only on non-streamed answers: replay those as a stream.
        replay = plan.stream and "routed_experts" in plan.extra_fields
        body = {**plan.upstream, "model": attempt.view.model_name}
        if replay:
            body = {k: v for k, v in body.items() if k != "stream_options"}
            body["stream"] = False
        return _Upstream(path, json.dumps(body).encode(), replay, whole=not plan.stream or replay)

    async def _through_one(
        self, attempt: Attempt, upstream: _Upstream, replica: ReplicaView, session: str | None, more: bool
    ) -> Response:
        """The request to one replica, one request in flight on the router while it runs; the
        answer once the replica is committed to (marked ok, pinned for the session)."""
        url = replica.engine_url
        # The replica's engine answers only its agent and gateways (replica/engine/guard.py).
        headers = {
            "content-type": "application/json",
            **self.settings.engine_headers(attempt.view.workflow_id, replica.name),
        }
        request = self.http.build_request("POST", f"{url}{upstream.path}", content=upstream.payload, headers=headers)
        self.router.acquire(url)
        if upstream.whole:
            try:
                resp = await _sent(self.http, request, stream=False)
            finally:
                self.router.release(url)
            if resp.status_code != 200:
                return _refused(resp.status_code, resp.content, resp.headers.get("content-type"), more)
            self._committed(url, session, replica)
            return await self.answered(attempt, replica, resp.json(), upstream.replay)
        try:
            opened = await self._first_event(request, more)
        except BaseException:
            self.router.release(url)
            raise
        if isinstance(opened, Response):
            self.router.release(url)
            return opened
        stream, first, events = opened
        self._committed(url, session, replica)
        return StreamingResponse(
            self.relay.stream(attempt, Served(replica, url), stream, first, events),
            status_code=200,
            media_type="text/event-stream",
            headers={REPLICA_HEADER: replica.name},
        )

    async def _first_event(self, request: httpx.Request, more: bool) -> Response | tuple[httpx.Response, Any, Any]:
        """A stream opened up to its first event (before it, a failure is still invisible to the
        client and the next replica can take over); an error answer to pass on as it is."""
        stream = await _sent(self.http, request, stream=True)
        if stream.status_code != 200:
            content = await stream.aread()
            await stream.aclose()
            return _refused(stream.status_code, content, stream.headers.get("content-type"), more)
        events = sse_events(stream)
        try:
            first = await anext(events)
        except (httpx.HTTPError, StopAsyncIteration) as exc:
            await stream.aclose()
            raise _NextReplica(f"stream failed before its first event: {exc!r}") from None
        return stream, first, events

    def _committed(self, url: str, session: str | None, replica: ReplicaView) -> None:
        self.router.mark_ok(url)
        self.router.pin(session, replica.name)

    async def answered(self, attempt: Attempt, replica: ReplicaView, data: dict[str, Any], replay: bool) -> Response:
        """A replica's non-streamed answer for the client: as JSON, or replayed as an SSE stream."""
        plan = attempt.plan
        finish_answer(plan, data)
        nvext = await self.relay.response_nvext(attempt, replica)
        headers = {REPLICA_HEADER: replica.name}
        if not replay:
            data["nvext"] = {**(data.get("nvext") or {}), **nvext}
            return JSONResponse(data, headers=headers)
        chunks = as_chunks(data, plan.chat)
        last = max((k for k, c in enumerate(chunks) if c["choices"]), default=None)
        if last is not None:
            chunks[last]["nvext"] = nvext
        body_bytes = b"".join(sse(c) for c in chunks) + b"data: [DONE]\n\n"
        return Response(body_bytes, media_type="text/event-stream", headers=headers)
