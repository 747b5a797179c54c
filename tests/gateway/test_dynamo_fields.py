"""Unit tests: vLLM's OpenAI request fields on a dynamo-vllm deployment (gateway/dynamo_fields.py)
and vLLM's answer shape for ``return_token_ids`` / ``prompt_logprobs`` rebuilt from what Dynamo
reports (gateway/dynamo.py). Through the real frontend and workers: tests/gateway/test_dynamo_stack.py."""

from __future__ import annotations

import pytest

from gateway import dynamo
from gateway.dynamo_fields import IGNORED, PASSED, REFUSED, dynamo_request
from gateway.nvext import RequestError, finish_chunk, plan_request, strip_prompt_ids

# The sampling and output extras RL clients send vLLM (verl, OpenRLHF, slime, cwtrain), each with
# a value that asks for something: every one is taken on a dynamo-vllm deployment.
RL_EXTRAS = {
    "return_token_ids": True, "return_tokens_as_token_ids": True, "prompt_logprobs": 1, "min_tokens": 2,
    "skip_special_tokens": False, "include_stop_str_in_output": True, "ignore_eos": True, "top_k": 20,
    "min_p": 0.05, "repetition_penalty": 1.1, "stop_token_ids": [2], "allowed_token_ids": [5, 6],
    "logprob_token_ids": [5], "seed": 7, "logprobs": 1, "temperature": 1.0, "top_p": 1.0, "n": 4,
    "stop": ["</s>"], "presence_penalty": 0.1, "frequency_penalty": 0.1, "max_tokens": 8,
    "add_special_tokens": False,
    # vLLM's defaults for fields Dynamo refuses: they ask for nothing, so they are removed.
    "spaces_between_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0, "priority": 0,
    "truncate_prompt_tokens": None, "echo": False, "logit_bias": {}, "include_reasoning": True,
}  # fmt: skip
REMOVED = {
    "return_token_ids",
    "add_special_tokens",
    "spaces_between_special_tokens",
    "use_beam_search",
    "length_penalty",
    "priority",
    "truncate_prompt_tokens",
    "echo",
    "logit_bias",
    "include_reasoning",
}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_rl_clients_vllm_extras_are_taken(path):
    chat = path.endswith("chat/completions")
    prompt = {"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": [1, 2, 3]}
    plan = plan_request({"model": "m", **prompt, **RL_EXTRAS}, path)
    body = dynamo.upstream_body(plan, "deployments/o/d", "s3cret")
    assert not REMOVED & set(body)
    # Everything else reaches Dynamo as the client sent it (Dynamo honours these).
    assert {k: body[k] for k in set(RL_EXTRAS) - REMOVED} == {k: RL_EXTRAS[k] for k in set(RL_EXTRAS) - REMOVED}
    assert set(PASSED) - {"cache_salt"} <= set(RL_EXTRAS)  # the table's fields are all in this test
    assert plan.client_token_ids  # the answer carries the ids (below)


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("echo", True, "accepts it but does not apply it"),
        ("logit_bias", {"5": 2.0}, "accepts it but does not apply it"),
        ("suffix", "end", "accepts it but does not apply it"),
        ("add_special_tokens", True, "tokenizes without special tokens"),
        ("spaces_between_special_tokens", False, "refuses it"),
        ("truncate_prompt_tokens", 16, "refuses it"),
        ("bad_words", ["no"], "refuses it"),
        ("use_beam_search", True, "refuses it"),
        ("length_penalty", 0.5, "refuses it"),
        ("priority", 1, "refuses it"),
        ("structured_outputs", {"regex": "a+"}, "refuses it"),
        ("kv_transfer_params", {"x": 1}, "refuses it"),
        ("vllm_xargs", {"x": 1}, "refuses it"),
        ("routed_experts_prompt_start", 3, "refuses it"),
        ("response_format", {"type": "json_object"}, "refuses it"),
        ("use_beam_search", 0, "refuses it"),  # not false: a number where vLLM wants a boolean
    ],
)
def test_what_dynamo_cannot_do_is_a_400_naming_the_field(field, value, why):
    plan = plan_request({"model": "m", "prompt": [1], field: value}, "/v1/completions")
    with pytest.raises(RequestError) as err:
        dynamo.upstream_body(plan, "d", "s")
    assert str(err.value).startswith(f"{field}: ") and "dynamo-vllm deployment" in str(err.value)
    assert why in str(err.value)


