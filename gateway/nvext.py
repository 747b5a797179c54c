"""Request and response translation between the guide's OpenAI + ``nvext`` dialect and vLLM.

Pure functions, no I/O (``gateway/proxy.py`` and ``gateway/relay.py`` call them around each
upstream request). ``plan_request`` validates a client body and returns a ``RequestPlan`` (the
body to send, what to add to the answer) or raises ``RequestError`` (400 ``invalid_argument``)
naming the field; fields it does not own pass through for vLLM to validate. ``finish_choice`` /
``finish_chunk`` add chat ``logprobs.content[].token_id``, drop what the plan asked vLLM for that
the client did not, and take each choice's ``weight_versions`` and ``routed_experts`` off it into
the plan. Invariant: ``version_spans`` returns spans that tile every choice's completion tokens,
or None (never a guess). The rules and the replica's span shape: docs/design.md "The gateway".
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Keys the hosted frontend documents for nvext that this gateway implements.
SUPPORTED_NVEXT = ("cache_salt", "extra_fields")
# extra_fields values: Dynamo's response extensions, plus ours (weight_versions is always sent;
# naming it is accepted so a client can be explicit).
SUPPORTED_EXTRA_FIELDS = ("completion_token_ids", "routed_experts", "timing", "weight_versions", "worker_id")
ROUTED_EXPERTS_CONFIG_KEY = "enable-return-routed-experts"
# The hosted frontend refuses more (cwtrain's rollout client checks the same limits).
MAX_STOP_STRINGS = 4
MAX_STOP_TOKEN_IDS = 4
# Sequences one request may ask for: ``n`` (and ``best_of``), times the prompts of a completions
# batch. One request must not multiply a replica's load without bound, and a GRPO group (cwtrain
# sends one as one request with ``n`` = the group size; 64 is the largest in common recipes) fits.
MAX_N = 64
# vLLM's rules for a cache salt.
MAX_CACHE_SALT = 128
_SALT_FORBIDDEN = frozenset("@/\\\0")


class RequestError(ValueError):
    """A request the gateway refuses before it reaches a replica (HTTP 400)."""


@dataclass
class RequestPlan:
    """What to send upstream and how to finish the answer."""

    upstream: dict[str, Any]
    chat: bool
    stream: bool
    n: int
    extra_fields: frozenset[str] = frozenset()
    # True when the client itself asked for vLLM's token ids (else we strip the ones we asked for).
    client_token_ids: bool = False
    # Chat with logprobs: fill content[].token_id from the token ids.
    fill_token_id: bool = False
    routed_experts_start: int = 0
    # Per choice index: the sampled token ids seen so far (streams accumulate them).
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    # echo puts the prompt's ids in front of the completion's: they are not completion tokens.
    echo: bool = False
    # Per choice index seen in the answer: the replica's weight_versions for it (None: absent).
    weight_versions: dict[int, Any] = field(default_factory=dict)
    # Per choice index: the engine's routed_experts for it, taken off the choice (for nvext).
    routed_experts: dict[int, Any] = field(default_factory=dict)


def _count(body: dict[str, Any], key: str) -> int:
    """``body[key]`` as a positive integer (1 when absent or null)."""
    value = body.get(key)
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RequestError(f"{key} must be a positive integer")
    return value


def _prompt_count(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds: a batch is a list of strings or of
    token-id lists; anything else counts as one (vLLM validates its shape)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt)
    return 1


def _stop_count(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        return 1
    if isinstance(value, list):
        return len(value)
    raise RequestError("stop must be a string or a list of strings")


def _take_nvext(body: dict[str, Any]) -> dict[str, Any]:
    """``body``'s ``nvext`` object, taken off it ({} when absent); only supported fields."""
    nvext = body.pop("nvext", None)
    if nvext is None:
        nvext = {}
    if not isinstance(nvext, dict):
        raise RequestError("nvext must be a JSON object")
    unknown = sorted(set(nvext) - set(SUPPORTED_NVEXT))
    if unknown:
        raise RequestError(
            f"nvext: unsupported field(s) {', '.join(unknown)}; this gateway supports {', '.join(SUPPORTED_NVEXT)}"
        )
    return nvext


def _choice_count(body: dict[str, Any], chat: bool) -> int:
    """``n``, after checking that n, best_of and a completions prompt batch ask for at most
    ``MAX_N`` sequences."""
    n = _count(body, "n")
    if n > MAX_N:
        raise RequestError(f"n: at most {MAX_N} choices per request, got {n}")
    best_of = _count(body, "best_of")
    if best_of > MAX_N:
        raise RequestError(f"best_of: at most {MAX_N} per request, got {best_of}")
    prompts = _prompt_count(body.get("prompt")) if not chat else 1
    if prompts * max(n, best_of) > MAX_N:
        raise RequestError(
            f"prompt: a batch of {prompts} prompts with n={max(n, best_of)} asks for {prompts * max(n, best_of)} "
            f"sequences; at most {MAX_N} per request"
        )
    return n


