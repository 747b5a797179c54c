"""Server-sent events as the gateway reads and writes them (pure, no state).

- ``sse(obj)``: one SSE event ``data: <compact JSON>`` followed by a blank line, as bytes.
- ``sse_events(resp)``: the ``data`` payloads of an upstream ``httpx`` SSE stream, one string per
  event (an event's ``data:`` lines joined by newlines; a last event without its blank line still
  counts); errors reading the stream propagate.
- ``has_tokens(chunk)``: whether a stream chunk carries generated tokens (text, delta content,
  token ids or logprobs on some choice), for the gateway's ``timing``.
- ``as_chunks(data, chat)``: a non-streamed answer replayed as stream chunks: one per choice
  (a chat choice's ``message`` as its ``delta``, null fields dropped), then one with ``usage``
  if the answer has it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx


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


def has_tokens(chunk: dict[str, Any]) -> bool:
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or choice.get("token_ids") or (choice.get("logprobs") or None):
            return True
    return False


def as_chunks(data: dict[str, Any], chat: bool) -> list[dict[str, Any]]:
    """A non-streamed answer replayed as stream chunks: one per choice, then usage if present."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head: dict[str, Any] = {k: data[k] for k in ("id", "created", "model") if k in data}
    chunks: list[dict[str, Any]] = []
    for choice in data.get("choices") or []:
        c = {k: v for k, v in choice.items() if k not in ("message",)}
        if chat:
            message = choice.get("message") or {}
            c["delta"] = {k: v for k, v in message.items() if v is not None}
        chunks.append({**head, "object": kind, "choices": [c]})
    if data.get("usage") is not None:
        chunks.append({**head, "object": kind, "choices": [], "usage": data["usage"]})
    return chunks
