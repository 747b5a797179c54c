"""The answer side of an inference request, shared by the vLLM path (``gateway/proxy.py``) and the
Dynamo path (``gateway/dynamo_proxy.py``).

``finish_answer(plan, data)`` finishes a non-streamed answer in place; ``Relay.response_nvext``
builds an answer's top-level ``nvext`` (``weight_versions`` always, the rest when named in
``nvext.extra_fields``: docs/design.md "The gateway"); ``Relay.stream`` relays an upstream SSE
stream whose first event has arrived. Invariants of a stream: ``nvext`` goes on the last chunk
with a ``finish_reason`` (held back until the next event shows it is last); a break (an
``httpx.HTTPError``, or no ``[DONE]``) ends with an SSE error event (503 ``unavailable``) and no
``[DONE]``, never a silent truncation; however it ends, the upstream response is closed and the
replica's in-flight count released.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from contracts.errors import Unavailable
from gateway.attempt import Attempt, Served
from gateway.nvext import (
    RequestPlan,
    finish_choice,
    finish_chunk,
    strip_prompt_ids,
    translate_routed_experts,
    version_spans,
)
from gateway.routing import ReplicaView, Router, weight_versions
from gateway.sse import has_tokens, sse

log = logging.getLogger("rollouts.gateway")


class StreamBroken(Exception):
    """The upstream stream ended without vLLM's ``[DONE]``."""


def finish_answer(plan: RequestPlan, data: dict[str, Any]) -> None:
    for choice in data.get("choices") or []:
        if isinstance(choice, dict):
            finish_choice(plan, choice)
    strip_prompt_ids(plan, data)


class Relay:
    def __init__(self, router: Router) -> None:
        self.router = router

    async def response_nvext(self, attempt: Attempt, replica: ReplicaView) -> dict[str, Any]:
        """The ``nvext`` object of an answer that has finished (reads a fresh view: see routing)."""
        plan = attempt.plan
        out: dict[str, Any] = {}
        extra = plan.extra_fields
        if "worker_id" in extra:
            out["worker_id"] = {"prefill_worker_id": replica.name, "decode_worker_id": replica.name}
        if "completion_token_ids" in extra:
            out["completion_token_ids"] = list(plan.token_ids.get(0, []))
        if "routed_experts" in extra:
            value = plan.routed_experts.get(0)
            out["routed_experts"] = (
                None if value is None else translate_routed_experts(value, plan.routed_experts_start)
            )
        spans = version_spans(plan)
        if spans:  # the engine's own record: no need to read Temporal
            out["weight_versions"] = weight_versions(None, None, 0, 0, replica.name, spans)
        else:
            after_view = await self.router.fresh_view(attempt.view.workflow_id)
            after = after_view.replica(replica.name) if after_view is not None else None
            out["weight_versions"] = weight_versions(
                attempt.view.replica(replica.name),
                after,
                attempt.view.epoch,
                after_view.epoch if after_view is not None else attempt.view.epoch,
                replica.name,
                spans,
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
                    timing["itl_ms"] = round(
                        (attempt.last_token - attempt.first_token) * 1000 / (attempt.token_events - 1), 3
                    )
            out["timing"] = timing
        return out

    async def stream(
        self,
        attempt: Attempt,
        served: Served,
        upstream: httpx.Response,
        first: str,
        events: AsyncIterator[str],
        adapt: Callable[[dict[str, Any]], None] | None = None,
    ) -> AsyncIterator[bytes]:
        """Relay an SSE stream; nvext goes on the last chunk that carries a finish_reason.
        ``adapt`` (a dynamo deployment's) turns each chunk into a vLLM replica's first."""
        plan = attempt.plan
        held: dict[str, Any] | None = None  # a finish chunk, until we know whether it is the last

        async def with_nvext(chunk: dict[str, Any]) -> bytes:
            chunk["nvext"] = {**(chunk.get("nvext") or {}), **(await self.response_nvext(attempt, served.replica))}
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
                if has_tokens(chunk):
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
            yield sse(
                {
                    "error": {
                        "message": f"replica {served.replica.name} stream broke: {exc!r}; the answer is incomplete",
                        "type": Unavailable.code,
                        "code": 503,
                    }
                }
            )
        finally:
            await upstream.aclose()
            self.router.release(served.url)
