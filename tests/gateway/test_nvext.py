"""Unit tests of the gateway's request/response translation (gateway/nvext.py) and of the
weight-version labels (gateway/routing.py): no stack, no engine."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from gateway.nvext import (
    RequestError,
    finish_choice,
    finish_chunk,
    plan_request,
    strip_prompt_ids,
    translate_routed_experts,
    version_spans,
)
from gateway.routing import ReplicaView, build_view, weight_versions
from gateway.sse import as_chunks

MOE = {"enable-return-routed-experts": ""}


def npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


# ---------------------------------------------------------------------------- requests
def test_cache_salt_becomes_vllm_field_and_the_rest_passes_through():
    body = {
        "model": "m",
        "prompt": [1, 2, 3],
        "n": 3,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        "seed": 7,
        "stop": ["a", "b"],
        "stop_token_ids": [5],
        "temperature": 1.0,
        "top_p": 0.9,
        "nvext": {"cache_salt": "step-1"},
    }
    plan = plan_request(body, "/v1/completions")
    assert plan.upstream == {**{k: v for k, v in body.items() if k != "nvext"}, "cache_salt": "step-1"}
    assert "nvext" in body  # the client's object is not modified


@pytest.mark.parametrize(
    "nvext, n, config, message",
    [
        ("salt", 1, {}, "nvext must be a JSON object"),
        ({"greed_sampling": True}, 1, {}, "unsupported field(s) greed_sampling"),
        ({"extra_fields": "worker_id"}, 1, {}, "must be a list of strings"),
        ({"extra_fields": ["bogus"]}, 1, {}, "unsupported value(s) bogus"),
        ({"extra_fields": ["completion_token_ids"]}, 2, {}, "requires one choice per request (n=1), got n=2"),
        ({"extra_fields": ["routed_experts"]}, 1, {}, 'does not capture routing; add "enable-return-routed-experts"'),
        ({"extra_fields": ["routed_experts"]}, 2, MOE, "requires one choice per request"),
        ({"cache_salt": "a/b"}, 1, {}, "none of @ / \\"),
        ({"cache_salt": ""}, 1, {}, "non-empty string"),
    ],
)
def test_bad_nvext_is_a_clear_error(nvext, n, config, message):
    with pytest.raises(RequestError) as exc:
        plan_request({"model": "m", "prompt": "x", "n": n, "nvext": nvext}, "/v1/completions", config)
    assert message in str(exc.value)


def test_stop_limits_match_the_hosted_frontend():
    plan_request({"prompt": "x", "stop": ["a"] * 4, "stop_token_ids": [1, 2, 3, 4]}, "/v1/completions")
    with pytest.raises(RequestError, match="at most 4 stop strings"):
        plan_request({"prompt": "x", "stop": ["a"] * 5}, "/v1/completions")
    with pytest.raises(RequestError, match="at most 4 token ids"):
        plan_request({"prompt": "x", "stop_token_ids": [1, 2, 3, 4, 5]}, "/v1/completions")


@pytest.mark.parametrize(
    "fields, path, message",
    [
        ({"n": 65}, "/v1/completions", "n: at most 64 choices per request, got 65"),
        ({"n": 1000}, "/v1/chat/completions", "n: at most 64 choices per request, got 1000"),
        ({"n": 0}, "/v1/completions", "n must be a positive integer"),
        ({"n": "4"}, "/v1/completions", "n must be a positive integer"),
        ({"n": True}, "/v1/completions", "n must be a positive integer"),
        ({"best_of": 100}, "/v1/completions", "best_of: at most 64 per request, got 100"),
        ({"best_of": 2.5}, "/v1/completions", "best_of must be a positive integer"),
        (
            {"n": 16, "prompt": [[1, 2], [3], [4], [5], [6]]},
            "/v1/completions",
            "prompt: a batch of 5 prompts with n=16 asks for 80 sequences; at most 64 per request",
        ),
        (
            {"n": 2, "best_of": 16, "prompt": ["a", "b", "c", "d", "e"]},
            "/v1/completions",
            "prompt: a batch of 5 prompts with n=16 asks for 80 sequences",
        ),
        ({"stream": "false"}, "/v1/completions", "stream must be true or false"),
        ({"stream": 1}, "/v1/chat/completions", "stream must be true or false"),
    ],
)
def test_sequence_cap_and_field_types(fields, path, message):
    with pytest.raises(RequestError) as exc:
        plan_request({"model": "m", "prompt": "x", "messages": [], **fields}, path)
    assert message in str(exc.value)


def test_up_to_the_cap_passes():
    assert plan_request({"prompt": [1, 2], "n": 64}, "/v1/completions").n == 64
    assert plan_request({"prompt": [[1], [2], [3], [4]], "n": 16, "stream": True}, "/v1/completions").stream
    assert plan_request({"messages": [{"role": "user", "content": "x"}], "n": 64}, "/v1/chat/completions").n == 64
    assert plan_request({"prompt": list(range(100)), "n": None, "stream": None}, "/v1/completions").n == 1


def test_routed_experts_allowed_on_a_capturing_deployment():
    plan = plan_request(
        {"prompt": [1], "nvext": {"extra_fields": ["routed_experts", "completion_token_ids"]}}, "/v1/completions", MOE
    )
    assert plan.extra_fields == {"routed_experts", "completion_token_ids"}
    assert plan.upstream["return_token_ids"] is True


def test_chat_logprobs_get_token_ids_and_unasked_ids_are_stripped():
    plan = plan_request({"messages": [], "logprobs": True}, "/v1/chat/completions")
    assert plan.upstream["return_token_ids"] is True and plan.fill_token_id
    choice = {
        "index": 0,
        "token_ids": [11, 12],
        "logprobs": {"content": [{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -2.0}]},
    }
    finish_choice(plan, choice)
    assert [e["token_id"] for e in choice["logprobs"]["content"]] == [11, 12]
    assert "token_ids" not in choice  # the client did not ask for them
    response = {"prompt_token_ids": [1], "choices": [{"prompt_token_ids": [1]}]}
    strip_prompt_ids(plan, response)
    assert response == {"choices": [{}]}


def test_chat_token_ids_kept_when_the_client_asked():
    plan = plan_request({"messages": [], "logprobs": True, "return_token_ids": True}, "/v1/chat/completions")
    chunk = {
        "prompt_token_ids": [1, 2],
        "choices": [{"index": 0, "token_ids": [9], "logprobs": {"content": [{"token": "x", "logprob": -0.5}]}}],
    }
    finish_chunk(plan, chunk)
    assert chunk["choices"][0]["token_ids"] == [9] and chunk["prompt_token_ids"] == [1, 2]
    assert chunk["choices"][0]["logprobs"]["content"][0]["token_id"] == 9


def test_completion_token_ids_accumulate_over_a_stream():
    plan = plan_request(
        {"prompt": [1], "stream": True, "nvext": {"extra_fields": ["completion_token_ids"]}}, "/v1/completions"
    )
    for ids in ([4], [5, 6], []):
        chunk = {"choices": [{"index": 0, "text": "t", "token_ids": ids}]}
        finish_chunk(plan, chunk)
        assert "token_ids" not in chunk["choices"][0]
    assert plan.token_ids[0] == [4, 5, 6]


# ---------------------------------------------------------------------------- routed experts
@pytest.mark.parametrize("dtype, experts", [(np.uint8, 256), (np.uint16, 300)])
def test_routed_experts_translate_to_the_guides_shape(dtype, experts):
    prompt, completion, layers, top_k = 26, 32, 52, 6
    rng = np.random.default_rng(0)
    routes = rng.integers(0, experts, size=(prompt + completion - 1, layers, top_k)).astype(dtype)
    out = translate_routed_experts(npy_b64(routes))
    assert set(out) == {"data", "shape", "start", "dtype"}
    assert out["shape"] == [57, 52, 6] and out["start"] == 0 and out["dtype"] == np.dtype(dtype).name
    # Decoded exactly as the guide shows.
    decoded = np.frombuffer(base64.b64decode(out["data"]), dtype=out["dtype"]).reshape(out["shape"])
    assert np.array_equal(decoded, routes)
    json.dumps(out)  # plain JSON


def test_a_hybrid_model_s_routes_keep_every_decoder_layer_with_zeros_where_no_moe_block():
    """Nemotron-H's MoE layout (Mamba "M", MoE "E", attention "*" decoder layers): vLLM's capturer
    counts every decoder layer and leaves zeros where a layer has no MoE block
    (tests/replica/test_landings.py checks that on vLLM's model class); the translation keeps
    that layer axis and those zeros as they are."""
    pattern = "MEMEM*E" * 7 + "MEMEMEM"  # 56 decoder layers, 24 of them MoE
    tokens, top_k = 9, 6
    rng = np.random.default_rng(0)
    routes = np.zeros((tokens, len(pattern), top_k), dtype=np.int64)  # (a wider dtype: narrowed by value)
    moe = [i for i, kind in enumerate(pattern) if kind == "E"]
    routes[:, moe] = rng.integers(1, 128, size=(tokens, len(moe), top_k))
    out = translate_routed_experts(npy_b64(routes))
    assert out["shape"] == [tokens, len(pattern), top_k] and out["dtype"] == "uint8"
    decoded = np.frombuffer(base64.b64decode(out["data"]), dtype=out["dtype"]).reshape(out["shape"])
    assert np.array_equal(decoded, routes)
    assert not decoded[:, [i for i, kind in enumerate(pattern) if kind != "E"]].any()


def test_routed_experts_from_a_wider_dtype_are_narrowed_and_start_is_kept():
    routes = np.array([[[1, 200]], [[3, 4]]], dtype=np.int32)
    out = translate_routed_experts(npy_b64(routes), start=5)
    assert out["dtype"] == "uint8" and out["start"] == 5 and out["shape"] == [2, 1, 2]
    assert np.frombuffer(base64.b64decode(out["data"]), dtype=np.uint8).tolist() == [1, 200, 3, 4]


def test_routed_experts_decode_with_cwtrain_semantics():
    """cwtrain's decode_routed_experts (reimplemented: it lives in the Python 3.12 venv) checks
    shape [rows, layers, top_k], start 0, an integer dtype and the byte count."""
    routes = np.arange(3 * 4 * 2, dtype=np.uint8).reshape(3, 4, 2)
    out = translate_routed_experts(npy_b64(routes))
    raw = base64.b64decode(out["data"], validate=True)
    assert out["start"] == 0 and len(raw) == int(np.prod(out["shape"])) * np.dtype(out["dtype"]).itemsize


def test_as_chunks_replays_an_answer_as_a_stream():
    data = {
        "id": "c",
        "created": 1,
        "model": "m",
        "usage": {"prompt_tokens": 1},
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
    }
    chunks = as_chunks(data, chat=True)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert chunks[0]["choices"][0]["finish_reason"] == "stop"
    assert chunks[1]["choices"] == [] and chunks[1]["usage"] == {"prompt_tokens": 1}


# ---------------------------------------------------------------------------- weight versions
def test_weight_versions_exact_when_settled_on_one_identity():
    a = ReplicaView("r1", "u", "step-1")
    assert weight_versions(a, a, 3, 3, "r1") == {
        "identity": "step-1",
        "exact": True,
        "identities": ["step-1"],
        "replica": "r1",
    }


def test_weight_versions_not_exact_across_a_change():
    before, after = ReplicaView("r1", "u", "step-1"), ReplicaView("r1", "u", "step-2")
    out = weight_versions(before, after, 3, 4, "r1")
    assert out == {"identity": None, "exact": False, "identities": ["step-1", "step-2"], "replica": "r1"}
    updating = ReplicaView("r1", "u", "step-1", settled=False)
    assert weight_versions(before, updating, 3, 4, "r1")["exact"] is False
    # A hot-load started but has not reached this replica: still exact.
    pending = ReplicaView("r1", "u", "step-1", pending=True)
    assert weight_versions(before, pending, 3, 4, "r1")["exact"] is True
    # Two hot-loads seen in between: the same identity may have been put back (A -> B -> A).
    assert weight_versions(before, pending, 3, 5, "r1")["exact"] is False
    assert weight_versions(before, None, 3, 3, "r1")["exact"] is False


def span(version: str, start: int, end: int) -> dict:
    return {"version": version, "start": start, "end": end}


def test_replica_spans_move_into_the_label():
    """Spans of a non-streamed answer with two choices: one spanned a swap, one finished before."""
    plan = plan_request({"prompt": [1], "n": 2, "return_token_ids": True}, "/v1/completions")
    answer = {
        "choices": [
            {"index": 0, "token_ids": [5, 6, 7], "weight_versions": [span("a", 0, 1), span("b", 1, 3)]},
            {"index": 1, "token_ids": [8], "weight_versions": [span("a", 0, 1)]},
        ]
    }
    for choice in answer["choices"]:
        finish_choice(plan, choice)
    assert all("weight_versions" not in c for c in answer["choices"])  # moved to nvext
    spans = version_spans(plan)
    assert spans == [
        {"choice": 0, "identity": "a", "start": 0, "end": 1},
        {"choice": 0, "identity": "b", "start": 1, "end": 3},
        {"choice": 1, "identity": "a", "start": 0, "end": 1},
    ]
    label = weight_versions(None, None, 0, 0, "r1", spans)
    assert label == {"identity": None, "exact": False, "identities": ["a", "b"], "replica": "r1", "spans": spans}
    one = weight_versions(None, None, 0, 0, "r1", [{"choice": 0, "identity": "b", "start": 0, "end": 4}])
    assert one["identity"] == "b" and one["exact"] is True and one["identities"] == ["b"]


def test_replica_spans_on_a_stream_come_with_each_finish_chunk():
    plan = plan_request({"prompt": [1], "n": 2, "stream": True}, "/v1/completions")
    chunks = [
        {"choices": [{"index": 0, "text": "x", "finish_reason": None}]},
        {"choices": [{"index": 1, "text": "y", "finish_reason": "length", "weight_versions": [span("a", 0, 2)]}]},
        {
            "choices": [
                {
                    "index": 0,
                    "text": "z",
                    "finish_reason": "length",
                    "weight_versions": [span("a", 0, 1), span("b", 1, 2)],
                }
            ]
        },
    ]
    for chunk in chunks[:2]:
        finish_chunk(plan, chunk)
    assert version_spans(plan) is None  # choice 0 has not finished yet
    finish_chunk(plan, chunks[2])
    assert [(s["choice"], s["identity"]) for s in version_spans(plan)] == [(0, "a"), (0, "b"), (1, "a")]
    assert "weight_versions" not in chunks[2]["choices"][0]


@pytest.mark.parametrize(
    "spans, ids",
    [
        (None, [5, 6]),  # a replica that does not report them
        ([span("a", 0, 1)], [5, 6]),  # does not cover the tokens
        ([span("a", 1, 2)], [5, 6]),  # does not start at 0
        ([span("a", 0, 1), span("b", 2, 2)], [5, 6]),  # a gap, an empty span
        ([span("a", 0, 2), span("b", 1, 3)], [5, 6, 7]),  # overlap
        ([{"version": 3, "start": 0, "end": 2}], [5, 6]),  # not a label
        ("a", [5, 6]),
    ],
)
def test_replica_spans_that_do_not_tile_the_tokens_are_not_reported(spans, ids):
    plan = plan_request({"prompt": [1], "return_token_ids": True}, "/v1/completions")
    finish_choice(plan, {"index": 0, "token_ids": ids, "weight_versions": spans})
    assert version_spans(plan) is None
    before = ReplicaView("r1", "u", "a")
    assert "spans" not in weight_versions(before, before, 1, 1, "r1", version_spans(plan))


def test_spans_are_checked_against_the_count_only_without_an_echoed_prompt():
    plan = plan_request({"prompt": [1, 2], "echo": True, "return_token_ids": True}, "/v1/completions")
    finish_choice(plan, {"index": 0, "token_ids": [1, 2, 9], "weight_versions": [span("a", 0, 1)]})
    assert version_spans(plan) == [{"choice": 0, "identity": "a", "start": 0, "end": 1}]


def test_no_tokens_no_spans_and_the_label_from_the_views():
    plan = plan_request({"prompt": [1]}, "/v1/completions")
    finish_choice(plan, {"index": 0, "text": "", "weight_versions": []})
    assert version_spans(plan) == []
    a = ReplicaView("r1", "u", "a")
    assert weight_versions(a, a, 1, 1, "r1", []) == {
        "identity": "a",
        "exact": True,
        "identities": ["a"],
        "replica": "r1",
        "spans": [],
    }


def test_identities_are_in_load_order_across_choices():
    """Choice 0 began after the swap, choice 1 before: the old identity is still first."""
    spans = [
        {"choice": 0, "identity": "b", "start": 0, "end": 3},
        {"choice": 1, "identity": "a", "start": 0, "end": 1},
        {"choice": 1, "identity": "b", "start": 1, "end": 3},
    ]
    assert weight_versions(None, None, 0, 0, "r1", spans)["identities"] == ["a", "b"]
    twice = [
        {"choice": 0, "identity": "a", "start": 0, "end": 1},
        {"choice": 0, "identity": "b", "start": 1, "end": 2},
        {"choice": 0, "identity": "a", "start": 2, "end": 3},
    ]
    assert weight_versions(None, None, 0, 0, "r1", twice)["identities"] == ["a", "b"]


def test_build_view_reads_replica_states_from_the_active_hot_load():
    memo = {
        "deployment": {
            "spec": {"id": "d", "organizationId": "o", "model": {"name": "m"}, "runtime": {"engineConfig": MOE}},
            "status": {"activeHotLoadId": "hl"},
        },
        "replicas": [
            {"name": n, "engineUrl": f"http://{n}", "currentSnapshotIdentity": "a"} for n in ("r1", "r2", "r3")
        ],
    }
    hot = {
        "replicas": [
            {"name": "r1", "state": "READY", "currentSnapshotIdentity": "b"},
            {"name": "r2", "state": "UPDATING", "currentSnapshotIdentity": "a"},
            {"name": "r3", "state": "PENDING_UPDATE", "currentSnapshotIdentity": "a"},
        ]
    }
    view = build_view(memo, "deployments/d", hot, epoch=2)
    assert view is not None and view.engine_config == MOE and view.epoch == 2
    assert [(r.identity, r.settled, r.pending) for r in view.replicas] == [
        ("b", True, False),
        ("a", False, False),
        ("a", True, True),
    ]
    unreadable = build_view(memo, "deployments/d", None, hot_load_readable=False)
    assert unreadable is not None and not any(r.settled for r in unreadable.replicas)
