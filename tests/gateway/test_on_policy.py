"""`rollouts.client.on_policy_round` on the real stack: it waits for the round's in-flight
requests, holds new ones back, publishes and hot-loads with RESET_ALL, and returns once every
replica is READY on the new identity. Every token of the next round comes from that identity:
its weights are the counting model (greedy or sampled, token i is followed by i + 1, which the
base model practically never does), and the gateway labels each answer with it, exactly."""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime

import httpx
import pytest

from rollouts.client import RESET_ALL, RoundGate, on_policy_round
from tests.helpers.gateway import (
    CHANCE_RUN,
    Served,
    longest_run,
    random_prompt,
    rollouts_client,
    serve_full,
    succession,
)
from workers.base_model import write_counting_model

pytestmark = pytest.mark.stack


async def rollout(client: httpx.AsyncClient, gw, gate: RoundGate, prompt: list[int], max_tokens: int) -> dict:
    async with gate.arequest():
        body = {
            "model": gw.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "ignore_eos": True,
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
        }
        resp = await client.post("/v1/completions", json=body)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        data["_prompt"], data["_ended"] = prompt, time.time()
        return data


def token_ids(answer: dict) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]


async def test_on_policy_round_every_token_of_the_next_round_is_new(gw, tmp_path_factory):
    base_identity = await asyncio.to_thread(serve_full, gw, gw.base_model, "onp-base")
    counting = write_counting_model(gw.base_model, tmp_path_factory.mktemp("onp") / "counting")
    identity = f"onp-count-{uuid.uuid4().hex[:8]}"
    gate = RoundGate()
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.headers, timeout=600) as client:
        # Round 1 is in flight when the trainer ends it.
        round1 = [asyncio.ensure_future(rollout(client, gw, gate, random_prompt(8), 64)) for _ in range(8)]
        while gate.in_flight < 8:
            await asyncio.sleep(0.05)
        with rollouts_client(gw) as api:
            boundary = asyncio.ensure_future(
                asyncio.to_thread(
                    on_policy_round, api, gw.id, counting, identity, gate=gate, s3=gw.settings.s3_client()
                )
            )
            while gate.is_open:
                await asyncio.sleep(0.01)
            # Requests of the next round that arrive now wait for the boundary.
            early = [asyncio.ensure_future(rollout(client, gw, gate, random_prompt(8), 32)) for _ in range(4)]
            result = await boundary
        round2 = await asyncio.gather(*early, *(rollout(client, gw, gate, random_prompt(8), 32) for _ in range(12)))
    gw.served = Served(identity, counting)

    assert result.drain_s > 0 and result.hot_load.prompt_cache_policy == RESET_ALL
    assert result.hot_load.state == "HOT_LOAD_STATE_COMPLETED" and len(result.replicas) == 2
    assert all(r.state == "READY" and r.current_snapshot_identity == identity for r in result.replicas)
    print(
        f"\non-policy round: drain {result.drain_s:.2f}s, upload {result.upload_s:.2f}s, "
        f"hot-load {result.hot_load_s:.2f}s"
    )
    # Round 1 finished before the hot-load was created, all on the old policy.
    created = datetime.fromisoformat(result.hot_load.raw["status"]["createdAt"].replace("Z", "+00:00")).timestamp()
    for answer in await asyncio.gather(*round1):
        assert answer["_ended"] <= created
        assert answer["nvext"]["weight_versions"]["identity"] == base_identity
        assert longest_run(succession(answer["_prompt"][-1], token_ids(answer))) < CHANCE_RUN  # base: no counting
    for answer in round2:
        wv = answer["nvext"]["weight_versions"]
        assert wv["exact"] and wv["identity"] == identity, wv
        ids = token_ids(answer)
        assert len(ids) == 32 and all(succession(answer["_prompt"][-1], ids)), (answer["_prompt"][-1], ids)
