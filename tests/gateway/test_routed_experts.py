"""`nvext.routed_experts` through the gateway app, end to end but without a GPU: a fake MoE
replica answers as vLLM 0.32 does with ``--enable-return-routed-experts`` (per choice,
``routed_experts`` = base64 of a ``.npy``, only on non-streamed answers). The gateway moves them to
the top-level ``nvext.routed_experts`` in the guide's shape, also on a streamed request (on the
chunk that carries ``finish_reason``)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request

from common.settings import Settings
from contracts.tokens import add_token
from tests.helpers.gateway import gateway_before

PROMPT, COMPLETION, LAYERS, TOP_K = 5, 4, 3, 2
ROUTES = np.arange((PROMPT + COMPLETION - 1) * LAYERS * TOP_K, dtype=np.uint8).reshape(
    PROMPT + COMPLETION - 1, LAYERS, TOP_K
)


def fake_moe_replica() -> FastAPI:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        assert body.get("stream") is False, "routes need a non-streamed upstream request"
        buf = io.BytesIO()
        np.save(buf, ROUTES, allow_pickle=False)
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": "moe",
            "choices": [
                {
                    "index": 0,
                    "text": "abcd",
                    "logprobs": None,
                    "finish_reason": "length",
                    "token_ids": [11, 12, 13, 14] if body.get("return_token_ids") else None,
                    "routed_experts": base64.b64encode(buf.getvalue()).decode(),
                }
            ],
            "usage": {"prompt_tokens": PROMPT, "completion_tokens": COMPLETION, "total_tokens": PROMPT + COMPLETION},
        }

    return app


@pytest.fixture(scope="module")
def moe_gateway(tmp_path_factory):
    home = tmp_path_factory.mktemp("moe")
    settings = Settings.create(home)
    add_token(settings.tokens_file, "tok", "admin", "org", "test")
    with gateway_before(settings, fake_moe_replica(), "moe", "step-1", {"enable-return-routed-experts": ""}) as gateway:
        yield gateway


def decode(routed: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(routed["data"]), dtype=routed["dtype"]).reshape(routed["shape"])


@pytest.mark.parametrize("stream", [False, True])
def test_routed_experts_in_the_guides_shape(moe_gateway, stream):
    body = {
        "model": "moe",
        "prompt": [1, 2, 3, 4, 5],
        "max_tokens": 4,
        "stream": stream,
        "nvext": {"extra_fields": ["routed_experts", "completion_token_ids"]},
    }
    resp = httpx.post(
        f"{moe_gateway.url}/v1/completions", json=body, headers={"Authorization": "Bearer tok"}, timeout=30
    )
    assert resp.status_code == 200, resp.text
    if stream:
        events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        final = [json.loads(e) for e in events[:-1] if json.loads(e)["choices"]][-1]
        assert final["choices"][0]["finish_reason"] == "length" and final["choices"][0]["text"] == "abcd"
        nvext = final["nvext"]
    else:
        data = resp.json()
        assert "routed_experts" not in data["choices"][0] and "token_ids" not in data["choices"][0]
        nvext = data["nvext"]
    routed = nvext["routed_experts"]
    assert (
        routed["shape"] == [PROMPT + COMPLETION - 1, LAYERS, TOP_K]
        and routed["start"] == 0
        and routed["dtype"] == "uint8"
    )
    assert np.array_equal(decode(routed), ROUTES)
    assert nvext["completion_token_ids"] == [11, 12, 13, 14]
