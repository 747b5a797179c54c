"""An RPC's arguments as a file, where a request body would be too large.

The agent's requests to its engine carry lists that grow with the model's tensor count (a stage
names every tensor with its dtype, shape, offset and Adler-32: about 4 MB at Qwen3-30B-A3B's
18,867 tensors, 16 MB at Kimi-K2's 70,000). HTTP servers cap request bodies (NVIDIA Dynamo's
system server answers 413 past its limit), so a call whose JSON exceeds :data:`BODY_LIMIT`
travels as a file in the replica's shared-memory directory (`replica.stage_arena.shm_dir`: the
agent and its engine run on one host) and the request names only the file:
``collective_rpc("call_from_file", path)``. The caller writes the file (atomically, mode 0600)
and removes it once the engine answered; the engine reads it on every rank. Both ends encode and
decode with msgspec (the same JSON bytes as the standard library's, 5-10x faster: the stage's
call of 18,867 tensors took ~20-90 ms to encode and ~15-100 ms to decode with ``json``).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import msgspec

BODY_LIMIT = 256 * 1024  # bytes of JSON above which a call's arguments travel as a file
PREFIX = "rollouts-rpc-"
_SEQ = itertools.count(1)


def encode(method: str, args: list[Any], kwargs: dict[str, Any]) -> bytes:
    """The call as compact JSON."""
    return msgspec.json.encode({"method": method, "args": args, "kwargs": kwargs})


def write_call(directory: Path, body: bytes) -> Path:
    """Write an :func:`encode`-d call to a fresh file in ``directory``; its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{PREFIX}{os.getpid()}-{next(_SEQ)}.json"
    tmp = path.with_name(path.name + ".part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(body)
    os.replace(tmp, path)
    return path


def read_call(path: str) -> tuple[str, list[Any], dict[str, Any]]:
    """``(method, args, kwargs)`` of a call :func:`write_call` wrote; ValueError for a path that is
    not such a file or a method name that is private."""
    name = os.path.basename(path)
    if not (name.startswith(PREFIX) and name.endswith(".json")):
        raise ValueError(f"refusing RPC file {path!r}: not a {PREFIX}*.json file")
    with open(path, "rb") as f:
        try:
            call = msgspec.json.decode(f.read())
        except msgspec.DecodeError as exc:
            raise ValueError(f"{path}: not a JSON call: {exc}") from None
    if not isinstance(call, dict):
        raise ValueError(f"{path}: not a JSON call object")
    method = call.get("method")
    if not isinstance(method, str) or not method or method.startswith("_") or method == "call_from_file":
        raise ValueError(f"{path}: refusing method {method!r}")
    return method, list(call.get("args") or []), dict(call.get("kwargs") or {})
