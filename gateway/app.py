"""The OpenAI-compatible gateway in front of the deployments' replicas.

This module wires the app: its lifespan (the proxy's HTTP clients; with ``refresh``, the routing
refresh and the load report), authentication, ``GET /v1/models`` and ``/healthz``, the inference
routes (``gateway/proxy.py``: ``Proxy``; a dynamo deployment's path: ``gateway/dynamo_proxy.py``),
and one exception handler that answers every ``contracts.errors.ApiError`` a route raises with
``gateway.errors.error_response``; any other exception of an inference route is logged and
answered 500 ``internal``.

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
  Dynamo's frontend instead (``gateway/dynamo_proxy.py``; docs/design.md "Dynamo"): same auth,
  routing table, 400s and ``nvext``; Dynamo's router picks the worker; a 503 before the answer began
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
  (``replica/engine/swap.py``: pause, set the label to the snapshot identity, swap, prove,
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
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from common.settings import Settings
from contracts.errors import ApiError, Internal
from contracts.tokens import Principal, TokenStore
from gateway.errors import error_response
from gateway.listing import model_list
from gateway.load import LoadMeter, report_loop, temporal_signal
from gateway.proxy import Proxy
from gateway.routing import Router, refresh_loop

log = logging.getLogger("rollouts.gateway")


def authorize(tokens: TokenStore, request: Request, action: str | None = None) -> Principal:
    """The caller; with ``action``, one that may run it (admin). Raises ``Unauthenticated`` or
    ``PermissionDenied``."""
    principal = tokens.authenticate(request.headers.get("authorization"))
    if action is not None:
        principal.require_admin(action)
    return principal


def create_gateway_app(settings: Settings, *, refresh: bool = True, router: Router | None = None) -> FastAPI:
    """The gateway app; ``refresh=False`` with a prepared ``router`` serves a fixed table (tests).
    The router serves the deployments that list ``settings.gateway_id`` unless it names a gateway."""
    tokens = TokenStore(settings.tokens_file)
    router = router or Router()
    meter = LoadMeter()
    if router.gateway_id is None:
        router.gateway_id = settings.gateway_id
    proxy = Proxy(settings, router, meter)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        proxy.open()
        tasks = [asyncio.create_task(refresh_loop(router, settings)),
                 asyncio.create_task(report_loop(router, meter, temporal_signal(settings)))] if refresh else []
        yield
        for task in tasks:
            task.cancel()
        await proxy.aclose()

    app = FastAPI(title="rollouts gateway", lifespan=lifespan)
    app.state.router = router
    app.state.load = meter

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "models": [v.model_name for v in router.models()]}

    @app.get("/v1/models")
    async def models(request: Request):
        principal = authorize(tokens, request)
        return model_list(router.models(principal.organization_id))

    async def guarded(request: Request, path: str):
        # An exception escaping a handler makes the server drop the client's connection: answer it.
        try:
            principal = authorize(tokens, request, "running inference")
            return await proxy.serve(request, path, principal.organization_id)
        except ApiError:
            raise  # the gateway's own refusal: answered by api_error
        except Exception:  # noqa: BLE001 - logged; the client gets a 500 in the usual shape
            log.exception("request to %s failed", path)
            raise Internal("internal error in the gateway; see its log") from None

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await guarded(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await guarded(request, "/v1/completions")

    return app
