"""The engines' `swap_in_pause` route (replica/engine/swap.py, served by replica/engine/control.py
on both engine kinds; here through the Dynamo worker's routes): a whole swap in one call, against
a stand-in for vLLM's AsyncLLM that records every call. Pause, label, swap and proof, resume, in
that order; a read-back that differs, a proof of the wrong count or a failing swap restores the
previous label (and discards the stage) before the resume, which always runs; the answer carries
the engine's own timings, the window covering the rest. A held swap (the "swap" fault point)
stops after its write, paused, until ``swap_hook`` says proceed (proof) or not (roll-back)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from replica.engine.dynamo_routes import Gate, SpanRecorder, control_routes


class Engine:
    def __init__(self, swap: Any) -> None:
        self.swap = swap  # what swap_and_commit_staged answers, or an exception to raise
        self.calls: list[tuple] = []

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("label", version))

    async def collective_rpc(self, method: str, args: tuple = (), **kw: Any) -> list[Any]:
        self.calls.append((method, *args))
        if method == "swap_and_commit_staged" and isinstance(self.swap, Exception):
            raise self.swap
        if method in ("swap_and_commit_staged", "commit_staged"):
            return [self.swap]
        if method == "swap_staged":
            return [{"copy_s": 0.002}]
        return [{"discarded": "s2", "rolled_back": True}]


def swap(engine: Engine, **extra: Any) -> dict[str, Any]:
    route = control_routes(engine, None, "k")["swap_in_pause"]
    return asyncio.run(route({"secret": "k", "label": "s2", "previous": "s1", "clear_cache": False, **extra}))


def test_a_swap_in_one_call_pauses_labels_swaps_and_resumes_in_order() -> None:
    engine = Engine({"verified": 3, "verify_s": 0.001, "copy_s": 0.002})
    answer = swap(engine, expected=3)
    assert engine.calls == [
        ("pause", "keep", False),
        ("label", "s2"),
        ("swap_and_commit_staged", "s2", False, False),
        ("resume",),
    ]
    assert answer["result"]["verified"] == 3
    t = answer["timings_ms"]
    assert set(t) == {"pause", "label", "swap", "resume", "window"}
    assert t["window"] >= t["pause"] + t["label"] + t["swap"] + t["resume"] - 0.01


def test_a_read_back_that_differs_puts_the_previous_label_back_before_the_resume() -> None:
    engine = Engine({"verified": 0, "read_back_failed": ["w1"]})
    answer = swap(engine, expected=3)
    assert answer["result"]["read_back_failed"] == ["w1"]
    assert engine.calls[-2:] == [("label", "s1"), ("resume",)]


@pytest.mark.parametrize("failure", [RuntimeError("copy failed"), None])
def test_a_failed_swap_or_a_short_proof_is_discarded_and_the_label_restored(failure) -> None:
    engine = Engine(failure if failure is not None else {"verified": 2})
    answer = swap(engine, expected=3)
    assert answer["error"]["code"] == 500
    assert ("copy failed" if failure else "proved 2 of 3") in answer["error"]["message"]
    assert engine.calls[-3:] == [("discard_staged",), ("label", "s1"), ("resume",)]


def test_label_and_previous_are_required() -> None:
    engine = Engine({"verified": 1})
    route = control_routes(engine, None, "k")["swap_in_pause"]
    assert asyncio.run(route({"secret": "k", "label": "s2"}))["error"]["code"] == 400
    assert engine.calls == []


class Core:
    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    async def pause_scheduler_async(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("core pause", mode, clear_cache))


class Renderer:
    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    async def clear_mm_cache_async(self) -> None:
        self.calls.append(("clear mm cache",))


@pytest.mark.parametrize("clear_cache", [False, True])
def test_an_async_llm_is_paused_through_its_engine_core_without_the_closing_sleep(clear_cache: bool) -> None:
    """vLLM's AsyncLLM.pause_generation ends with a 20 ms sleep inside the pause; the route calls
    what it wraps (the engine core's pause, and the renderer's cache clear when asked) instead."""
    engine = Engine({"verified": 1})
    engine.engine_core, engine.renderer = Core(engine.calls), Renderer(engine.calls)
    route = control_routes(engine, None, "k")["swap_in_pause"]
    asyncio.run(route({"secret": "k", "label": "s2", "previous": "s1", "clear_cache": clear_cache, "expected": 1}))
    pause = [("clear mm cache",)] if clear_cache else []
    assert engine.calls[: len(pause) + 2] == [*pause, ("core pause", "keep", clear_cache), ("label", "s2")]


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_the_pause_route_pauses_the_engine_core_in_the_mode_asked(mode: str) -> None:
    engine = Engine({"verified": 1})
    engine.engine_core, engine.renderer = Core(engine.calls), Renderer(engine.calls)
    route = control_routes(engine, None, "k")["pause"]
    assert asyncio.run(route({"secret": "k", "mode": mode})) == {"status": "paused"}
    assert engine.calls == [("core pause", mode, False)]


def test_a_closed_gate_holds_every_request_until_the_open_route() -> None:
    """A worker started gated (replica.engine.dynamo_routes, 3): a request the frontend routes
    before the agent loaded the deployment's weights waits, then runs."""
    gate = Gate(closed=True)
    recorder = SpanRecorder(gate)
    ran: list[str] = []

    async def generate(request, context):
        ran.append(request["id"])
        yield "out"

    handler = recorder.wrap_handler(generate, lambda request: request.get("probe") is True)

    async def run() -> None:
        # Dynamo's health probe passes (the worker could not report ready otherwise).
        assert await asyncio.wait_for(anext(handler({"id": "probe", "probe": True}, None)), 5) == "out"
        request = asyncio.ensure_future(anext(handler({"id": "r1"}, None)))
        await asyncio.sleep(0.05)
        assert not request.done() and ran == ["probe"]
        route = control_routes(Engine({"verified": 1}), None, "k", gate)["open"]
        assert await route({"secret": "k"}) == {"status": "open"}
        assert await asyncio.wait_for(request, 5) == "out" and ran == ["probe", "r1"]

    asyncio.run(run())


