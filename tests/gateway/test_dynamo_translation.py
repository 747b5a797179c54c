"""Unit tests: what the gateway sends Dynamo's frontend and how it reads the answers
(gateway/dynamo.py), the worker side's routes and span stamping with stand-in engines
(replica/engine/dynamo_routes.py), and the names a dynamo deployment's workers use. The real
thing runs in tests/gateway/, tests/e2e/ and tests/replica/test_dynamo_worker.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from contracts.names import dynamo_model, dynamo_namespace
from gateway import dynamo
from gateway.nvext import (
    RequestError,
    finish_choice,
    finish_chunk,
    plan_request,
    translate_routed_experts,
    version_spans,
)
from replica.engine.dynamo_routes import (
    REFUSED,
    GuardedRuntime,
    SpanRecorder,
    carries_secret,
    control_routes,
    is_canary,
)


def test_upstream_body_streams_asks_for_engine_data_moves_the_salt_and_carries_the_secret():
    # A client names no annotation of its own (a 400 naming the field): the secret's is the only one.
    with pytest.raises(RequestError, match="nvext: unsupported field.s. annotations"):
        plan_request({"model": "m", "prompt": [1], "nvext": {"annotations": ["x"]}}, "/v1/completions")
    plan = plan_request(
        {
            "model": "m",
            "prompt": [1, 2],
            "n": 2,
            "logprobs": 1,
            "nvext": {"cache_salt": "s1", "extra_fields": ["timing"]},
        },
        "/v1/completions",
    )
    body = dynamo.upstream_body(plan, "deployments/org/x", "s3cret")
    assert body["model"] == "deployments/org/x" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["nvext"] == {
        "extra_fields": ["engine_data", "worker_id"],
        "cache_salt": "s1",
        "annotations": ["rollouts-request-secret:s3cret"],
    }
    assert "cache_salt" not in body and "return_token_ids" not in body
    chat = plan_request(
        {"model": "m", "messages": [], "logprobs": True, "stream": True, "stream_options": {"include_usage": False}},
        "/v1/chat/completions",
    )
    body = dynamo.upstream_body(chat, "d", "s")
    assert "return_token_ids" not in body and body["stream_options"] == {"include_usage": False}
    # Dynamo refuses return_token_ids: the gateway answers it from engine_data instead.
    asked = plan_request({"model": "m", "prompt": [1], "return_token_ids": True}, "/v1/completions")
    assert "return_token_ids" not in dynamo.upstream_body(asked, "d", "s") and asked.client_token_ids


def _chunk(
    index: int, text: str, finish: str | None = None, engine_data: dict | None = None, worker: int | None = None
) -> dict:
    chunk = {
        "id": "c1",
        "created": 5,
        "model": "deployments/org/x",
        "object": "text_completion",
        "choices": [
            {
                "index": index,
                "text": text,
                **({"finish_reason": finish} if finish else {}),
                "logprobs": {"tokens": [f"token_id:{len(text)}"], "token_logprobs": [-1.0]},
            }
        ],
    }
    nvext = {}
    if engine_data is not None:
        nvext["engine_data"] = engine_data
    if worker is not None:
        nvext["worker_id"] = {"prefill_worker_id": worker, "decode_worker_id": worker}
    if nvext:
        chunk["nvext"] = nvext
    return chunk


def test_adopt_and_assemble_give_exact_spans_per_choice():
    workers = {0xABC: "replica-a", 0xDEF: "replica-b"}
    plan = plan_request({"model": "m", "prompt": [1], "n": 2}, "/v1/completions")
    assembler = dynamo.Assembler(chat=False)
    chunks = [
        _chunk(0, "a"),
        _chunk(1, "x"),
        _chunk(
            0,
            "b",
            "length",
            {
                "completion_token_ids": [7, 8],
                "weight_versions": [{"version": "s1", "start": 0, "end": 1}, {"version": "s2", "start": 1, "end": 2}],
            },
            0xDEF,
        ),
        _chunk(
            1,
            "y",
            "length",
            {"completion_token_ids": [9, 10], "weight_versions": [{"version": "s2", "start": 0, "end": 2}]},
            0xDEF,
        ),
        {
            "id": "c1",
            "created": 5,
            "model": "deployments/org/x",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 4},
        },
    ]
    served = set()
    for chunk in chunks:
        replica = dynamo.adopt(chunk, workers, "my-model")
        if replica is not None:
            served.add(replica)
        assert "nvext" not in chunk and chunk["model"] == "my-model"
        assembler.add(chunk)
    assert served == {"replica-b"}
    answer = assembler.answer()
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 4
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == [
        (0, "ab", "length"),
        (1, "xy", "length"),
    ]
    assert answer["choices"][0]["logprobs"]["tokens"] == ["token_id:1", "token_id:1"]
    for choice in answer["choices"]:
        finish_choice(plan, choice)
    assert version_spans(plan) == [
        {"choice": 0, "identity": "s1", "start": 0, "end": 1},
        {"choice": 0, "identity": "s2", "start": 1, "end": 2},
        {"choice": 1, "identity": "s2", "start": 0, "end": 2},
    ]
    assert all("token_ids" not in c and "weight_versions" not in c for c in answer["choices"])


ROUTES = {"data": "AAECAw==", "shape": [2, 1, 2], "start": 0, "dtype": "uint8"}  # as Dynamo's worker sends them


@pytest.mark.parametrize("stream", [False, True])
def test_dynamos_routed_experts_leave_the_choice_for_the_plan(stream):
    # Dynamo's vLLM worker puts a choice's routes in engine_data on its finishing chunk, already
    # in the guide's {data, shape, start, dtype}; nvext.routed_experts comes from the plan.
    plan = plan_request(
        {
            "model": "m",
            "prompt": [1, 2],
            "max_tokens": 1,
            "stream": stream,
            "nvext": {"extra_fields": ["routed_experts"]},
        },
        "/v1/completions",
        {"enable-return-routed-experts": ""},
    )
    chunks = [_chunk(0, "a", "length", {"completion_token_ids": [7], "routed_experts": dict(ROUTES)}, 0xDEF)]
    assembler = dynamo.Assembler(chat=False)
    for chunk in chunks:
        dynamo.adopt(chunk, {0xDEF: "r"}, "my-model")
        if stream:
            finish_chunk(plan, chunk)
            assert "routed_experts" not in chunk["choices"][0]
        else:
            assembler.add(chunk)
    if not stream:
        [choice] = assembler.answer()["choices"]
        finish_choice(plan, choice)
        assert "routed_experts" not in choice
    assert plan.routed_experts == {0: ROUTES}
    assert translate_routed_experts(plan.routed_experts[0]) == ROUTES


def test_assembler_builds_a_chat_message():
    assembler = dynamo.Assembler(chat=True)
    for part in ({"role": "assistant", "content": "He"}, {"content": "llo"}):
        assembler.add({"id": "c", "choices": [{"index": 0, "delta": part}]})
    assembler.add({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    answer = assembler.answer()
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert answer["choices"][0]["finish_reason"] == "stop"


def test_names_of_a_dynamo_deployment():
    assert dynamo_namespace("deployments/Org_A/x.1") == "rollouts-deployments-org-a-x-1"
    assert dynamo_model("deployments/org/x") == "deployments/org/x"


class _Engine:
    """A stand-in for vLLM's AsyncLLM: records calls, fails where told."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode, clear_cache))

    async def collective_rpc(self, method: str, timeout, args, kwargs):
        if method == "boom":
            raise RuntimeError("worker failed")
        return [{"method": method, "args": list(args)}, 3]