def _check_stream_and_stops(body: dict[str, Any]) -> None:
    """``stream`` a boolean; at most ``MAX_STOP_STRINGS`` stop strings and ``MAX_STOP_TOKEN_IDS`` ids."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError("stream must be true or false")
    if _stop_count(body.get("stop")) > MAX_STOP_STRINGS:
        raise RequestError(f"stop: at most {MAX_STOP_STRINGS} stop strings per request")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or len(stop_ids) > MAX_STOP_TOKEN_IDS):
        raise RequestError(f"stop_token_ids: a list of at most {MAX_STOP_TOKEN_IDS} token ids")


def _move_cache_salt(nvext: dict[str, Any], body: dict[str, Any]) -> None:
    """``nvext.cache_salt``, checked, becomes the upstream body's ``cache_salt``."""
    if "cache_salt" in nvext:
        salt = nvext["cache_salt"]
        if not isinstance(salt, str) or not salt:
            raise RequestError("nvext.cache_salt must be a non-empty string")
        if len(salt) > MAX_CACHE_SALT or _SALT_FORBIDDEN.intersection(salt):
            raise RequestError(f"nvext.cache_salt: at most {MAX_CACHE_SALT} characters and none of @ / \\ or NUL")
        body["cache_salt"] = salt


def _extra_fields(nvext: dict[str, Any], n: int, engine_config: dict[str, str] | None) -> frozenset[str]:
    """``nvext.extra_fields``: supported values only; the per-token ones need n=1, and
    routed_experts a deployment that captures routing."""
    extra = nvext.get("extra_fields", [])
    if extra is None:
        extra = []
    if not isinstance(extra, list) or not all(isinstance(x, str) for x in extra):
        raise RequestError("nvext.extra_fields must be a list of strings")
    bad = sorted(set(extra) - set(SUPPORTED_EXTRA_FIELDS))
    if bad:
        raise RequestError(
            f"nvext.extra_fields: unsupported value(s) {', '.join(bad)}; supported: {', '.join(SUPPORTED_EXTRA_FIELDS)}"
        )
    extra_fields = frozenset(extra)
    if "completion_token_ids" in extra_fields and n != 1:
        raise RequestError(f"nvext.extra_fields completion_token_ids requires one choice per request (n=1), got n={n}")
    if "routed_experts" in extra_fields:
        if ROUTED_EXPERTS_CONFIG_KEY not in (engine_config or {}):
            raise RequestError(
                "nvext.extra_fields routed_experts: this deployment does not capture routing; add "
                f'"{ROUTED_EXPERTS_CONFIG_KEY}": "" to runtime.engineConfig (an MoE model)'
            )
        if n != 1:
            raise RequestError(f"nvext.extra_fields routed_experts requires one choice per request (n=1), got n={n}")
    return extra_fields


def plan_request(body: dict[str, Any], path: str, engine_config: dict[str, str] | None = None) -> RequestPlan:
    """Validate ``body`` (a client's JSON object) for ``path`` and plan the upstream request."""
    body = dict(body)
    chat = path.endswith("/chat/completions")
    nvext = _take_nvext(body)
    n = _choice_count(body, chat)
    _check_stream_and_stops(body)
    _move_cache_salt(nvext, body)
    extra_fields = _extra_fields(nvext, n, engine_config)

    client_token_ids = bool(body.get("return_token_ids"))
    fill_token_id = chat and bool(body.get("logprobs"))
    if fill_token_id or "completion_token_ids" in extra_fields:
        body["return_token_ids"] = True
    start = body.get("routed_experts_prompt_start", 0) or 0
    return RequestPlan(
        upstream=body,
        chat=chat,
        stream=bool(body.get("stream")),
        n=n,
        extra_fields=extra_fields,
        client_token_ids=client_token_ids,
        fill_token_id=fill_token_id,
        routed_experts_start=int(start) if isinstance(start, int) else 0,
        echo=bool(body.get("echo")),
    )


def _fill_token_ids(plan: RequestPlan, choice: dict[str, Any]) -> None:
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        plan.token_ids.setdefault(int(choice.get("index", 0)), []).extend(int(t) for t in ids)
    if plan.fill_token_id:
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if isinstance(content, list) and isinstance(ids, list) and len(ids) == len(content):
            for entry, token_id in zip(content, ids):
                if isinstance(entry, dict):
                    entry["token_id"] = int(token_id)
        elif isinstance(content, list):
            # vLLM reports one content entry per sampled token; fall back to "token_id:N" strings.
            for entry in content:
                token = entry.get("token") if isinstance(entry, dict) else None
                if isinstance(token, str) and token.startswith("token_id:"):
                    try:
                        entry["token_id"] = int(token[len("token_id:") :])
                    except ValueError:
                        pass
    if not plan.client_token_ids:
        choice.pop("token_ids", None)


def _take_weight_versions(plan: RequestPlan, choice: dict[str, Any], final: bool) -> None:
    index = int(choice.get("index", 0))
    spans = choice.pop("weight_versions", None)  # moved to nvext.weight_versions.spans
    if spans is not None or final:
        plan.weight_versions[index] = spans
    else:
        plan.weight_versions.setdefault(index, None)


