"""The OpenAI-compatible gateway in front of the deployments' replicas.

Contract:

- ``POST /v1/chat/completions`` and ``POST /v1/completions`` (text or token-id prompts, ``n``
  choices, streamed as SSE or not), ``GET /v1/models`` (each model name once:
  ``gateway/listing.py``), with ``Authorization: Bearer <token>``
  from the stack's tokens file; a deployment of another organization, or one that does not list
  this gateway in ``gatewayIds``, is not found. Inference needs an ``admin`` token (the guide's
  Inference Admin role); a ``viewer`` token only reads: ``GET /v1/models`` lists for it, and an
  inference request answers 403 ``permission_denied``.
- Errors (``gateway/errors.py``) carry the API's ``{"code", "message", "details"}`` and OpenAI's
  ``{"error": {"message", "type", "code"}}`` in one body: 401, 403, 404 (unknown model), 413
  ``payload_too_large`` for a body over 8 MiB, 400
  ``invalid_argument`` for any malformed body (``gateway/body.py``: not UTF-8,
  not JSON, nested over 64 levels, not an object), a ``model`` that is not a string, the
  gateway's own field checks (``gateway/nvext.py``: ``n`` at most 64 sequences per request ...)
  and vLLM's own 400s (their message kept); 503 (no replica could take the request); 500
  ``internal`` for a bug, answered without dropping the connection. vLLM's other error answers
  pass through as vLLM wrote them. A refused request leaves the keep-alive connection usable.
- Routing (``gateway/routing.py``): by ``model`` (a deployment's ``model.name`` or id) to one of
  the deployments of that name that take traffic (running replicas, not FAILED or being
  deleted, weight above 0), split by ``traffic.weight`` (by id: that deployment, whatever its
  weight), then to one of its running replicas; ``X-Dynamo-Session-ID`` pins a trajectory to
  one replica while it is listed and healthy (TTL ``SESSION_TTL_S``), else the least-loaded
  replica.
- Retries: a request that fails before the client received any byte (connection refused or
  reset, a replica that died while generating a non-streamed answer, a 5xx, a stream that broke
  before its first event) is sent to the next replica. A stream that breaks after bytes reached
  the client ends with an SSE error event ``data: {"error": {...}}`` and no ``[DONE]``: never a
  silent truncation (a stream that ends without vLLM's ``[DONE]`` counts as broken).
- A dynamo deployment (`runtime.engine: dynamo-vllm`: its replicas are Dynamo workers) is served through
  Dynamo's frontend instead (``through_dynamo``; docs/design.md "Dynamo"): same auth, routing
  table, 400s and ``nvext``; Dynamo's router picks the worker; a 503 before the answer began
  (no worker registered at that moment) is asked again for up to ``DYNAMO_WAIT_S``.
- During a replica's pause (``/pause?mode=keep`` while a hot-load swaps its weights) vLLM queues
  new requests itself; the gateway does not time them out (read timeout 600 s), so they wait.
- Responses pass through as vLLM wrote them, plus: ``choices[].logprobs.content[].token_id`` on
  chat (vLLM 0.32 omits it), and a top-level ``nvext`` object (on a stream: on the last chunk
  that carries a ``finish_reason``) with ``weight_versions`` always (below), and, when named in
  ``nvext.extra_fields``: ``worker_id`` (``{"prefill_worker_id", "decode_worker_id"}``, the
  replica's name: prefill and decode run on the same replica), ``timing`` (gateway clock:
  ``request_received_ms`` Unix epoch, ``total_time_ms``, and on streams ``ttft_ms``/``itl_ms``),
  ``completion_token_ids`` (``n`` = 1), ``routed_experts`` (``{data, shape, dtype, start}``;
  vLLM returns routes only on non-streamed answers, so a streamed request for them is served
  from a non-streamed upstream request and replayed as SSE chunks).
- ``nvext.weight_versions``: which snapshot identity produced the tokens::

      {"identity": null, "exact": false, "identities": ["step-6", "step-7"], "replica": "r-0",
       "spans": [{"choice": 0, "identity": "step-6", "start": 0, "end": 22},
                 {"choice": 0, "identity": "step-7", "start": 22, "end": 600}]}

  ``identity`` names the one snapshot every token of every choice came from, or is null when
  the tokens are not known to come from one snapshot; ``exact`` is true exactly when
  ``identity`` is set; ``identities`` lists the snapshots that did (or, without ``spans``, may
  have) produced tokens, in load order; ``replica`` served the request. ``spans`` (present when
  the replica reported per-token versions for every choice): per choice (``choice`` is its
  ``index``), in generation order, the completion tokens ``[start, end)`` the snapshot
  ``identity`` sampled: indices into that choice's ``token_ids``, ``logprobs`` entries and
  ``nvext.completion_token_ids`` (an echoed prompt is not counted). A choice's spans tile its
  completion tokens, so their lengths add up to its token count; a request that spanned a
  PRESERVE hot-load has one span per identity, the old one first. With spans, the label is
  the engine's record and exact; without them it is inferred from Temporal around the request
  (``routing.weight_versions``), and a request that spanned a hot-load gets both identities
  and no spans.
- Why spans are exact (vLLM 0.32 source, no clock involved): the engine core handles utility
  calls (pause, the worker RPC that swaps the weights, ``set_weight_version``, resume) on its
  one thread between engine steps; ``pause(mode=keep)`` returns once no step is in flight and
  nothing is scheduled until ``resume``; each step's outputs are stamped with the label current
  when the step ran (``EngineCore._attach_weight_version``) and the API server's output
  processor opens a span at the first token whose step carries a new label
  (``RequestState.track_weight_version``; the spans reach the final ``CompletionOutput``). The
  replica agent changes weights and label only together inside one such pause
  (``ReplicaRuntime._swap_staged``: pause, swap, set the label to the snapshot identity,
  resume), so a token's label is the identity of the weights whose forward pass sampled it
  (under PRESERVE, over KV cache partly computed by the previous weights).
- What the replica must provide for spans: vLLM 0.32 writes ``CompletionOutput.weight_versions``
  only on its token API (``/inference/v1/generate``, off unless ``--enable-scale-out``), not on
  the OpenAI routes the gateway relays; the replica's server has to copy it onto each OpenAI
  choice (contract in ``gateway/nvext.py``; ``replica/engine/server.py`` does it on every
  replica). The gateway does not generate through the token API itself: one call there cannot
  give an OpenAI answer (its text mode names no ids for top-logprob candidates, its tokens mode
  has no text), and vLLM's derender routes cost one call per streamed chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.errors import ApiError, Internal, InvalidArgument, NotFound, PayloadTooLarge, Unavailable
from common.settings import Settings
from common.tokens import Principal, TokenStore
from contracts.names import dynamo_model
from gateway import dynamo
from gateway.body import read_json_object
from gateway.errors import error_response
from gateway.listing import model_list
from gateway.load import LoadMeter, report_loop, temporal_signal
from gateway.nvext import (
    RequestError,
    RequestPlan,
    finish_choice,
    finish_chunk,
    plan_request,
    strip_prompt_ids,
    translate_routed_experts,
    version_spans,
)
from gateway.routing import DeploymentView, ReplicaView, Router, refresh_loop, weight_versions

log = logging.getLogger("rollouts.gateway")
SESSION_HEADER = "x-dynamo-session-id"
# How long a dynamo deployment's request waits for Dynamo's frontend to have a worker (503), and
# how often it asks again.
DYNAMO_WAIT_S = 60.0
DYNAMO_RETRY_S = 0.1
REPLICA_HEADER = "x-rollouts-replica"


class StreamBroken(Exception):
    """The upstream stream ended without vLLM's ``[DONE]``."""