class _Endpoint:
    def __init__(self) -> None:
        self.registered = True

    async def unregister_endpoint_instance(self) -> None:
        self.registered = False

    async def register_endpoint_instance(self) -> None:
        self.registered = True

    def connection_id(self) -> int:
        return 0xABC

    async def client(self) -> _Client:
        return _Client(self)


class _Client:
    """A stand-in for Dynamo's discovery client of the endpoint: lists it while registered."""

    def __init__(self, endpoint: _Endpoint) -> None:
        self.endpoint = endpoint

    async def wait_for_instances(self) -> list[int]:
        return self.instance_ids()

    def instance_ids(self) -> list[int]:
        return [0x123, *([0xABC] if self.endpoint.registered else [])]


def test_control_routes_need_the_secret_and_answer_errors_in_the_body():
    engine, endpoint = _Engine(), _Endpoint()
    routes = control_routes(engine, endpoint, "s3cret")
    run = asyncio.run
    assert run(routes["pause"]({"mode": "keep"}))["error"]["code"] == 401
    assert run(routes["pause"]({"secret": "nope", "mode": "keep"}))["error"]["code"] == 401
    assert engine.calls == []
    assert run(routes["pause"]({"secret": "s3cret", "mode": "keep", "clear_cache": True})) == {"status": "paused"}
    assert engine.calls == [("pause", "keep", True)]
    assert run(routes["collective_rpc"]({"secret": "s3cret", "method": "m", "args": [1]})) == {
        "results": [{"method": "m", "args": [1]}, "3"]
    }
    failed = run(routes["collective_rpc"]({"secret": "s3cret", "method": "boom"}))
    assert failed["error"]["code"] == 500 and "worker failed" in failed["error"]["message"]
    assert run(routes["collective_rpc"]({"secret": "s3cret"}))["error"]["code"] == 400
    assert run(routes["instances"]({"secret": "s3cret"})) == {"worker_ids": [0x123, 0xABC]}
    assert run(routes["leave"]({"secret": "s3cret"})) == {"status": "left"} and not endpoint.registered
    assert run(routes["instances"]({"secret": "s3cret"})) == {"worker_ids": [0x123]}
    assert run(routes["join"]({"secret": "s3cret"})) == {"status": "joined"} and endpoint.registered
    assert run(routes["instance"]({"secret": "s3cret"})) == {"worker_id": 0xABC}