def _take_routed_experts(plan: RequestPlan, choice: dict[str, Any]) -> None:
    routes = choice.pop("routed_experts", None)  # moved to nvext.routed_experts (guide's shape)
    if routes is not None:
        plan.routed_experts[int(choice.get("index", 0))] = routes


def _trim_top_logprobs(plan: RequestPlan, choice: dict[str, Any]) -> None:
    """A chat choice's ``top_logprobs`` hold the ``top_logprobs`` asked for, as vLLM's chat server
    gives them: the first k of the engine's list (the sampled token, then the most likely), where
    Dynamo's frontend passes the whole list (one more entry when the sampled token is not among
    the k most likely)."""
    k = plan.upstream.get("top_logprobs")
    content = (choice.get("logprobs") or {}).get("content") if plan.chat else None
    if not isinstance(k, int) or isinstance(k, bool) or not isinstance(content, list):
        return
    for entry in content:
        if isinstance(entry, dict) and isinstance(entry.get("top_logprobs"), list):
            entry["top_logprobs"] = entry["top_logprobs"][:k]


def finish_choice(plan: RequestPlan, choice: dict[str, Any]) -> dict[str, Any]:
    """A non-streamed choice as the client expects it; remembers its token ids in ``plan``."""
    _trim_top_logprobs(plan, choice)
    _fill_token_ids(plan, choice)
    _take_weight_versions(plan, choice, final=True)
    _take_routed_experts(plan, choice)
    return choice


def finish_chunk(plan: RequestPlan, chunk: dict[str, Any]) -> dict[str, Any]:
    """One streamed chunk as the client expects it; accumulates token ids in ``plan``."""
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict):
            _trim_top_logprobs(plan, choice)
            _fill_token_ids(plan, choice)
            _take_weight_versions(plan, choice, final=choice.get("finish_reason") is not None)
            _take_routed_experts(plan, choice)
    strip_prompt_ids(plan, chunk)
    return chunk


def version_spans(plan: RequestPlan) -> list[dict[str, Any]] | None:
    """The replica's per-token weight versions of a finished answer, as
    ``[{"choice", "identity", "start", "end"}, ...]`` (by choice, then in generation order), or
    None unless every choice carried them and each choice's spans tile ``[0, its token count)``
    without gaps (the count checked against the token ids when the answer had them)."""
    if not plan.weight_versions:
        return None
    out: list[dict[str, Any]] = []
    for index in sorted(plan.weight_versions):
        spans = plan.weight_versions[index]
        if not isinstance(spans, list):
            return None
        end = 0
        for span in spans:
            if not isinstance(span, dict):
                return None
            version, start, stop = span.get("version"), span.get("start"), span.get("end")
            if not isinstance(version, str) or type(start) is not int or type(stop) is not int:
                return None
            if start != end or stop <= start:
                return None
            out.append({"choice": index, "identity": version, "start": end, "end": stop})
            end = stop
        ids = plan.token_ids.get(index)
        if ids is not None and not plan.echo and len(ids) != end:
            return None
    return out


def strip_prompt_ids(plan: RequestPlan, response: dict[str, Any]) -> None:
    """vLLM's ``return_token_ids`` also adds the prompt's ids; drop them unless asked for."""
    if plan.client_token_ids:
        return
    response.pop("prompt_token_ids", None)
    for choice in response.get("choices") or []:
        if isinstance(choice, dict):
            choice.pop("prompt_token_ids", None)


def translate_routed_experts(value: Any, start: int = 0) -> dict[str, Any]:
    """vLLM's ``routed_experts`` (base64 ``.npy``, ``[prompt + completion - 1, layers, top_k]``) as the
    guide's ``{data, shape, dtype, start}``; a wider integer type is narrowed by value (every expert
    id fits), and ``start`` is vLLM's ``routed_experts_prompt_start``.
    """
    if isinstance(value, dict) and {"data", "shape", "dtype"} <= set(value):
        return {**value, "start": value.get("start", start)}  # already in the guide's shape
    if not isinstance(value, str):
        raise ValueError(f"routed_experts: expected base64 of a .npy array, got {type(value).__name__}")
    array = np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)
    if array.ndim != 3:
        raise ValueError(f"routed_experts: expected [tokens, layers, top_k], got shape {list(array.shape)}")
    if array.dtype not in (np.uint8, np.uint16):
        if array.dtype.kind not in "iu":
            raise ValueError(f"routed_experts: expert ids must be integers, got {array.dtype}")
        top = int(array.max()) if array.size else 0
        if int(array.min() if array.size else 0) < 0 or top > np.iinfo(np.uint16).max:
            raise ValueError("routed_experts: expert ids out of range for uint16")
        array = array.astype(np.uint8 if top < 256 else np.uint16)
    array = np.ascontiguousarray(array)
    return {
        "data": base64.b64encode(array.tobytes(order="C")).decode("ascii"),
        "shape": [int(d) for d in array.shape],
        "start": int(start),
        "dtype": str(array.dtype),
    }