def held(engine: Engine, proceed: bool) -> tuple[dict[str, Any], list[tuple], dict[str, Any]]:
    """A held swap: what its start answers, the calls made while it holds, what the verdict answers."""
    routes = control_routes(engine, None, "k")

    async def run() -> tuple[dict[str, Any], list[tuple], dict[str, Any]]:
        start = await routes["swap_in_pause"](
            {"secret": "k", "label": "s2", "previous": "s1", "expected": 3, "hold": True}
        )
        while_held = list(engine.calls)
        return start, while_held, await routes["swap_hook"]({"secret": "k", "proceed": proceed})

    return asyncio.run(run())


def test_a_held_swap_waits_after_its_write_then_proves_and_resumes() -> None:
    engine = Engine({"verified": 3, "verify_s": 0.001})
    start, while_held, answer = held(engine, proceed=True)
    assert start == {"held": True}
    assert while_held == [("pause", "keep", False), ("label", "s2"), ("swap_staged", "s2")]  # paused, not proven
    assert engine.calls[3:] == [("commit_staged", "s2", False, False), ("resume",)]
    assert answer["result"] == {"verified": 3, "verify_s": 0.001, "copy_s": 0.002}
    assert set(answer["timings_ms"]) == {"pause", "label", "swap", "resume", "window"}


def test_a_held_swap_told_not_to_proceed_rolls_back_and_resumes() -> None:
    engine = Engine({"verified": 3})
    start, _, answer = held(engine, proceed=False)
    assert start == {"held": True}
    assert answer["error"]["code"] == 500 and "stopped the swap where it was held" in answer["error"]["message"]
    assert engine.calls[3:] == [("discard_staged",), ("label", "s1"), ("resume",)]


def test_no_verdict_without_a_held_swap() -> None:
    route = control_routes(Engine({"verified": 1}), None, "k")["swap_hook"]
    assert asyncio.run(route({"secret": "k", "proceed": True}))["error"]["code"] == 400
