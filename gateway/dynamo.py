"""Requests and answers between the gateway and Dynamo's frontend (a dynamo stack's deployments).

Pure functions and one accumulator, called by ``gateway/dynamo_proxy.py`` around each upstream
request: ``upstream_body`` (the planned body as Dynamo takes it: the deployment's Dynamo model
name, ``nvext.extra_fields`` ``engine_data`` and ``worker_id``, the request-plane secret in
``nvext.annotations``, always ``stream: true``), ``explain`` (Dynamo's 400 with its details),
``adopt`` (a Dynamo chunk made into what the gateway reads from a vLLM replica: ``engine_data``
onto the choice, Dynamo's ``nvext`` removed, the client-facing ``model``; returns the replica
that served it), ``served_by`` and ``Assembler`` (a non-streamed answer from the chunks).
Invariant: a vLLM field Dynamo cannot do is a 400 naming it, never dropped silently. The design:
docs/design.md "Dynamo" ("Auth, org scoping and the 400s stay in the gateway").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeVar

from common.dynamo_planes import request_annotation
from gateway.dynamo_fields import dynamo_request
from gateway.nvext import RequestPlan

GATEWAY_EXTRA_FIELDS = ["engine_data", "worker_id"]
R = TypeVar("R")


def explain(message: str, details: Mapping[str, Any]) -> str:
    """Dynamo's 400 message with its ``details`` in words (its message alone is often just
    "Invalid request")."""
    if details.get("type") == "context_length" and "limit" in details and "actual" in details:
        return (
            f"{message}: the prompt's tokens plus max_tokens come to {details['actual']}, more than the "
            f"model's context length {details['limit']}: lower max_tokens or shorten the prompt"
        )
    if not details:
        return message
    return f"{message} ({', '.join(f'{k}: {v}' for k, v in details.items())})"


def upstream_body(plan: RequestPlan, model: str, request_secret: str) -> dict[str, Any]:
    body = dynamo_request(plan.upstream, plan.chat, plan.stream)
    nvext: dict[str, Any] = {
        "extra_fields": list(GATEWAY_EXTRA_FIELDS),
        "annotations": [request_annotation(request_secret)],
    }
    salt = body.pop("cache_salt", None)
    if salt is not None:
        nvext["cache_salt"] = salt
    body.update(model=model, nvext=nvext, stream=True)
    if not plan.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def adopt(chunk: dict[str, Any], workers: Mapping[int, R], model: str) -> R | None:
    nvext = chunk.pop("nvext", None)
    nvext = nvext if isinstance(nvext, dict) else {}
    if "model" in chunk:
        chunk["model"] = model
    engine_data = nvext.get("engine_data")
    choices = chunk.get("choices") or []
    if isinstance(engine_data, dict) and choices and isinstance(choices[0], dict):
        choice = choices[0]
        if "weight_versions" in engine_data:
            choice["weight_versions"] = engine_data["weight_versions"]
        if isinstance(engine_data.get("completion_token_ids"), list):
            choice["token_ids"] = engine_data["completion_token_ids"]
        if isinstance(engine_data.get("routed_experts"), dict):  # {data, shape, start, dtype}
            choice["routed_experts"] = engine_data["routed_experts"]
        # vLLM's places: on each choice of a completion, at the top of a chat answer.
        prompt_at = chunk if str(chunk.get("object", "")).startswith("chat.") else choice
        if isinstance(engine_data.get("prompt_token_ids"), list):
            prompt_at["prompt_token_ids"] = engine_data["prompt_token_ids"]
        if isinstance(engine_data.get("prompt_logprobs"), list):
            prompt_at["prompt_logprobs"] = [_prompt_logprob(p) for p in engine_data["prompt_logprobs"]]
    return _worker(nvext, workers)


def _prompt_logprob(position: Any) -> Any:
    """One prompt position's logprobs as vLLM writes them: ``{token id: {"logprob", "rank",
    "decoded_token"}}`` (Dynamo's worker leaves out what it does not know: null here), or None."""
    if not isinstance(position, dict):
        return None
    return {
        str(token): {"logprob": e.get("logprob"), "rank": e.get("rank"), "decoded_token": e.get("decoded_token")}
        for token, e in position.items()
        if isinstance(e, dict)
    }


def served_by(data: str, workers: Mapping[int, R]) -> R | None:
    """The replica that serves a stream, from one of its SSE payloads (``data``) as Dynamo sent it,
    without changing it: its ``nvext.worker_id``, or None when it does not say."""
    try:
        chunk = json.loads(data)
    except ValueError:
        return None
    nvext = chunk.get("nvext") if isinstance(chunk, dict) else None
    return _worker(nvext, workers) if isinstance(nvext, dict) else None


def _worker(nvext: Mapping[str, Any], workers: Mapping[int, R]) -> R | None:
    worker = nvext.get("worker_id")
    worker = worker.get("decode_worker_id") if isinstance(worker, dict) else None
    try:
        return workers.get(int(worker)) if worker is not None else None
    except (TypeError, ValueError):
        return None


def _extend(into: dict[str, Any], key: str, value: Any) -> None:
    if isinstance(value, list):
        into.setdefault(key, []).extend(value)


class Assembler:
    """Chunks of one streamed answer -> the non-streamed answer (module docstring)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.head: dict[str, Any] = {}
        self.choices: dict[int, dict[str, Any]] = {}
        self.usage: Any = None

    def add(self, chunk: dict[str, Any]) -> None:
        for key in ("id", "created", "model", "system_fingerprint", "prompt_token_ids", "prompt_logprobs"):
            if key in chunk and key not in self.head:
                self.head[key] = chunk[key]
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for part in chunk.get("choices") or []:
            if isinstance(part, dict):
                self._add_choice(part)

    def _add_choice(self, part: dict[str, Any]) -> None:
        index = int(part.get("index") or 0)
        choice = self.choices.get(index)
        if choice is None:
            choice = {"index": index, "logprobs": None, "finish_reason": None}
            choice.update({"message": {"role": "assistant", "content": ""}} if self.chat else {"text": ""})
            self.choices[index] = choice
        logprobs = part.get("logprobs")
        if isinstance(logprobs, dict):
            acc = choice["logprobs"] = choice["logprobs"] or {}
            for key, value in logprobs.items():
                if isinstance(value, list):
                    _extend(acc, key, value)
                else:
                    acc.setdefault(key, value)
        if self.chat:
            delta = part.get("delta") or {}
            message = choice["message"]
            for key, value in delta.items():
                if key == "content" or key == "reasoning_content":
                    if value is not None:
                        message[key] = (message.get(key) or "") + value
                elif value is not None:
                    message[key] = value
        else:
            choice["text"] += part.get("text") or ""
        for key in ("finish_reason", "stop_reason"):
            if part.get(key) is not None:
                choice[key] = part[key]
        for key in ("token_ids", "weight_versions", "prompt_token_ids", "prompt_logprobs", "routed_experts"):
            if key in part:
                choice[key] = part[key]

    def answer(self) -> dict[str, Any]:
        return {
            **self.head,
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": [self.choices[i] for i in sorted(self.choices)],
            "usage": self.usage,
        }
