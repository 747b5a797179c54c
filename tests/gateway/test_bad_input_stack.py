"""Bad input at the stack's real gateway, in front of the shared 2-replica deployment: a
1,000-deep JSON array, ``n`` over the cap and a viewer's inference request are refused in the
API's error shape, reach no replica, and the same keep-alive connection then gets a real
completion; vLLM's own 400 keeps its message in that shape, so a field of the wrong type is a
400 ``invalid_argument`` whichever of the two checks it."""

from __future__ import annotations

import pytest

from tests.helpers.gateway import Connection, random_prompt

pytestmark = pytest.mark.stack


def refused(answer: tuple[int, dict], status: int, code: str, message: str) -> None:
    got, body = answer
    assert got == status and body["code"] == code and body["details"] == [], body
    assert body["error"]["code"] == code and body["error"]["message"] == body["message"], body
    assert message in body["message"], body["message"]


def test_nested_json_n_over_the_cap_and_a_viewer_then_the_connection_still_serves(gw):
    replicas = {"x-rollouts-replica"}
    with Connection(gw.url, gw.settings.admin_token) as conn:
        for path in ("/v1/completions", "/v1/chat/completions"):
            refused(
                conn.post(path, b"[" * 1000 + b"]" * 1000),
                400,
                "invalid_argument",
                "request body nests arrays/objects more than 64 levels deep",
            )
            refused(
                conn.post(path, b'{"model": "' + gw.model.encode() + b'", "prompt": ' + b"[" * 1000),
                400,
                "invalid_argument",
                "more than 64 levels deep",
            )
        refused(
            conn.post("/v1/completions", {"model": gw.model, "prompt": [1, 2], "n": 1000, "max_tokens": 1}),
            400,
            "invalid_argument",
            "n: at most 64 choices per request, got 1000",
        )
        refused(
            conn.post(
                "/v1/chat/completions", {"model": gw.model, "messages": [{"role": "user", "content": "x"}], "n": 65}
            ),
            400,
            "invalid_argument",
            "n: at most 64 choices per request, got 65",
        )
        refused(
            conn.post(
                "/v1/completions",
                {"model": gw.model, "prompt": [1, 2], "max_tokens": 1},
                token=gw.settings.viewer_token,
            ),
            403,
            "permission_denied",
            "running inference needs the Inference Admin role; this token has role 'viewer'",
        )
        status, models = conn.request("GET", "/v1/models", token=gw.settings.viewer_token)
        assert status == 200 and gw.model in [m["id"] for m in models["data"]]
        # vLLM's own validation (a context window the tiny model does not have), in our shape.
        refused(
            conn.post("/v1/completions", {"model": gw.model, "prompt": [1, 2], "max_tokens": 100000}),
            400,
            "invalid_argument",
            "max_tokens",
        )
        status, body = conn.post(
            "/v1/completions",
            {"model": gw.model, "prompt": random_prompt(6), "max_tokens": 2, "ignore_eos": True, "n": 64},
        )  # the cap itself is served
        assert status == 200 and body["usage"]["completion_tokens"] == 128, body
        assert conn.headers.keys() >= replicas


WRONG_TYPES = [
    ("/v1/completions", {"prompt": {"text": "x"}}),
    ("/v1/completions", {"prompt": [1, "two", 3]}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "ten"}),
    ("/v1/completions", {"prompt": [1, 2], "temperature": "hot"}),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": "yes"}),
    ("/v1/completions", {"prompt": [1, 2], "seed": 1.5}),
    ("/v1/completions", {"prompt": [1, 2], "stop": 5}),
    ("/v1/completions", {"prompt": [1, 2], "stop_token_ids": ["a"]}),
    ("/v1/completions", {"prompt": [1, 2], "n": -1}),
    ("/v1/completions", {"prompt": [1, 2], "stream": True, "stream_options": "usage"}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": 5, "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": "two"}),
]


def test_wrong_field_types_are_400s_from_the_gateway_or_vllm_in_one_shape(gw):
    with Connection(gw.url, gw.settings.admin_token) as conn:
        for path, fields in WRONG_TYPES:
            status, body = conn.post(path, {"model": gw.model, "max_tokens": 1, **fields})
            assert status == 400 and body["code"] == body["error"]["code"] == "invalid_argument", (fields, body)
            assert body["message"], (fields, body)
        status, _ = conn.post("/v1/completions", {"model": gw.model, "prompt": [1, 2], "max_tokens": 1})
        assert status == 200
