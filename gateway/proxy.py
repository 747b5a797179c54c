"""The gateway's inference proxy: one authenticated request to the deployment it names, and the
answer (the contract clients see is ``gateway/app.py``'s).

Contract of ``Proxy(settings, router, meter)``:

- ``open()`` / ``aclose()``: its HTTP clients (``gateway.upstream.upstream_client``): one to the
  replicas, and the Dynamo path's (``gateway/dynamo_proxy.py``). The app opens them in its
  lifespan and closes them after.
- ``serve(request, path, organization_id)``: the answer to ``POST path`` from a caller of that
  organization. It raises ``contracts.errors.ApiError`` for the gateway's own refusals: the body's
  (``gateway/body.py``: 400, 413), a ``model`` that is not a string (400), a model not served to
  that organization (404 ``not_found``, naming the models it may use), none of the named
  deployments taking traffic, even after a fresh read (503), a field the plan refuses
  (``gateway.nvext.plan_request``, or Dynamo's: 400), and no replica able to take the request
  (503, naming the last four failures). The request counts on ``meter`` for its deployment from
  the routing until its answer is over (``LoadMeter.track``).
- A vLLM deployment's request (``forward`` then ``through_replicas``): before it is planned, a
  view that shows a hot-load (under way, or a replica not settled) is read afresh. The body goes
  with ``model`` set to the deployment's model name (what its replicas serve; the client may have
  named the deployment's id). The replicas
  are tried in ``Router.candidates`` order (the session's pinned replica first, then the least
  loaded, those whose connection just failed last), each with its engine guard's header
  (``Settings.engine_headers``) and one request in flight on the router while it runs. A
  connection error, a 5xx while another replica is left, or a stream that fails before its first
  event marks the replica failed and goes to the next one; another error answer is
  ``gateway.upstream.upstream_error``'s. The replica that answers is marked ok and pinned for
  the session. A non-streamed answer is finished (``gateway.relay.finish_answer``), its choices'
  ``routed_experts`` moved to ``nvext`` (merged into any ``nvext`` it has); a streamed request
  for ``routed_experts`` is sent non-streamed (vLLM returns routes only there; no
  ``stream_options``) and replayed as SSE chunks (``gateway.sse.as_chunks``, ``nvext`` on the
  last chunk with choices, then ``[DONE]``); a stream is relayed from its first event
  (``gateway.relay.Relay.stream``). Every answer carries ``x-rollouts-replica``.
- A dynamo deployment's request goes to ``DynamoProxy.forward``.
"""

from __future__ import annotations

import json
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


class Proxy:
    def __init__(self, settings: Settings, router: Router, meter: LoadMeter) -> None:
        self.settings, self.router, self.meter = settings, router, meter
        self.relay = Relay(router)
        self.dynamo = DynamoProxy(settings, router, self.relay)
        self.http: httpx.AsyncClient  # open() makes it

    def open(self) -> None:
        # No overall timeout: a request queued behind a paused replica waits (see gateway/app.py).
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
        client did not see."""
        plan, view = attempt.plan, attempt.view
        router = self.router
        # vLLM sends routes only on non-streamed answers: replay those as a stream.
        replay = plan.stream and "routed_experts" in plan.extra_fields
        # The replicas serve the deployment's model name, whether the client named it or the
        # deployment's id.
        upstream_body = {**plan.upstream, "model": view.model_name}
        if replay:
            upstream_body = {k: v for k, v in upstream_body.items() if k != "stream_options"}
            upstream_body["stream"] = False
        payload = json.dumps(upstream_body).encode()
        http = self.http
        failures: list[str] = []
        candidates = router.candidates(view, session)
        for i, replica in enumerate(candidates):
            more = i + 1 < len(candidates)
            url = replica.engine_url
            # The replica's engine answers only its agent and gateways (replica/engine/guard.py).
            upstream_headers = {"content-type": "application/json",
                                **self.settings.engine_headers(view.workflow_id, replica.name)}
            router.acquire(url)
            if not plan.stream or replay:
                try:
                    resp = await http.post(f"{url}{path}", content=payload, headers=upstream_headers)
                except httpx.TransportError as exc:
                    router.release(url)
                    router.mark_failed(url)
                    failures.append(f"{replica.name}: {type(exc).__name__}: {exc}")
                    continue  # nothing was sent to the client yet: try the next replica
                router.release(url)
                if resp.status_code >= 500 and more:
                    router.mark_failed(url)
                    failures.append(f"{replica.name}: HTTP {resp.status_code} {resp.text[:200]}")
                    continue
                if resp.status_code != 200:
                    return upstream_error(resp.status_code, resp.content, resp.headers.get("content-type"))
                router.mark_ok(url)
                router.pin(session, replica.name)
                return await self.answered(attempt, replica, resp.json(), replay)

            try:
                upstream = await http.send(
                    http.build_request("POST", f"{url}{path}", content=payload, headers=upstream_headers),
                    stream=True,
                )
            except httpx.TransportError as exc:
                router.release(url)
                router.mark_failed(url)
                failures.append(f"{replica.name}: {type(exc).__name__}: {exc}")
                continue
            if upstream.status_code != 200:
                content = await upstream.aread()
                await upstream.aclose()
                router.release(url)
                if upstream.status_code >= 500 and more:
                    router.mark_failed(url)
                    failures.append(f"{replica.name}: HTTP {upstream.status_code} {content[:200]!r}")
                    continue
                return upstream_error(upstream.status_code, content, upstream.headers.get("content-type"))
            events = sse_events(upstream)
            try:
                # Commit to this replica only once its first event arrived: before that, a
                # failure is still invisible to the client and the next replica can take over.
                first = await anext(events)
            except (httpx.HTTPError, StopAsyncIteration) as exc:
                await upstream.aclose()
                router.release(url)
                router.mark_failed(url)
                failures.append(f"{replica.name}: stream failed before its first event: {exc!r}")
                continue
            router.mark_ok(url)
            router.pin(session, replica.name)
            return StreamingResponse(
                self.relay.stream(attempt, Served(replica, url), upstream, first, events),
                status_code=200, media_type="text/event-stream", headers={REPLICA_HEADER: replica.name},
            )
        detail = "; ".join(failures[-4:]) or "no running replica"
        raise Unavailable(f"no replica of {view.model_name} could take the request: {detail}")

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
