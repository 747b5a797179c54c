"""A dynamo deployment's inference request (``runtime.engine: dynamo-vllm``), through Dynamo's
frontend (docs/design.md "Dynamo"; the translation is ``gateway/dynamo.py``).

``DynamoProxy.open()`` makes its client (mutual TLS when the stack has its certificates);
``forward(attempt, path, session)`` answers one planned request. Invariants: the frontend's URL
is read once, when first needed; only a request the frontend did not take, or answered 503 (no
worker registered), is sent again, every ``DYNAMO_RETRY_S`` for up to ``DYNAMO_WAIT_S`` (then
503, or Dynamo's answer); nothing else is retried (Dynamo migrates a failed worker's request);
the router counts the request in flight while it runs. A stream is relayed once its first event
arrived; a non-streamed request is assembled from Dynamo's stream and finished like a vLLM
replica's answer; both name the replica in ``x-rollouts-replica``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from common.settings import Settings
from contracts.errors import InvalidArgument, Unavailable
from contracts.names import dynamo_model
from gateway import dynamo
from gateway.attempt import REPLICA_HEADER, SESSION_HEADER, Attempt, Served
from gateway.nvext import RequestError
from gateway.relay import Relay, finish_answer
from gateway.routing import ReplicaView, Router
from gateway.sse import sse_events
from gateway.upstream import upstream_client, upstream_error

# How long a dynamo deployment's request waits for Dynamo's frontend to have a worker (503), and
# how often it asks again.
DYNAMO_WAIT_S = 60.0
DYNAMO_RETRY_S = 0.1


class DynamoProxy:
    def __init__(self, settings: Settings, router: Router, relay: Relay) -> None:
        self.settings, self.router, self.relay = settings, router, relay
        self.http: httpx.AsyncClient  # open() makes it
        self.url: str | None = None  # Dynamo's frontend, read when first needed

    def open(self) -> None:
        # Dynamo's frontend: mutual TLS with the stack's client certificate when the stack has
        # its certificates (common/dynamo_tls.py), so only a gateway reaches a model through it.
        tls = self.settings.dynamo_tls()
        self.http = upstream_client(verify=tls.ssl_context() if tls else True)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def forward(self, attempt: Attempt, path: str, session: str | None) -> Response:
        """A dynamo deployment's request, through Dynamo's frontend (``gateway/dynamo.py``): its
        router picks the worker (session affinity from ``X-Dynamo-Session-ID``). A 503 or a
        refused connection before the answer began is asked again for up to ``DYNAMO_WAIT_S``;
        nothing else is retried (Dynamo migrates a request whose worker fails)."""
        plan, view = attempt.plan, attempt.view
        if self.url is None:  # read once, when first needed (a gateway may serve no dynamo deployment)
            self.url = self.settings.dynamo_frontend_url
        url = self.url
        headers = {"content-type": "application/json", **({SESSION_HEADER: session} if session else {})}
        try:
            payload = json.dumps(
                dynamo.upstream_body(
                    plan, dynamo_model(view.workflow_id), self.settings.dynamo_request_secret(view.workflow_id)
                )
            ).encode()
        except RequestError as exc:  # a field Dynamo cannot do (gateway/dynamo_fields.py)
            raise InvalidArgument(str(exc)) from exc
        workers = view.dynamo_workers()
        served = Served(view.replicas[0], url)
        upstream = await self._send_until_taken(f"{url}{path}", payload, headers, attempt)
        if isinstance(upstream, Response):
            return upstream

        def adapt(chunk: dict[str, Any]) -> None:
            replica = dynamo.adopt(chunk, workers, view.model_name)
            if replica is not None:
                served.replica = replica

        events = sse_events(upstream)
        self.router.acquire(url)
        if plan.stream:
            return await self._relay_stream(attempt, served, upstream, events, workers, adapt)
        return await self._assemble_answer(attempt, served, upstream, events, adapt)

    async def _send_until_taken(
        self, target: str, payload: bytes, headers: dict[str, str], attempt: Attempt
    ) -> httpx.Response | Response:
        """The frontend's 200 answer, still streaming; or the error answer to give the client.

        Dynamo answers 503 while no worker of the model is registered (all of them paused, or
        between one leaving and another joining): nothing reached the client yet, so wait for
        one, as a request to a paused vLLM replica waits for its resume, up to DYNAMO_WAIT_S."""
        http, model_name = self.http, attempt.view.model_name
        deadline = time.monotonic() + DYNAMO_WAIT_S
        while True:
            try:
                upstream = await http.send(
                    http.build_request("POST", target, content=payload, headers=headers), stream=True
                )
            except httpx.TransportError as exc:
                if time.monotonic() < deadline:
                    await asyncio.sleep(DYNAMO_RETRY_S)
                    continue
                raise Unavailable(
                    f"Dynamo's frontend at {self.url} could not take the request for "
                    f"{model_name}: {type(exc).__name__}: {exc}"
                ) from exc
            if upstream.status_code == 200:
                return upstream
            content = await upstream.aread()
            await upstream.aclose()
            if upstream.status_code == 503 and time.monotonic() < deadline:
                await asyncio.sleep(DYNAMO_RETRY_S)
                continue
            return upstream_error(upstream.status_code, content, upstream.headers.get("content-type"))

    async def _relay_stream(
        self,
        attempt: Attempt,
        served: Served,
        upstream: httpx.Response,
        events: AsyncIterator[str],
        workers: Mapping[int, ReplicaView],
        adapt: Callable[[dict[str, Any]], None],
    ) -> Response:
        """A streamed answer, once its first event arrived (one that fails before it: 503)."""
        url, model_name = served.url, attempt.view.model_name
        try:
            first = await anext(events)
        except (httpx.HTTPError, StopAsyncIteration) as exc:
            await upstream.aclose()
            self.router.release(url)
            raise Unavailable(
                f"Dynamo's frontend stream for {model_name} failed before its first event: {exc!r}"
            ) from exc
        # Dynamo names the worker on its first chunk: the header says which replica answers.
        named = dynamo.served_by(first, workers)
        if named is not None:
            served.replica = named
        return StreamingResponse(
            self.relay.stream(attempt, served, upstream, first, events, adapt),
            status_code=200,
            media_type="text/event-stream",
            headers={REPLICA_HEADER: named.name} if named is not None else None,
        )

    async def _assemble_answer(
        self,
        attempt: Attempt,
        served: Served,
        upstream: httpx.Response,
        events: AsyncIterator[str],
        adapt: Callable[[dict[str, Any]], None],
    ) -> Response:
        """A non-streamed answer: the streamed chunks assembled, finished and given ``nvext``."""
        plan, model_name = attempt.plan, attempt.view.model_name
        assembler = dynamo.Assembler(plan.chat)
        try:
            async for data in events:
                if data.strip() == "[DONE]":
                    break
                chunk = json.loads(data)
                if isinstance(chunk, dict) and "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message") if isinstance(error, dict) else str(error)
                    raise Unavailable(f"{model_name}: the answer broke off: {message}")
                adapt(chunk)
                assembler.add(chunk)
            else:
                raise Unavailable(f"{model_name}: Dynamo's frontend closed the answer before its end")
        except httpx.HTTPError as exc:
            raise Unavailable(f"{model_name}: the answer broke off: {exc!r}") from exc
        finally:
            await upstream.aclose()
            self.router.release(served.url)
        answer = assembler.answer()
        finish_answer(plan, answer)
        answer["nvext"] = await self.relay.response_nvext(attempt, served.replica)
        return JSONResponse(answer, headers={REPLICA_HEADER: served.replica.name})