def _preprocessed(annotations=None, max_tokens=8, token_ids=(5, 6), probe=False) -> dict:
    request = {"token_ids": list(token_ids), "stop_conditions": {"max_tokens": max_tokens}}
    if annotations is not None:
        request["annotations"] = list(annotations)
    if probe:
        request["probe"] = True
    return request


def test_the_worker_serves_only_requests_that_carry_the_request_plane_secret():
    good = "rollouts-request-secret:s3cret"
    request = _preprocessed([good, "other"])
    assert carries_secret(request, "s3cret") and request["annotations"] == ["other"]  # removed
    for given in (
        None,
        [],
        ["rollouts-request-secret:wrong"],
        ["other"],
        [good, good + "x"],
        ["rollouts-request-secret:"],
    ):
        assert not carries_secret(_preprocessed(given), "s3cret"), given
    assert not carries_secret("not a dict", "s3cret") and not carries_secret({"annotations": "x"}, "s3cret")

    marked = lambda r: r.get("probe") is True  # noqa: E731 - Dynamo's marker, in miniature
    assert is_canary(_preprocessed(max_tokens=1, token_ids=(1,), probe=True), marked)
    # The marker alone gets no completion: more prompt or more tokens than Dynamo's canary is refused.
    assert not is_canary(_preprocessed(max_tokens=1, token_ids=(1,)), marked)
    assert not is_canary(_preprocessed(max_tokens=2, token_ids=(1,), probe=True), marked)
    assert not is_canary(_preprocessed(max_tokens=1, token_ids=(1, 2), probe=True), marked)

    served: list[dict] = []

    async def generate(request, context):
        served.append(request)
        yield {"token_ids": [7]}

    handler = SpanRecorder().wrap_handler(generate, lambda r: is_canary(r, marked), "s3cret")

    async def run(request):
        return [out async for out in handler(request, None)]

    with pytest.raises(PermissionError, match="no valid rollouts request secret"):
        asyncio.run(run(_preprocessed(["rollouts-request-secret:wrong"])))
    assert served == [] and "gateway" in REFUSED
    assert asyncio.run(run(_preprocessed([good]))) == [{"token_ids": [7]}]
    assert asyncio.run(run(_preprocessed(max_tokens=1, token_ids=(1,), probe=True))) == [{"token_ids": [7]}]
    assert len(served) == 2 and served[0]["annotations"] == []


def test_dynamos_own_engine_routes_answer_only_the_engines_secret():
    """What Dynamo's worker registers through our GuardedRuntime (its sleep, pause_generation,
    update_weights_from_disk, ...) runs only for a body with the engine's secret, which it never
    sees; everything else of the runtime is the runtime's own."""
    registered: dict = {}
    runtime = SimpleNamespace(
        register_engine_route=lambda name, cb: registered.__setitem__(name, cb), namespace=lambda: "ns"
    )
    guarded = GuardedRuntime(runtime, "s3cret")
    calls: list[dict] = []

    async def update_weights_from_disk(body):
        calls.append(body)
        return {"status": "ok"}

    guarded.register_engine_route("update_weights_from_disk", update_weights_from_disk)
    assert guarded.namespace() == "ns"
    route = registered["update_weights_from_disk"]
    for body in ({}, {"path": "/x"}, {"path": "/x", "secret": "wrong"}, None):
        assert asyncio.run(route(body))["error"]["code"] == 401, body
    assert calls == []
    assert asyncio.run(route({"path": "/x", "secret": "s3cret"})) == {"status": "ok"}
    assert calls == [{"path": "/x"}]