def test_tables_do_not_overlap_and_prompt_logprobs_on_a_stream_is_refused():
    assert not set(PASSED) & (set(IGNORED) | set(REFUSED))
    plan = plan_request({"model": "m", "prompt": [1], "prompt_logprobs": 1, "stream": True}, "/v1/completions")
    with pytest.raises(RequestError, match="^prompt_logprobs: not available when stream is true"):
        dynamo.upstream_body(plan, "d", "s")
    assert dynamo_request({"prompt_logprobs": 0}, chat=False, stream=True) == {"prompt_logprobs": 0}


def _finishing(chat: bool, index: int, ids: list[int], engine_data: dict) -> dict:
    part = {"index": index, "finish_reason": "length", **({"delta": {"content": "b"}} if chat else {"text": "b"})}
    return {
        "id": "c",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "model": "x",
        "choices": [part],
        "nvext": {"engine_data": engine_data},
    }


PROMPT_LP = [None, {"9": {"logprob": -1.5, "rank": 3}, "4": {"logprob": -0.2, "rank": 1}}]
VLLM_PROMPT_LP = [
    None,
    {
        "9": {"logprob": -1.5, "rank": 3, "decoded_token": None},
        "4": {"logprob": -0.2, "rank": 1, "decoded_token": None},
    },
]


def test_completion_answers_token_ids_prompt_ids_and_prompt_logprobs_as_vllm_does():
    plan = plan_request(
        {"model": "m", "prompt": [3, 9], "n": 2, "return_token_ids": True, "prompt_logprobs": 1}, "/v1/completions"
    )
    assembler = dynamo.Assembler(chat=False)
    for index, ids in ((0, [7, 8]), (1, [5])):
        chunk = _finishing(
            False,
            index,
            ids,
            {"completion_token_ids": ids, "prompt_token_ids": [3, 9], "prompt_logprobs": PROMPT_LP, "finished": True},
        )
        dynamo.adopt(chunk, {}, "m")
        assembler.add(chunk)
    data = assembler.answer()
    strip_prompt_ids(plan, data)
    # vLLM 0.32's CompletionResponseChoice: token_ids, prompt_token_ids, prompt_logprobs per choice.
    assert [(c["token_ids"], c["prompt_token_ids"], c["prompt_logprobs"]) for c in data["choices"]] == [
        ([7, 8], [3, 9], VLLM_PROMPT_LP),
        ([5], [3, 9], VLLM_PROMPT_LP),
    ]
    assert "prompt_token_ids" not in data


def test_chat_stream_carries_ids_on_the_finishing_chunk_at_vllms_places():
    plan = plan_request(
        {"model": "m", "messages": [], "stream": True, "return_token_ids": True}, "/v1/chat/completions"
    )
    first = {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "a"}}]}
    last = _finishing(True, 0, [7, 8], {"completion_token_ids": [7, 8], "prompt_token_ids": [1, 4, 2]})
    chunks = []
    for chunk in (first, last):
        dynamo.adopt(chunk, {}, "m")
        chunks.append(finish_chunk(plan, chunk))
    # ChatCompletionStreamResponse: prompt_token_ids at the top, token_ids on the choice; the
    # concatenation over the chunks is the choice's completion ids.
    assert [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])] == [7, 8]
    assert chunks[1]["prompt_token_ids"] == [1, 4, 2] and "prompt_token_ids" not in chunks[1]["choices"][0]
    # Without return_token_ids the client sees neither (the gateway still counts the ids).
    quiet = plan_request({"model": "m", "messages": [], "stream": True}, "/v1/chat/completions")
    last = _finishing(True, 0, [7, 8], {"completion_token_ids": [7, 8], "prompt_token_ids": [1, 4, 2]})
    dynamo.adopt(last, {}, "m")
    finish_chunk(quiet, last)
    assert "prompt_token_ids" not in last and "token_ids" not in last["choices"][0]
    assert quiet.token_ids == {0: [7, 8]}


def test_chat_non_streamed_answer_has_prompt_ids_and_logprobs_at_the_top():
    assembler = dynamo.Assembler(chat=True)
    chunk = _finishing(
        True, 0, [7], {"completion_token_ids": [7], "prompt_token_ids": [1, 4], "prompt_logprobs": PROMPT_LP}
    )
    dynamo.adopt(chunk, {}, "m")
    assembler.add(chunk)
    data = assembler.answer()
    assert data["prompt_token_ids"] == [1, 4] and data["prompt_logprobs"] == VLLM_PROMPT_LP
    assert data["choices"][0]["token_ids"] == [7] and "prompt_token_ids" not in data["choices"][0]
