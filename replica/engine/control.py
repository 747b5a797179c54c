"""The handlers of `replica.engine_routes.ENGINE_ROUTES`, over vLLM's ``AsyncLLM``: what every
replica engine answers its agent, whichever server carries it (`replica.engine.server`, a
Dynamo worker's `replica.engine.dynamo_routes`).

Each handler takes the route's JSON body and answers a JSON object; a bad body answers
``{"error": {"code": 400, ...}}``, any other failure ``{"error": {"code": 500, ...}}``
(:func:`answering`). ``pause`` keeps vLLM's meaning (mode, clear_cache) without AsyncLLM's
closing sleep (`replica.engine.swap.pause_at_once`); ``collective_rpc`` returns every worker's
result; ``swap_in_pause`` is the swap (`replica.engine.swap`) and ``swap_hook`` gives a held one
its verdict (``proceed``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from replica.engine.swap import HeldSwap, SwapRequest, pause_at_once, swap_in_pause

Route = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def error(code: int, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message}}


def engine_routes(engine: Any) -> dict[str, Route]:
    """``name -> handler`` for every engine route over ``engine`` (module docstring)."""
    held = HeldSwap()

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
            raise ValueError("'method' (a string) is required")
        results = await engine.collective_rpc(
            method=method,
            timeout=body.get("timeout"),
            args=tuple(body.get("args") or ()),
            kwargs=body.get("kwargs") or {},
        )
        return {"results": [r if r is None or isinstance(r, dict | list) else str(r) for r in (results or [])]}

    async def update_weight_version(body: dict[str, Any]) -> dict[str, Any]:
        version = body.get("new_version")
        if not isinstance(version, str):
            raise ValueError("'new_version' (a string) is required")
        await engine.update_weight_version(version)
        return {"status": "ok"}

    async def weight_info(body: dict[str, Any]) -> dict[str, Any]:
        return {"weight_version": await engine.get_weight_version()}

    async def swap(body: dict[str, Any]) -> dict[str, Any]:
        request = SwapRequest.from_body(body)
        return await (held.start(engine, request) if request.hold else swap_in_pause(engine, request))

    async def swap_hook(body: dict[str, Any]) -> dict[str, Any]:
        return await held.finish(bool(body.get("proceed", False)))

    return {
        "pause": pause,
        "resume": resume,
        "is_paused": is_paused,
        "reset_prefix_cache": reset_prefix_cache,
        "collective_rpc": collective_rpc,
        "update_weight_version": update_weight_version,
        "weight_info": weight_info,
        "swap_in_pause": swap,
        "swap_hook": swap_hook,
    }


def answering(name: str, handler: Route) -> Route:
    """``handler`` answering its failures as errors: ValueError (a bad body) 400, else 500."""

    async def route(body: dict[str, Any]) -> dict[str, Any]:
        try:
            return await handler(body)
        except ValueError as exc:
            return error(400, f"{name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - the answer carries it to the agent
            return error(500, f"{name}: {type(exc).__name__}: {exc}")

    return route
