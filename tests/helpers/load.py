"""Load across a hot-load: 64 concurrent rollout clients (token-id prompts, temperature 1,
logprobs with token ids, a cache salt; half streamed) keep requests going through the stack's
gateway while a delta hot-load (PRESERVE) walks the 2 replicas. Every request must complete
whole (0 failures). Printed: output tokens/s before, during and after the hot-load (gateway
clock; no thresholds: the machine is shared). tests/gateway/test_load.py runs it on the gateway
tests' Dynamo workers."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import httpx

from snapshots.writer import write_delta
from tests.helpers.gateway import GatewayDeployment, Served, publish, random_prompt, rollouts_client, serve_full
from tests.helpers.trainer import train_step

CLIENTS = 64
MAX_TOKENS = 32
WINDOW_S = 10.0


async def load_across_a_delta_hot_load(gw: GatewayDeployment, tmp: Path) -> None:
    """The test (module docstring) on ``gw``'s deployment, whatever its engine."""
    base_identity = await asyncio.to_thread(serve_full, gw, gw.base_model, "load-base")
    new_dir = await asyncio.to_thread(train_step, gw.base_model, tmp / "new", seed=42)
    identity = f"load-delta-{uuid.uuid4().hex[:8]}"
    stats = await asyncio.to_thread(
        write_delta, gw.base_model, new_dir, tmp / identity, version=identity, base_version=base_identity
    )
    assert stats.changed > 0

    stop = asyncio.Event()
    token_times: list[float] = []  # one entry per output token, when the gateway delivered it
    failures: list[str] = []
    spans: list[tuple[float, float]] = []
    salt = f"load-{uuid.uuid4().hex[:6]}"

    async def client_loop(client: httpx.AsyncClient, k: int) -> None:
        stream = k % 2 == 0
        while not stop.is_set():
            body = {
                "model": gw.model,
                "prompt": random_prompt(16),
                "max_tokens": MAX_TOKENS,
                "temperature": 1.0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
                "stream": stream,
                "nvext": {"cache_salt": salt},
            }
            started = time.monotonic()
            try:
                async with client.stream("POST", "/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        failures.append(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
                        continue
                    if stream:
                        got, done = 0, False
                        async for line in resp.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                done = True
                                continue
                            event = json.loads(line[6:])
                            if "error" in event:
                                failures.append(f"error event: {event['error']}")
                                break
                            for choice in event.get("choices") or []:
                                n = len((choice.get("logprobs") or {}).get("tokens") or [])
                                got += n
                                token_times.extend([time.monotonic()] * n)
                        if not done or got != MAX_TOKENS:
                            failures.append(f"stream incomplete: {got} tokens, [DONE] {done}")
                    else:
                        data = json.loads(await resp.aread())
                        tokens = data["choices"][0]["logprobs"]["tokens"]
                        token_times.extend([time.monotonic()] * len(tokens))
                        if len(tokens) != MAX_TOKENS or not all(t.startswith("token_id:") for t in tokens):
                            failures.append(f"answer incomplete: {len(tokens)} tokens")
            except Exception as exc:  # noqa: BLE001 - counted as a failure, asserted below
                failures.append(repr(exc))
            spans.append((started, time.monotonic()))

    limits = httpx.Limits(max_connections=CLIENTS + 8, max_keepalive_connections=CLIENTS + 8)
    async with httpx.AsyncClient(base_url=gw.url, headers=gw.headers, timeout=600, limits=limits) as client:
        t0 = time.monotonic()
        workers = [asyncio.ensure_future(client_loop(client, k)) for k in range(CLIENTS)]
        await asyncio.sleep(WINDOW_S)
        hl_start = time.monotonic()
        hot_load = await asyncio.to_thread(publish, gw, tmp / identity, identity, previous=base_identity, wait=False)
        with rollouts_client(gw) as api:
            hot_load = await asyncio.to_thread(api.wait_hot_load, hot_load.id)
            replicas = await asyncio.to_thread(api.list_replicas, hot_load.id)
        hl_end = time.monotonic()
        await asyncio.sleep(WINDOW_S)
        stop.set()
        t_stop = time.monotonic()
        await asyncio.gather(*workers)
    gw.served = Served(identity, new_dir)

    assert hot_load.state == "HOT_LOAD_STATE_COMPLETED", hot_load.raw["status"]
    assert [r.current_snapshot_identity for r in replicas] == [identity] * 2
    during = sum(1 for t in token_times if hl_start <= t <= hl_end)
    outside = sum(1 for t in token_times if t0 <= t < hl_start or hl_end < t <= t_stop)
    spanning = sum(1 for a, b in spans if a < hl_start and b > hl_start)
    print(
        f"\nload: {CLIENTS} clients, {len(spans)} requests, {len(failures)} failures, {len(token_times)} tokens; "
        f"{spanning} requests in flight when the hot-load started; hot-load {hl_end - hl_start:.2f}s "
        f"(pause per replica: {', '.join(str(r.raw.get('pauseMs')) for r in replicas)} ms)\n"
        f"throughput outside the hot-load: {outside / ((hl_start - t0) + (t_stop - hl_end)):.1f} tokens/s; "
        f"during: {during / (hl_end - hl_start):.1f} tokens/s"
    )
    assert failures == [], failures[:10]
    assert spanning >= CLIENTS // 2
