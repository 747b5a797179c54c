"""common/flight.py: callers share one call in progress; with `after_call`, a caller that arrives
while one is in progress gets the one queued behind it; a caller that gives up cancels nothing."""

from __future__ import annotations

import asyncio

from common.flight import SingleFlight


class Calls:
    """A call the test ends when it chooses; counts how many started."""

    def __init__(self) -> None:
        self.started = 0
        self.release: list[asyncio.Event] = []

    async def __call__(self) -> int:
        self.started += 1
        n = self.started
        gate = asyncio.Event()
        self.release.append(gate)
        await gate.wait()
        return n


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_callers_share_the_call_in_progress_and_a_later_one_starts_anew():
    flight, calls = SingleFlight(), Calls()
    a = asyncio.ensure_future(flight.join(calls))
    await _settle()
    b = asyncio.ensure_future(flight.join(calls))
    await _settle()
    assert calls.started == 1
    calls.release[0].set()
    assert await asyncio.gather(a, b) == [1, 1]
    c = asyncio.ensure_future(flight.join(calls))
    await _settle()
    calls.release[1].set()
    assert await c == 2 and calls.started == 2


async def test_after_call_joins_the_call_queued_behind_the_one_in_progress():
    flight, calls = SingleFlight(after_call=True), Calls()
    first = asyncio.ensure_future(flight.join(calls))
    await _settle()
    late = [asyncio.ensure_future(flight.join(calls)) for _ in range(3)]
    await _settle()
    assert calls.started == 1  # the queued call waits for the current one to end
    calls.release[0].set()
    assert await first == 1
    await _settle()
    assert calls.started == 2
    calls.release[1].set()
    assert await asyncio.gather(*late) == [2, 2, 2]


async def test_a_caller_that_gives_up_does_not_cancel_the_call_for_the_others():
    flight, calls = SingleFlight(), Calls()
    quitter = asyncio.ensure_future(flight.join(calls))
    stayer = asyncio.ensure_future(flight.join(calls))
    await _settle()
    quitter.cancel()
    await _settle()
    assert flight.running()
    calls.release[0].set()
    assert await stayer == 1
    assert flight.cancel() == []  # nothing left in progress
