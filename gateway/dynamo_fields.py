"""Which of vLLM's OpenAI request fields a dynamo deployment (``runtime.engine: dynamo-vllm``) takes.

``dynamo_request(body, chat, stream)`` returns a copy of the body for Dynamo's frontend, or
raises ``gateway.nvext.RequestError`` (400) whose message starts with the field's name. The
tables record what Dynamo 1.6.1 does with each field (docs/field-notes.md): ``PASSED`` as they
are; ``IGNORED`` (taken but not done) and ``REFUSED`` (Dynamo's 400) are removed when they ask
for nothing beyond vLLM's default and refused otherwise; ``add_special_tokens`` ``false`` is
removed (what Dynamo does anyway), ``true`` refused; ``return_token_ids`` and
``prompt_logprobs`` are answered from the worker's ``engine_data`` (``gateway/dynamo.py``).
A field in no table goes to Dynamo as it is.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.nvext import RequestError

# vLLM's sampling and output extras Dynamo honours (besides OpenAI's own: model, prompt,
# messages, max_tokens, max_completion_tokens, temperature, top_p, n, stop, seed, logprobs,
# top_logprobs, presence_penalty, frequency_penalty, stream, stream_options, user).
PASSED = (
    "return_tokens_as_token_ids", "min_tokens", "skip_special_tokens", "include_stop_str_in_output",
    "ignore_eos", "top_k", "min_p", "repetition_penalty", "stop_token_ids", "allowed_token_ids",
    "logprob_token_ids", "cache_salt",
)  # fmt: skip
# Taken by Dynamo but not applied: refused unless the value asks for nothing.
IGNORED: dict[str, tuple[Any, ...]] = {"echo": (False,), "logit_bias": ({},), "suffix": ("",)}
# Refused by Dynamo: the values that ask for nothing beyond vLLM's default are removed.
REFUSED: dict[str, tuple[Any, ...]] = {
    "spaces_between_special_tokens": (True,),
    "truncate_prompt_tokens": (),
    "bad_words": ([],),
    "priority": (0,),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "structured_outputs": (),
    "kv_transfer_params": ({},),
    "return_prompt_text": (False,),
    "vllm_xargs": ({},),
    "request_id": (),
    "routed_experts_prompt_start": (0,),
    "include_reasoning": (True,),
    "documents": ([],),
    "chat_template": (),
}
REFUSED_ON_COMPLETIONS: dict[str, tuple[Any, ...]] = {"response_format": ({"type": "text"},)}
REFUSED_ON_CHAT: dict[str, tuple[Any, ...]] = {"prompt_embeds": ()}
_WHY = "on a dynamo-vllm deployment (NVIDIA Dynamo's frontend "


def _same(value: Any, nothing: Any) -> bool:
    """``value`` is ``nothing`` (``1`` is ``1.0``; ``0`` is not ``False``)."""
    return isinstance(value, bool) == isinstance(nothing, bool) and value == nothing


def dynamo_request(body: dict[str, Any], chat: bool, stream: bool) -> dict[str, Any]:
    """``body`` as Dynamo's frontend should get it (module docstring)."""
    out = dict(body)
    out.pop("return_token_ids", None)  # answered from engine_data (gateway/dynamo.py)
    if stream and out.get("prompt_logprobs") not in (None, 0):
        raise RequestError("prompt_logprobs: not available when stream is true (as on vLLM)")
    if out.pop("add_special_tokens", None):
        raise RequestError(
            f"add_special_tokens: true is not supported {_WHY}tokenizes without special "
            "tokens; send false, or put them in a token-id prompt)"
        )
    refused = {**REFUSED, **(REFUSED_ON_CHAT if chat else REFUSED_ON_COMPLETIONS)}
    for table, why in ((IGNORED, "accepts it but does not apply it"), (refused, "refuses it")):
        for name, nothing in table.items():
            if name not in out:
                continue
            value = out.pop(name)
            if value is not None and not any(_same(value, n) for n in nothing):
                raise RequestError(f"{name}: {json.dumps(value)} is not supported {_WHY}{why})")
    return out