def test_span_recorder_stamps_each_finishing_choice():
    recorder = SpanRecorder()
    span = SimpleNamespace(version="v2", start=0, end=2)

    async def generate(prompt, params, request_id):
        yield SimpleNamespace(outputs=[SimpleNamespace(index=0, finish_reason=None, weight_versions=None)])
        yield SimpleNamespace(
            outputs=[
                SimpleNamespace(index=0, finish_reason="length", weight_versions=[span]),
                SimpleNamespace(index=1, finish_reason="stop", weight_versions=None),
            ]
        )

    recording = recorder.wrap_generate(generate)

    async def generate_tokens(prompt, params, request_id):
        async for _ in recording(prompt, params, request_id):
            pass
        yield {"index": 0, "token_ids": [1]}
        yield {"index": 0, "token_ids": [2], "finish_reason": "length"}
        yield {"index": 1, "token_ids": [3], "finish_reason": "stop"}

    async def collect():
        return [out async for out in recorder.wrap_tokens(generate_tokens)(None, None, "r1")]

    outs = asyncio.run(collect())
    assert "engine_data" not in outs[0]
    assert outs[1]["engine_data"] == {"weight_versions": [{"version": "v2", "start": 0, "end": 2}]}
    assert "engine_data" not in outs[2]  # vLLM reported no spans for it: nothing is made up
    assert recorder.final == {}


def test_dynamos_400_details_are_spelled_out():
    explained = dynamo.explain("Invalid request", {"type": "context_length", "limit": 1024, "actual": 100002})
    assert explained == (
        "Invalid request: the prompt's tokens plus max_tokens come to 100002, more than the "
        "model's context length 1024: lower max_tokens or shorten the prompt"
    )
    assert (
        dynamo.explain("Invalid request", {"type": "other", "field": "x"}) == "Invalid request (type: other, field: x)"
    )
    assert dynamo.explain("Bad temperature", {}) == "Bad temperature"


def test_served_by_reads_the_worker_without_changing_the_payload():
    workers = {0xAB: "replica-a"}
    data = '{"choices": [], "nvext": {"worker_id": {"decode_worker_id": 171}}}'
    assert dynamo.served_by(data, workers) == "replica-a"
    assert dynamo.served_by('{"choices": []}', workers) is None
    assert dynamo.served_by("[DONE]", workers) is None
    assert dynamo.served_by('{"nvext": {"worker_id": {"decode_worker_id": 5}}}', workers) is None


def test_chat_top_logprobs_are_the_first_k_of_the_engines_list_as_vllm_gives_them():
    """Dynamo passes the engine's whole list (the sampled token first, then the k most likely:
    k + 1 entries when the sampled one is not among them); vLLM's chat server gives its first k."""
    plan = plan_request(
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
        "/v1/chat/completions",
        {},
    )
    entry = {
        "token": "a",
        "logprob": -7.9,
        "top_logprobs": [
            {"token": "a", "logprob": -7.9},
            {"token": "b", "logprob": -6.4},
            {"token": "c", "logprob": -6.5},
        ],
    }
    for finish in (lambda c: finish_chunk(plan, {"choices": [c]}), lambda c: finish_choice(plan, c)):
        choice = {"index": 0, "logprobs": {"content": [json.loads(json.dumps(entry))]}}
        finish(choice)
        assert [t["token"] for t in choice["logprobs"]["content"][0]["top_logprobs"]] == ["a", "b"]
    # Completions keep the list as the engine gives it (OpenAI: up to logprobs + 1 entries).
    plan = plan_request({"prompt": [1, 2], "logprobs": 2}, "/v1/completions", {})
    choice = {"index": 0, "logprobs": {"top_logprobs": [{"a": -1.0, "b": -2.0, "c": -3.0}]}}
    finish_choice(plan, choice)
    assert len(choice["logprobs"]["top_logprobs"][0]) == 3
