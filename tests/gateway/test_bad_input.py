"""Malformed requests through the gateway app (in this process, in front of a fake replica that
records what reaches it): each shape is a 400 ``invalid_argument`` naming the problem (a body
over the cap: 413 ``payload_too_large``), in the API's error shape, that reaches no replica and leaves the keep-alive
connection usable; a viewer token may list models but not run inference; a replica's own 400 keeps its message in our
shape. The same on the real stack: ``test_bad_input_stack.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from common.settings import Settings
from contracts.tokens import add_token
from gateway.body import MAX_BODY_BYTES
from tests.helpers.gateway import Connection, LocalGateway, gateway_before

ADMIN, VIEWER = "admin-tok", "viewer-tok"
GOOD = {"model": "m", "prompt": [1, 2], "max_tokens": 1}


def fake_replica(seen: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if body.get("prompt") == "vllm-refuses":
            return JSONResponse(
                {
                    "error": {
                        "message": "temperature must be non-negative",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
                status_code=400,
            )
        return {
            "id": "c",
            "object": "text_completion",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        }

    return app


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Iterator[tuple[LocalGateway, list[dict]]]:
    home = tmp_path_factory.mktemp("bad-input")
    settings = Settings.create(home)
    add_token(settings.tokens_file, ADMIN, "admin", "org", "admin")
    add_token(settings.tokens_file, VIEWER, "viewer", "org", "viewer")
    seen: list[dict] = []
    with gateway_before(settings, fake_replica(seen), "m", "initial") as gateway:
        yield gateway, seen


def refused(status_body: tuple[int, dict], status: int, code: str, message: str) -> None:
    """The API's error shape (``code``, empty ``details`` and OpenAI's ``error``) with ``status``,
    ``code`` and a message that contains ``message``."""
    got, body = status_body
    assert got == status, body
    assert body["code"] == code and body["details"] == [], body
    assert body["error"] == {"message": body["message"], "type": code, "code": code}
    assert message in body["message"], body["message"]


def invalid(status_body: tuple[int, dict], message: str) -> None:
    refused(status_body, 400, "invalid_argument", message)


def too_large(status_body: tuple[int, dict], message: str) -> None:
    """HTTP's own answer to a body over the cap: 413 ``payload_too_large``, in both shapes."""
    refused(status_body, 413, "payload_too_large", message)


def chunks(total: int, size: int = 1 << 20) -> Iterator[bytes]:
    yield b'{"prompt": "'
    sent = 12
    while sent < total:
        yield b"a" * size
        sent += size
    yield b'"}'


BAD = [
    (b"[" * 1000, "nests arrays/objects more than 64 levels deep"),
    (b'{"model": "m", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", "more than 64 levels deep"),
    (b'{"model": "m", "prompt": "\xff\xfe"}', "not UTF-8: byte 0xff at offset 26"),
    ('{"model": "m"}'.encode("utf-16"), "not UTF-8"),
    (b'{"model": "m", "prompt": [1, 2', "not JSON: Expecting ',' delimiter at offset 30"),
    (b'{"model": "m", "temperature": NaN}', "NaN is not a JSON number"),
    (b"[1, 2]", "must be a JSON object, got an array"),
    (b'"hello"', "must be a JSON object, got a string"),
    (b"", "request body is empty"),
    (json.dumps({"model": ["m"], "prompt": "x"}).encode(), "model must be a string"),
    (json.dumps({**GOOD, "n": 1000}).encode(), "n: at most 64 choices per request, got 1000"),
    (json.dumps({**GOOD, "n": "2"}).encode(), "n must be a positive integer"),
    (json.dumps({**GOOD, "stream": "yes"}).encode(), "stream must be true or false"),
    (json.dumps({**GOOD, "prompt": [[1]] * 65}).encode(), "a batch of 65 prompts with n=1 asks for 65 sequences"),
    (json.dumps({**GOOD, "nvext": []}).encode(), "nvext must be a JSON object"),
]


def test_every_malformed_body_is_a_400_on_a_connection_that_stays_usable(local):
    gateway, seen = local
    before = len(seen)
    with Connection(gateway.url, ADMIN) as conn:
        for raw, message in BAD:
            for path in ("/v1/completions", "/v1/chat/completions"):
                if "batch" in message and "chat" in path:
                    continue  # a chat request has no prompt batch
                invalid(conn.post(path, raw), message)
        assert len(seen) == before, "a refused body reached the replica"
        status, body = conn.post("/v1/completions", GOOD)
        assert status == 200 and body["choices"][0]["text"] == "x"
        assert len(seen) == before + 1


def test_a_body_over_the_cap_is_refused_with_or_without_a_length(local):
    gateway, seen = local
    before = len(seen)
    with Connection(gateway.url, ADMIN) as conn:
        big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
        too_large(
            conn.post("/v1/completions", big),
            f"request body is {len(big)} bytes; the gateway accepts at most {MAX_BODY_BYTES} bytes (8 MiB)",
        )
        too_large(
            conn.post("/v1/completions", chunks(MAX_BODY_BYTES + 1), encode_chunked=True),
            "request body is larger; the gateway accepts at most",
        )
        assert len(seen) == before
        assert conn.post("/v1/completions", GOOD)[0] == 200
        # Just under the cap (chunked) is read whole and reaches the replica.
        status, _ = conn.post("/v1/completions", chunks(MAX_BODY_BYTES - (2 << 20)), encode_chunked=True)
        assert status == 200 and len(seen[-1]["prompt"]) >= MAX_BODY_BYTES - (3 << 20)


def test_a_viewer_lists_models_but_does_not_run_inference(local):
    gateway, seen = local
    before = len(seen)
    with Connection(gateway.url, ADMIN) as conn:
        for path in ("/v1/completions", "/v1/chat/completions"):
            status, body = conn.post(path, GOOD, token=VIEWER)
            assert status == 403 and body["code"] == "permission_denied", body
            assert body["message"] == "running inference needs the Inference Admin role; this token has role 'viewer'"
            assert body["error"]["code"] == "permission_denied"
        status, body = conn.post("/v1/completions", GOOD, token="nope")
        assert status == 401 and body["code"] == "unauthenticated"
        assert len(seen) == before
        status, body = conn.request("GET", "/v1/models", token=VIEWER)
        assert status == 200 and [m["id"] for m in body["data"]] == ["m"]


def test_a_replicas_400_keeps_its_message_in_our_shape(local):
    gateway, _ = local
    with Connection(gateway.url, ADMIN) as conn:
        invalid(conn.post("/v1/completions", {**GOOD, "prompt": "vllm-refuses"}), "temperature must be non-negative")
        assert conn.post("/v1/completions", GOOD)[0] == 200


def test_unknown_model_and_no_traffic_use_the_same_shape(local):
    gateway, _ = local
    with Connection(gateway.url, ADMIN) as conn:
        status, body = conn.post("/v1/completions", {**GOOD, "model": "nope"})
        assert (
            status == 404 and body["code"] == "not_found" and body["message"].startswith("model 'nope' is not served")
        )


def test_a_deployment_addressed_by_its_id_reaches_its_replicas_under_its_model_name(local):
    gateway, seen = local
    with Connection(gateway.url, ADMIN) as conn:
        status, body = conn.post("/v1/completions", {**GOOD, "model": "dep"})  # the deployment's id
    assert status == 200, body
    assert seen[-1]["model"] == "m"  # what its vLLM replicas serve
