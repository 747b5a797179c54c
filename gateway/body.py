"""Reading a client's request body: bounded in size, UTF-8, JSON, an object, not deeply nested.

``await read_json_object(request)`` returns the body as a dict, or raises ``PayloadTooLarge``
(413) past ``MAX_BODY_BYTES`` (from ``Content-Length`` before reading, or as soon as a chunked
body grows past it), or ``InvalidArgument`` (400) naming the problem: empty, not UTF-8 (with the
offset), not JSON (or ``NaN``/``Infinity``), nested over ``MAX_JSON_DEPTH``, not an object.
Invariants: a refused body reaches no replica; the unread rest is discarded, so the client's
keep-alive connection stays usable.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from fastapi import Request

from contracts.errors import InvalidArgument, PayloadTooLarge

MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64

_JSON_TYPE = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def _too_large(size: int | None) -> NoReturn:
    what = f"{size} bytes" if size is not None else "larger"
    raise PayloadTooLarge(
        f"request body is {what}; the gateway accepts at most {MAX_BODY_BYTES} bytes ({MAX_BODY_BYTES >> 20} MiB)"
    )


async def read_body(request: Request) -> bytes:
    """The raw body, at most ``MAX_BODY_BYTES``."""
    length = request.headers.get("content-length")
    if length is not None and length.strip().isdigit() and int(length) > MAX_BODY_BYTES:
        _too_large(int(length))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            _too_large(None)
        chunks.append(chunk)
    return b"".join(chunks)


def _refuse_constant(name: str) -> NoReturn:
    raise InvalidArgument(f"request body is not JSON: {name} is not a JSON number")


def json_depth(value: Any) -> int:
    """How many arrays/objects deep ``value`` nests (a scalar is 0); iterative, no recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object (see the module docstring for what is refused)."""
    if not raw.strip():
        raise InvalidArgument("request body is empty; expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"request body is not UTF-8: byte 0x{raw[exc.start]:02x} at offset {exc.start} ({exc.reason})"
        ) from None
    too_deep = f"request body nests arrays/objects more than {MAX_JSON_DEPTH} levels deep"
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise InvalidArgument(too_deep) from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"request body is not JSON: {exc.msg} at offset {exc.pos}") from None
    except ValueError as exc:  # e.g. an integer longer than Python's digit limit
        raise InvalidArgument(f"request body is not JSON: {exc}") from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise InvalidArgument(too_deep)
    if not isinstance(value, dict):
        raise InvalidArgument(f"request body must be a JSON object, got {_JSON_TYPE.get(type(value), 'a value')}")
    return value


async def read_json_object(request: Request) -> dict[str, Any]:
    return parse_json_object(await read_body(request))
