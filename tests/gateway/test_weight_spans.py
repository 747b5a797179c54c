"""Exact token spans in ``nvext.weight_versions`` on a real vLLM CPU engine whose server reports
vLLM's per-token weight versions on its OpenAI answers (``replica/engine/server.py``, which every
replica runs; see ``gateway/app.py``), behind the gateway app in this process.

Requests run while the engine swaps the base model for the counting model (every token its
predecessor + 1) exactly as a replica's PRESERVE swap does: stage the weights while serving, then
inside one ``pause(keep)`` that keeps the KV cache set the weight-version label to the new
identity, swap the stage in and commit it, resume. The swap starts once every long request has
streamed a token on every choice; inside the pause the test reads how many sequences the engine
froze there (vLLM's ``num_requests_running``: each sampled a token on the old weights and is
unfinished), and exactly that many choices must span the swap (at least one). Every answer's
spans tile its tokens, old identity first, new identity last, and every token inside the new
identity's span must follow the counting rule (the first one too: the counting model looks only
at the current token, whatever cache it runs over), while the old span looks like the base model.
Streamed completions and chat, n = 2; a non-streamed answer before and after names one identity.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from common.settings import ENGINE_SECRET_HEADER, Settings
from contracts.tokens import add_token
from gateway.routing import DeploymentView, ReplicaView, Router
from replica.agent.engine_process import EngineProcess
from tests.helpers import engine_weights
from tests.helpers.engine_cache import model_infos
from tests.helpers.gateway import LocalGateway, check_spans, random_prompt, succession
from tests.helpers.replicas import STEP_DELAY_S, engine_running
from workers.base_model import write_base_model, write_counting_model

pytestmark = pytest.mark.engine
# Tokens per spanning request: the engine must still be generating them when the swap comes,
# although the gateway and this client (one busy process) see their first tokens late under load.
LONG = 1900
MAX_MODEL_LEN = 2048  # the generated model's max_position_embeddings
TOKEN = "spans-test-token"
WORKFLOW_ID, REPLICA = "deployments/org-spans/dep-spans", "spans-0"
# A fixed engine key: the engine's secret is the one the gateway derives for REPLICA.
ENGINE_KEY = "spans-test-engine-key"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spans-models")
    base = write_base_model(root / "base")
    return {"base": base, "counting": write_counting_model(base, root / "counting")}


@pytest.fixture(scope="module")
async def engine(models, tmp_path_factory) -> AsyncIterator[EngineProcess]:
    secret = Settings(home="", ports={}, engine_key=ENGINE_KEY).engine_secret(WORKFLOW_ID, REPLICA)
    url = os.environ.get("ROLLOUTS_TEST_SPANS_ENGINE_URL")
    if url:
        # Development: an engine started as EngineProcess starts it (any served name, this
        # module's secret), serving workers.base_model's base model (tests load the weights they need).
        served = httpx.get(f"{url}/v1/models", headers={ENGINE_SECRET_HEADER: secret})
        yield EngineProcess.attach(url, served_model_name=served.json()["data"][0]["id"], secret=secret)
        return
    eng = EngineProcess(
        models["base"],
        work_dir=tmp_path_factory.mktemp("spans-engine"),
        served_model_name="tiny",
        secret=secret,
        max_model_len=MAX_MODEL_LEN,
        model_info_cache=model_infos(),
    )
    await eng.start(timeout=900)
    try:
        yield eng
    finally:
        await eng.stop()


@pytest.fixture(scope="module")
def gateway(engine, tmp_path_factory) -> Iterator[LocalGateway]:
    home = tmp_path_factory.mktemp("spans-gw")
    add_token(home / "tokens.json", TOKEN, "admin", "org-spans", "test")
    settings = Settings(home=str(home), ports={}, engine_key=ENGINE_KEY)
    router = Router()
    router.set_view(
        DeploymentView(
            deployment_id="dep-spans",
            model_name=engine.served_model_name,
            workflow_id=WORKFLOW_ID,
            engine_config={},
            organization_id="org-spans",
            replicas=(ReplicaView(REPLICA, engine.base_url, "initial"),),
            gateway_ids=(settings.gateway_id,),
        )
    )
    with LocalGateway(settings, router) as gw:
        yield gw


async def swap(engine: EngineProcess, model_dir: Path, identity: str) -> int:
    """What a replica's swap does under PRESERVE: the checkpoint is staged while the engine
    serves, then weights and label change together inside one pause that keeps running requests
    and their KV cache. Returns how many sequences the engine held running in that pause."""
    await engine_weights.stage(engine, model_dir, identity)
    await engine.pause(mode="keep", clear_cache=False)
    try:
        running = await engine_running(engine)
        try:
            await engine.set_weight_version(identity)
            await engine.swap_staged(identity)
            await engine.commit_staged(identity)
        except BaseException:
            with contextlib.suppress(Exception):
                await engine.discard_staged()
            raise
    finally:
        await engine.resume()
    return running


async def ask(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], started: asyncio.Event | None = None
) -> dict[str, Any]:
    """One request through the gateway: ``{"choices": {index: [token ids]}, "prompt": [ids],
    "weight_versions": ...}``; ``started`` is set once every choice of a streamed answer has a token."""
    body = {**body, "return_token_ids": True, "temperature": body.get("temperature", 0), "ignore_eos": True}
    ids: dict[int, list[int]] = {}
    if not body.get("stream"):
        resp = await client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        data = resp.json()
        for c in data["choices"]:
            assert "weight_versions" not in c  # moved into nvext
            ids[c["index"]] = c["token_ids"]
        prompt = data.get("prompt_token_ids") or data["choices"][0].get("prompt_token_ids")
        return {"choices": ids, "prompt": prompt, "weight_versions": data["nvext"]["weight_versions"]}
    prompt, nvext = None, None
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            prompt = prompt or chunk.get("prompt_token_ids")
            nvext = chunk.get("nvext") or nvext
            for c in chunk["choices"]:
                assert "weight_versions" not in c
                prompt = prompt or c.get("prompt_token_ids")
                ids.setdefault(c["index"], []).extend(c.get("token_ids") or [])
                if started is not None and sum(map(bool, ids.values())) == body.get("n", 1):
                    started.set()
    assert nvext is not None
    return {"choices": ids, "prompt": prompt, "weight_versions": nvext["weight_versions"]}


async def all_started(
    engine: EngineProcess, requests: list[tuple[asyncio.Event, asyncio.Future[Any]]], timeout: float
) -> None:
    """Wait until every request's event is set (each choice streamed a token). A request that
    ends first fails here with its own error, not after the timeout; the timeout names how many
    requests had not started, what the engine was running and waiting on, and its log's end."""
    try:
        async with asyncio.timeout(timeout):
            for event, request in requests:
                waiter = asyncio.ensure_future(event.wait())
                try:
                    await asyncio.wait({waiter, request}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    waiter.cancel()
                if not event.is_set():
                    answer = request.result()  # raises the request's own error
                    raise AssertionError(f"a long request ended before every choice streamed a token: {answer}")
    except TimeoutError:
        waiting = sum(not event.is_set() for event, _ in requests)
        metrics = (await engine.request("GET", "/metrics")).text.splitlines()
        queues = [
            line for line in metrics if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        ]
        log = "\n".join(engine.log_path.read_text(errors="replace").splitlines()[-30:])
        raise AssertionError(
            f"{waiting} of {len(requests)} long requests streamed no token in {timeout} s; "
            f"engine: {queues}; its log ends:\n{log}"
        ) from None


def check(answer: dict[str, Any], old: str, new: str) -> bool:
    """Every span claim against the tokens; True when the answer spanned the swap."""
    label = answer["weight_versions"]
    spans = label["spans"]
    assert sorted({s["choice"] for s in spans}) == sorted(answer["choices"]), label
    spanned = False
    for index, ids in answer["choices"].items():
        mine = [s for s in spans if s["choice"] == index]
        # The new identity is the counting model: its span counts from its first token on.
        check_spans(succession(answer["prompt"][-1], ids), mine, old, new, counting=new)
        spanned = spanned or len(mine) == 2
    named = list(dict.fromkeys(s["identity"] for s in spans))
    assert label["identities"] == ([old, new] if new in named and old in named else named)
    assert label["exact"] == (len(named) == 1) and label["identity"] == (named[0] if len(named) == 1 else None)
    return spanned


async def test_spans_say_which_weights_sampled_each_token(engine, gateway, models):
    tag = uuid.uuid4().hex[:6]
    old, new = f"base-{tag}", f"count-{tag}"
    assert await swap(engine, models["base"], old) == 0  # nothing in flight: every answer starts on `old`
    model = engine.served_model_name
    async with httpx.AsyncClient(
        base_url=gateway.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=900
    ) as client:
        before = await ask(client, "/v1/completions", {"model": model, "prompt": random_prompt(6), "max_tokens": 8})
        # The engine's steps slowed until the swap (replica/engine/step_delay.py): the long
        # requests then outlast any stall of this machine before the pause reaches the engine
        # (docs/field-notes.md); `frozen` below checks that they did.
        await engine.collective_rpc("set_step_delay", STEP_DELAY_S)
        started = [asyncio.Event() for _ in range(5)]
        streamed = [
            asyncio.ensure_future(
                ask(
                    client,
                    "/v1/completions",
                    {"model": model, "prompt": random_prompt(6), "max_tokens": LONG, "stream": True},
                    ev,
                )
            )
            for ev in started[:3]
        ]
        chat = asyncio.ensure_future(
            ask(
                client,
                "/v1/chat/completions",
                {
                    "model": model,
                    "messages": [{"role": "user", "content": f"count {uuid.uuid4().hex[:6]}"}],
                    "max_tokens": LONG,
                    "stream": True,
                },
                started[3],
            )
        )
        # n = 2 with sampling: greedy refuses n > 1 (the counting model is just as peaked).
        pair = asyncio.ensure_future(
            ask(
                client,
                "/v1/completions",
                {
                    "model": model,
                    "prompt": random_prompt(6),
                    "max_tokens": LONG,
                    "n": 2,
                    "temperature": 1.0,
                    "seed": 5,
                    "stream": True,
                },
                started[4],
            )
        )
        # Swap once every sequence has streamed a token (each began on `old`); the ones still
        # running are frozen in its pause and finish on `new`.
        try:
            await all_started(engine, list(zip(started, [*streamed, chat, pair], strict=True)), timeout=600)
            frozen = await swap(engine, models["counting"], new)
        finally:
            await engine.collective_rpc("set_step_delay", 0)
        answers = await asyncio.gather(*streamed, chat, pair)
        after = await ask(client, "/v1/completions", {"model": model, "prompt": random_prompt(6), "max_tokens": 8})

    assert before["weight_versions"]["identity"] == old and before["weight_versions"]["exact"] is True
    assert after["weight_versions"]["identity"] == new and after["weight_versions"]["exact"] is True
    assert check(before, old, new) is False and check(after, old, new) is False
    assert frozen >= 1, "no long request was running when the swap paused the engine"
    spanning = 0
    for answer in answers:
        check(answer, old, new)
        for index in answer["choices"]:
            spans = [s["identity"] for s in answer["weight_versions"]["spans"] if s["choice"] == index]
            assert spans in ([old], [old, new]), answer["weight_versions"]
            spanning += spans == [old, new]
    assert spanning == frozen, f"{frozen} sequence(s) frozen in the swap's pause, {spanning} choice(s) span it"