@dataclass
class Attempt:
    """One request's bookkeeping across its tries."""

    plan: RequestPlan
    view: DeploymentView  # read before the request was sent (the "before" of weight_versions)
    received_wall: float = field(default_factory=time.time)
    received: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    token_events: int = 0

    def saw_tokens(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.token_events += 1


@dataclass
class Served:
    """Who is serving a relayed stream: the replica (known from the start for a vLLM replica; for a
    dynamo deployment, once Dynamo's frontend names its worker) and the URL whose load it counts."""

    replica: ReplicaView
    url: str


def upstream_error(status: int, content: bytes, content_type: str | None) -> Response:
    """A replica's (or Dynamo's) error answer: a 400 in our shape with the engine's message
    (Dynamo's ``details`` spelled out), anything else as is."""
    if status == 400:
        try:
            data = json.loads(content)
            message = data["error"]["message"] if isinstance(data.get("error"), dict) else data["message"]
            if isinstance(data.get("details"), dict):
                message = dynamo.explain(str(message), data["details"])
        except (ValueError, KeyError, TypeError, AttributeError):
            message = None
        if isinstance(message, str) and message:
            return error_response(InvalidArgument(message))
    return Response(content, status_code=status, media_type=content_type)


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def sse_events(resp: httpx.Response) -> AsyncIterator[str]:
    """The ``data`` payloads of an SSE stream, one per event."""
    data: list[str] = []
    async for line in resp.aiter_lines():
        if line == "":
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        yield "\n".join(data)


def _has_tokens(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("token_ids") or (choice.get("logprobs") or None):
            return True
    return False


def as_chunks(data: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """A non-streamed answer replayed as stream chunks: one per choice, then usage if present."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {k: data[k] for k in ("id", "created", "model") if k in data}
    chunks = []
    for choice in data.get("choices") or []:
        c = {k: v for k, v in choice.items() if k not in ("message",)}
        if chat:
            message = choice.get("message") or {}
            c["delta"] = {k: v for k, v in message.items() if v is not None}
        chunks.append({**head, "object": kind, "choices": [c]})
    if data.get("usage") is not None:
        chunks.append({**head, "object": kind, "choices": [], "usage": data["usage"]})
    return chunks


def create_gateway_app(settings: Settings, *, refresh: bool = True, router: Router | None = None) -> FastAPI:
    """The gateway app; ``refresh=False`` with a prepared ``router`` serves a fixed table (tests).
    The router serves the deployments that list ``settings.gateway_id`` unless it names a gateway."""
    tokens = TokenStore(settings.tokens_file)
    router = router or Router()
    meter = LoadMeter()
    if router.gateway_id is None:
        router.gateway_id = settings.gateway_id
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # No overall timeout: a request queued behind a paused replica waits (see the docstring).
        state["http"] = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5, read=600, write=60, pool=60),
            # Pooled connections expire before vLLM's server drops idle ones (5 s by default):
            # reusing one it just closed would look like a replica failure.
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=4.0),
        )
        # Dynamo's frontend: mutual TLS with the stack's client certificate when the stack has
        # its certificates (common/dynamo_tls.py), so only a gateway reaches a model through it.
        tls = settings.dynamo_tls()
        state["dynamo"] = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5, read=600, write=60, pool=60),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=4.0),
            verify=tls.ssl_context() if tls else True,
        )
        tasks = [asyncio.create_task(refresh_loop(router, settings)),
                 asyncio.create_task(report_loop(router, meter, temporal_signal(settings)))] if refresh else []
        yield
        for task in tasks:
            task.cancel()
        await state["http"].aclose()
        await state["dynamo"].aclose()

    app = FastAPI(title="rollouts gateway", lifespan=lifespan)
    app.state.router = router
    app.state.load = meter

    def authorized(request: Request, action: str | None = None) -> Principal | JSONResponse:
        """The caller; with ``action``, one that may run it (admin)."""
        try:
            principal = tokens.authenticate(request.headers.get("authorization"))
            if action is not None:
                principal.require_admin(action)
            return principal
        except ApiError as exc:
            return error_response(exc)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "models": [v.model_name for v in router.models()]}

    @app.get("/v1/models")
    async def models(request: Request):
        principal = authorized(request)
        if isinstance(principal, JSONResponse):
            return principal
        return model_list(router.models(principal.organization_id))

    async def response_nvext(attempt: Attempt, replica: ReplicaView, data: dict[str, Any] | None) -> dict[str, Any]:
        """The ``nvext`` object of an answer that has finished (reads a fresh view: see routing)."""
        plan = attempt.plan
        out: dict[str, Any] = {}
        extra = plan.extra_fields
        if "worker_id" in extra:
            out["worker_id"] = {"prefill_worker_id": replica.name, "decode_worker_id": replica.name}
        if "completion_token_ids" in extra:
            out["completion_token_ids"] = list(plan.token_ids.get(0, []))
        if "routed_experts" in extra and data is not None:
            choices = data.get("choices") or []
            value = choices[0].get("routed_experts") if choices else None
            out["routed_experts"] = None if value is None else translate_routed_experts(value, plan.routed_experts_start)
        spans = version_spans(plan)
        if spans:  # the engine's own record: no need to read Temporal
            out["weight_versions"] = weight_versions(None, None, 0, 0, replica.name, spans)
        else:
            after_view = await router.fresh_view(attempt.view.workflow_id)
            after = after_view.replica(replica.name) if after_view is not None else None
            out["weight_versions"] = weight_versions(
                attempt.view.replica(replica.name), after, attempt.view.epoch,
                after_view.epoch if after_view is not None else attempt.view.epoch, replica.name, spans,
            )
        if "timing" in extra:
            now = time.monotonic()
            timing: dict[str, Any] = {
                "request_received_ms": int(attempt.received_wall * 1000),
                "total_time_ms": round((now - attempt.received) * 1000, 3),
            }
            if attempt.first_token is not None:
                timing["ttft_ms"] = round((attempt.first_token - attempt.received) * 1000, 3)
                if attempt.token_events > 1 and attempt.last_token is not None:
                    timing["itl_ms"] = round((attempt.last_token - attempt.first_token) * 1000 / (attempt.token_events - 1), 3)
            out["timing"] = timing
        return out

    def finish_answer(plan: RequestPlan, data: dict[str, Any]) -> None:
        for choice in data.get("choices") or []:
            if isinstance(choice, dict):
                finish_choice(plan, choice)
        strip_prompt_ids(plan, data)

    async def proxy(request: Request, path: str):
        principal = authorized(request, "running inference")
        if isinstance(principal, JSONResponse):
            return principal
        try:
            body = await read_json_object(request)
        except (InvalidArgument, PayloadTooLarge) as exc:
            return error_response(exc)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            return error_response(InvalidArgument("model must be a string: a deployment's model.name or id"))
        session = request.headers.get(SESSION_HEADER)
        named, view = await router.fresh_route(model, principal.organization_id, session)
        if not named:
            known = sorted({v.model_name for v in router.models(principal.organization_id)})
            return error_response(NotFound(f"model {model!r} is not served here; models: {', '.join(known) or 'none'}"))
        if view is None:
            states = "; ".join(v.describe() for v in named)
            return error_response(Unavailable(
                f"no replica of {named[0].model_name} could take the request: no running replica of a deployment "
                f"that takes traffic: {states}"
            ))
        meter.begin(view.workflow_id)
        try:
            response = await forward(body, path, view, session)
        except BaseException:
            meter.end(view.workflow_id)
            raise
        return meter.track(view.workflow_id, response)

    async def forward(body: dict[str, Any], path: str, view: DeploymentView, session: str | None):
        """The request to the chosen deployment's replicas (or its Dynamo frontend) and the answer."""
        try:
            plan = plan_request(body, path, view.engine_config)
        except RequestError as exc:
            return error_response(InvalidArgument(str(exc)))
        if view.active_hot_load_id or not all(r.settled for r in view.replicas):
            # A hot-load is (or was, in the cached view) under way: label against a current read.
            view = await router.fresh_view(view.workflow_id) or view
        attempt = Attempt(plan=plan, view=view)
        if view.dynamo:
            return await through_dynamo(attempt, path, session)
        # vLLM sends routes only on non-streamed answers: replay those as a stream.
        replay = plan.stream and "routed_experts" in plan.extra_fields
        upstream_body = plan.upstream
        if replay:
            upstream_body = {k: v for k, v in plan.upstream.items() if k != "stream_options"}
            upstream_body["stream"] = False
        payload = json.dumps(upstream_body).encode()
        http: httpx.AsyncClient = state["http"]
        failures: list[str] = []
        candidates = router.candidates(view, session)
        for i, replica in enumerate(candidates):
            more = i + 1 < len(candidates)
            url = replica.engine_url
            # The replica's engine answers only its agent and gateways (replica/engine/guard.py).
            upstream_headers = {"content-type": "application/json",
                                **settings.engine_headers(view.workflow_id, replica.name)}
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
                data = resp.json()
                finish_answer(plan, data)
                nvext = await response_nvext(attempt, replica, data)
                for choice in data.get("choices") or []:
                    choice.pop("routed_experts", None)  # moved to nvext.routed_experts (guide's shape)
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
                relay(attempt, Served(replica, url), upstream, first, events),
                status_code=200, media_type="text/event-stream", headers={REPLICA_HEADER: replica.name},
            )
        detail = "; ".join(failures[-4:]) or "no running replica"
        return error_response(Unavailable(f"no replica of {view.model_name} could take the request: {detail}"))

    async def through_dynamo(attempt: Attempt, path: str, session: str | None):
        """A dynamo deployment's request, through Dynamo's frontend (``gateway/dynamo.py``): its
        router picks the worker (session affinity from ``X-Dynamo-Session-ID``). A 503 or a
        refused connection before the answer began is asked again for up to ``DYNAMO_WAIT_S``;
        nothing else is retried (Dynamo migrates a request whose worker fails)."""
        plan, view = attempt.plan, attempt.view
        http: httpx.AsyncClient = state["dynamo"]
        if "dynamo_url" not in state:  # read once, when first needed (a gateway may serve no dynamo deployment)
            state["dynamo_url"] = settings.dynamo_frontend_url
        url = state["dynamo_url"]
        headers = {"content-type": "application/json", **({SESSION_HEADER: session} if session else {})}
        try:
            payload = json.dumps(dynamo.upstream_body(plan, dynamo_model(view.workflow_id),
                                                      settings.dynamo_request_secret(view.workflow_id))).encode()
        except RequestError as exc:  # a field Dynamo cannot do (gateway/dynamo_fields.py)
            return error_response(InvalidArgument(str(exc)))
        workers = view.dynamo_workers()
        served = Served(view.replicas[0], url)

        def adapt(chunk: dict[str, Any]) -> None:
            replica = dynamo.adopt(chunk, workers, view.model_name)
            if replica is not None:
                served.replica = replica

        # Dynamo answers 503 while no worker of the model is registered (all of them paused, or
        # between one leaving and another joining): nothing reached the client yet, so wait for
        # one, as a request to a paused vLLM replica waits for its resume, up to DYNAMO_WAIT_S.
        deadline = time.monotonic() + DYNAMO_WAIT_S
        while True:
            try:
                upstream = await http.send(
                    http.build_request("POST", f"{url}{path}", content=payload, headers=headers), stream=True)
            except httpx.TransportError as exc:
                if time.monotonic() < deadline:
                    await asyncio.sleep(DYNAMO_RETRY_S)
                    continue
                return error_response(Unavailable(f"Dynamo's frontend at {url} could not take the request for "
                                                  f"{view.model_name}: {type(exc).__name__}: {exc}"))
            if upstream.status_code == 200:
                break
            content = await upstream.aread()
            await upstream.aclose()
            if upstream.status_code == 503 and time.monotonic() < deadline:
                await asyncio.sleep(DYNAMO_RETRY_S)
                continue
            return upstream_error(upstream.status_code, content, upstream.headers.get("content-type"))
        events = sse_events(upstream)
        router.acquire(url)
        if plan.stream:
            try:
                first = await anext(events)
            except (httpx.HTTPError, StopAsyncIteration) as exc:
                await upstream.aclose()
                router.release(url)
                return error_response(Unavailable(f"Dynamo's frontend stream for {view.model_name} failed before "
                                                  f"its first event: {exc!r}"))
            # Dynamo names the worker on its first chunk: the header says which replica answers.
            named = dynamo.served_by(first, workers)
            if named is not None:
                served.replica = named
            return StreamingResponse(relay(attempt, served, upstream, first, events, adapt), status_code=200,
                                     media_type="text/event-stream",
                                     headers={REPLICA_HEADER: named.name} if named is not None else None)
        assembler = dynamo.Assembler(plan.chat)
        try:
            async for data in events:
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else str(error)
                    return error_response(Unavailable(f"{view.model_name}: the answer broke off: {message}"))
                adapt(chunk)
                assembler.add(chunk)
            else:
                return error_response(Unavailable(f"{view.model_name}: Dynamo's frontend closed the answer before "
                                                  "its end"))
        except httpx.HTTPError as exc:
            return error_response(Unavailable(f"{view.model_name}: the answer broke off: {exc!r}"))
        finally:
            await upstream.aclose()
            router.release(url)
        data = assembler.answer()
        finish_answer(plan, data)
        data["nvext"] = await response_nvext(attempt, served.replica, data)
        return JSONResponse(data, headers={REPLICA_HEADER: served.replica.name})

    async def relay(attempt: Attempt, served: Served, upstream: httpx.Response, first: str,
                    events: AsyncIterator[str], adapt: Callable[[dict[str, Any]], None] | None = None
                    ) -> AsyncIterator[bytes]:
        """Relay an SSE stream; nvext goes on the last chunk that carries a finish_reason.
        ``adapt`` (a dynamo deployment's) turns each chunk into a vLLM replica's first."""
        plan = attempt.plan
        held: dict[str, Any] | None = None  # a finish chunk, until we know whether it is the last

        async def with_nvext(chunk: dict[str, Any]) -> bytes:
            chunk["nvext"] = {**(chunk.get("nvext") or {}), **(await response_nvext(attempt, served.replica, None))}
            return sse(chunk)

        try:
            pending: str | None = first
            while True:
                if pending is not None:
                    data, pending = pending, None
                else:
                    try:
                        data = await anext(events)
                    except StopAsyncIteration:
                        raise StreamBroken("the replica closed the stream before [DONE]") from None
                if data.strip() == "[DONE]":
                    if held is not None:
                        yield await with_nvext(held)
                        held = None
                    yield b"data: [DONE]\n\n"
                    return
                try:
                    chunk = json.loads(data)
                except ValueError:
                    yield f"data: {data}\n\n".encode()
                    continue
                if not isinstance(chunk, dict) or "error" in chunk:
                    yield sse(chunk)  # vLLM's own error event: pass it on as it is
                    continue
                if adapt is not None:
                    adapt(chunk)
                finish_chunk(plan, chunk)
                if _has_tokens(chunk):
                    attempt.saw_tokens(time.monotonic())
                choices = chunk.get("choices") or []
                finishes = any(c.get("finish_reason") for c in choices if isinstance(c, dict))
                if held is not None:
                    if not choices:  # the usage chunk follows the last finish chunk
                        yield await with_nvext(held)
                    else:
                        yield sse(held)
                    held = None
                if finishes:
                    held = chunk
                else:
                    yield sse(chunk)
        except (httpx.HTTPError, StreamBroken) as exc:
            if held is not None:
                yield sse(held)
            log.warning("stream from %s broke: %r", served.replica.name, exc)
            yield sse({"error": {"message": f"replica {served.replica.name} stream broke: {exc!r}; the answer is "
                                            "incomplete", "type": "unavailable", "code": 503}})
        finally:
            await upstream.aclose()
            router.release(served.url)

    async def guarded(request: Request, path: str):
        # An exception escaping a handler makes the server drop the client's connection: answer it.
        try:
            return await proxy(request, path)
        except Exception:  # noqa: BLE001 - logged; the client gets a 500 in the usual shape
            log.exception("request to %s failed", path)
            return error_response(Internal("internal error in the gateway; see its log"))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await guarded(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await guarded(request, "/v1/completions")

    return app
