"""`nvext.weight_versions` on the real stack: which snapshot produced each answer.

Requests run while a PRESERVE hot-load swaps the counting model (every token is its predecessor
+ 1) for the base model (which never does that ``CHANCE_RUN`` tokens in a row). The tokens
themselves then show which weights produced them, so each label can be checked: an answer
labelled exactly with the counting identity counts all the way, one labelled exactly with the
base identity does not count, and an answer that spanned the swap is labelled inexact with both identities, old first
(its tokens count up to the swap, then stop counting).

Spans: every replica's server reports vLLM's per-token weight versions
(``replica/engine/server.py``), so every answer carries ``spans``, each checked against the
tokens (the counting identity's span counts, the base identity's does not).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.helpers.gateway import CHANCE_RUN, check_spans, longest_run, random_prompt, serve_full, succession
from tests.helpers.replicas import assert_every_replica_serves, fault, faults, running_requests, walk_order
from workers.base_model import write_counting_model

pytestmark = pytest.mark.stack
LONG = 900  # tokens per spanning request (the engines' max-model-len is 1024)
IN_FLIGHT = 4  # long requests kept under way during the hot-load


async def long_stream(client: httpx.AsyncClient, gw, prompt: list[int], max_tokens: int) -> tuple[list[int], dict]:
    body = {
        "model": gw.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "nvext": {"extra_fields": ["completion_token_ids"]},
    }
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        events = [ln[6:] async for ln in resp.aiter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    nvext = json.loads(events[-2])["nvext"]
    return nvext["completion_token_ids"], nvext["weight_versions"]


async def test_labels_match_the_weights_that_produced_the_tokens(gw, tmp_path_factory):
    counting = write_counting_model(gw.base_model, tmp_path_factory.mktemp("wv") / "counting")
    inexact, answered = await one_round(gw, counting)
    print(f"\n{inexact}/{answered} answers spanned the hot-load (labelled inexact, both identities)")
    # The first replica's pause began while it was generating a long answer (one_round holds it
    # until then), so at least that answer spans the swap.
    assert inexact >= 1


async def until_generating(replica: dict, timeout: float = 300) -> None:
    """Until the replica's engine is generating a request (vLLM's ``num_requests_running``)."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(running_requests, replica):
        assert time.monotonic() < deadline, f"{replica['name']} ran no request in {timeout:.0f}s"
        await asyncio.sleep(0.1)


async def one_round(gw, counting) -> tuple[int, int]:
    """Serve ``counting``, then hot-load the base model while IN_FLIGHT long requests run back to
    back, the first replica of the walk held just before its pause (fault point ``pause``) until
    it is generating one of them; returns (answers labelled inexact, answers that ran during the
    hot-load)."""
    old = await asyncio.to_thread(serve_full, gw, counting, "wv-count")
    await asyncio.to_thread(assert_every_replica_serves, gw.settings, gw.id, counting)
    first, last = random_prompt(6), random_prompt(6)
    spanning: list[tuple[list[int], tuple[list[int], dict]]] = []
    loaded = asyncio.Event()
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.headers, timeout=600) as client:

        async def back_to_back() -> None:
            # A new request as soon as the last one answered: one is under way at every moment
            # of the hot-load (a fixed batch could all finish before the walk reaches a replica).
            while not loaded.is_set():
                prompt = random_prompt(6)
                spanning.append((prompt, await long_stream(client, gw, prompt, LONG)))

        before = await long_stream(client, gw, first, 16)
        streams = [asyncio.ensure_future(back_to_back()) for _ in range(IN_FLIGHT)]
        await asyncio.sleep(1.0)  # under way when the hot-load starts
        first_replica = (await asyncio.to_thread(walk_order, gw.settings, gw.id))[0]
        before_pause = fault("pause", first_replica["name"], "hold")
        try:
            with faults(gw.settings, before_pause):
                hot_load = asyncio.ensure_future(asyncio.to_thread(serve_full, gw, gw.base_model, "wv-base"))
                await asyncio.to_thread(before_pause.wait_fired, gw.settings, gw.id)
                await until_generating(first_replica)
            new = await hot_load  # the hold ended with the file: the pause begins within a poll
        finally:
            loaded.set()
        await asyncio.gather(*streams)
        after = await long_stream(client, gw, last, 16)
    await asyncio.to_thread(assert_every_replica_serves, gw.settings, gw.id, gw.base_model)

    assert before[1] == {**before[1], "identity": old, "exact": True} and all(succession(first[-1], before[0]))
    assert (
        after[1] == {**after[1], "identity": new, "exact": True}
        and longest_run(succession(last[-1], after[0])) < CHANCE_RUN
    )
    inexact = 0
    for prompt, (ids, label) in [(first, before), *spanning, (last, after)]:
        assert "spans" in label, label  # every replica reports per-token versions
        check_spans(succession(prompt[-1], ids), label["spans"], old, new, counting=old)
    for prompt, (ids, label) in spanning:
        counts = succession(prompt[-1], ids)
        assert len(ids) == LONG
        if label["exact"] and label["identity"] == old:
            assert all(counts), label
        elif label["exact"]:
            assert label["identity"] == new and longest_run(counts) < CHANCE_RUN, label
        else:
            inexact += 1
            assert label["identity"] is None and label["identities"] == [old, new], label
            # The tokens count up to the swap, then stop: the label is right to name both.
            switch = counts.index(False) if False in counts else len(counts)
            assert switch > 0 and longest_run(counts[switch:]) < CHANCE_RUN, (switch, counts[switch:])
    return inexact, len(spanning)
